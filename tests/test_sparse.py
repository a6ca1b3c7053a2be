"""One copy of the weight blocks: GGUF tensors kept only in the q4k packed file (`model.sparse`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec import registry, store
from specdec.model import ModelArgs, native, sparse
from specdec.model import kquant as kq
from specdec.model.families import llama_rows
from specdec.model.gguf_file import _tensor
from specdec.model.gguf_reader import open_gguf

pytestmark = pytest.mark.skipif(not native.available(), reason="the q4k kernel cannot be built on this machine")


@pytest.mark.parametrize("kind", [kq.Q4K, kq.Q6K])
@pytest.mark.parametrize("n", [16, 37, 1])
def test_tiles_and_gguf_bytes_come_back_exactly(kind, n):
    rng = np.random.default_rng(n + kind)
    w = (rng.standard_normal((n, 512)) * rng.uniform(1e-3, 10, (n, 1))).astype(np.float32)
    w[0, :256] = 0  # a zero block
    blocks = kq.quantize_reference(w, kind)
    for field in ("d", "dmin") if kind == kq.Q4K else ("d",):  # GGUF blocks carry float16 scales
        blocks.data[field] = blocks.data[field].astype(np.float16).astype(np.float32)
    for tiles in (kq.tiles(blocks, native.library()), kq.tiles_reference(blocks)):
        back = kq.untiles(tiles.view(np.uint8), kind, n)
        assert back.data.tobytes() == blocks.data.tobytes()
    raw = kq.to_gguf(blocks)
    assert raw.shape == (n, 2 * (144 if kind == kq.Q4K else 210))
    read = kq.from_gguf_q4_k if kind == kq.Q4K else kq.from_gguf_q6_k
    assert read(raw, n, 512).data.tobytes() == blocks.data.tobytes()
    assert np.array_equal(kq.to_gguf(read(raw, n, 512)), raw)


def test_untiles_is_not_a_no_op():
    """Control: tiles of other blocks do not come back as these."""
    rng = np.random.default_rng(0)
    a, b = (kq.quantize_reference(rng.standard_normal((32, 256)).astype(np.float32), kq.Q4K) for _ in range(2))
    assert kq.untiles(kq.tiles(b), kq.Q4K, 32).data.tobytes() != a.data.tobytes()
    swapped = kq.tiles(a).copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # two tiles (16 rows each) swapped
    assert kq.untiles(swapped, kq.Q4K, 32).data.tobytes() != a.data.tobytes()


ROWS, COLS = 48, 512


@pytest.fixture
def cached_model(tmp_path, monkeypatch):
    """A registered model in a fresh cache: a GGUF with one Q4_K, one Q6_K and one Q8_0 tensor
    and the embedding, and a packed file with the tiles of the first three (the Q8_0 one
    re-quantized, as installs do)."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from safetensors.torch import save_file

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    rng = np.random.default_rng(7)
    g = tmp_path / "gguf" / "sparse-test.gguf"
    g.parent.mkdir()
    w = GGUFWriter(str(g), "llama")
    blocks = {}
    for name, kind in (("blk.0.attn_q.weight", kq.Q4K), ("blk.0.ffn_down.weight", kq.Q6K)):
        blocks[name] = kq.quantize_reference(rng.standard_normal((ROWS, COLS)).astype(np.float32), kind)
        for field in ("d", "dmin") if kind == kq.Q4K else ("d",):  # GGUF blocks carry float16 scales
            blocks[name].data[field] = blocks[name].data[field].astype(np.float16).astype(np.float32)
        w.add_tensor(name, kq.to_gguf(blocks[name]), raw_dtype=T.Q4_K if kind == kq.Q4K else T.Q6_K)
    q8 = np.zeros((ROWS, COLS // 32 * 34), np.uint8)  # Q8_0 blocks: a float16 scale of 0, codes
    w.add_tensor("blk.0.ffn_up.weight", q8, raw_dtype=T.Q8_0)
    w.add_tensor("token_embd.weight", kq.to_gguf(blocks["blk.0.attn_q.weight"]), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    sha = store.sha256_file(g)
    spec = registry.ModelSpec("sparse-test", "test", (), sha256=sha, filename=g.name, architecture="llama")
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    heads = 4
    q_blocks = blocks["blk.0.attn_q.weight"].permute_rows(llama_rows(ROWS, heads))  # as the packer stores q
    tiles = {
        "model.layers.0.self_attn.q_proj": (kq.Q4K, kq.tiles(q_blocks)),
        "model.layers.0.mlp.down_proj": (kq.Q6K, kq.tiles(blocks["blk.0.ffn_down.weight"])),
        "model.layers.0.mlp.up_proj": (
            kq.Q6K,
            kq.tiles(kq.quantize_reference(np.ones((ROWS, COLS), np.float32), kq.Q6K)),
        ),
    }
    packed = tmp_path / "packed" / "p.safetensors"
    packed.parent.mkdir()
    save_file(
        {m: torch.from_numpy(t.view(np.uint8)) for m, (_, t) in tiles.items()},
        str(packed),
        metadata={m: str(k) for m, (k, _) in tiles.items()},
    )
    return g, packed, sha, blocks


def _sparsify(g, packed, pin=True):
    """As the loader calls it for a registered model: with its name and pinned sha256."""
    named = ("sparse-test", registry.MODELS["sparse-test"].sha256) if pin else None
    return sparse.sparsify(g, packed, pin=named, args=_args("llama"))


def _args(model_type: str) -> ModelArgs:
    """The decoder the test file's tensors belong to (one layer, four heads, untied)."""
    return ModelArgs(model_type, 256, COLS, 1, 4, 4, ROWS // 4, ROWS, 1e-6, 64, False, 10_000.0)


def test_sparsify_keeps_blocks_once_and_restores_the_exact_file(cached_model):
    g, packed, sha, blocks = cached_model
    if sparse._fallocate() is None:
        pytest.skip("no fallocate on this platform")
    size, mtime = g.stat().st_size, g.stat().st_mtime_ns
    _sparsify(g, packed)
    info = sparse.state(g)
    if info is None:
        pytest.skip("this file system cannot punch holes")
    # Q4_K and Q6_K layers (q rows un-permuted) are kept once; the re-quantized Q8_0 layer and
    # the embedding (read from the GGUF) stay.
    assert set(info["tensors"]) == {"blk.0.attn_q.weight", "blk.0.ffn_down.weight"}
    assert g.stat().st_size == size and g.stat().st_mtime_ns == mtime
    reader = open_gguf(g)
    on_disk = {t.name: t.data for t in reader.tensors}
    assert not np.asarray(on_disk["blk.0.attn_q.weight"]).any()  # punched: zeros on disk
    for name, b in blocks.items():  # readers get the file's bytes all the same
        assert np.array_equal(_tensor(reader, name).data, kq.to_gguf(b))
    assert np.array_equal(_tensor(reader, "token_embd.weight").data, np.asarray(on_disk["token_embd.weight"]))
    with sparse.full(g):
        assert sparse.state(g) is None and store.sha256_file(g) == sha
        assert np.array_equal(np.asarray(on_disk["blk.0.attn_q.weight"]), kq.to_gguf(blocks["blk.0.attn_q.weight"]))
    assert sparse.state(g) == info and g.stat().st_mtime_ns == mtime  # punched again
    assert not np.asarray(on_disk["blk.0.ffn_down.weight"]).any()
    assert sparse.restore(g) and sparse.state(g) is None and store.sha256_file(g) == sha
    assert not sparse.restore(g)  # whole: nothing to do


def test_sizes_reported_are_bytes_on_disk(cached_model, tmp_path):
    """`models list`/`remove` and `specdec info` count what a sparse cache takes, not its
    files' apparent sizes (the holes are most of a punched GGUF)."""
    from specdec import info

    g, packed, _, _ = cached_model
    if sparse._fallocate() is None:
        pytest.skip("no fallocate on this platform")
    _sparsify(g, packed)
    if sparse.state(g) is None:
        pytest.skip("this file system cannot punch holes")
    assert store.model_files("sparse-test")["gguf"] == sparse.disk_bytes(g) < g.stat().st_size
    assert store.model_files("sparse-test")["other"] == sparse.disk_bytes(sparse.note_path(g)) > 0
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert info._dir_bytes(tmp_path) == sum(sparse.disk_bytes(p) for p in files)  # the GGUF's holes left out


def test_blocks_that_do_not_come_back_are_not_punched(cached_model):
    """Control for the byte-for-byte check: a packed file whose tiles differ from the GGUF's
    blocks (here: q rows left in GGUF order, as a packer for another architecture would)."""
    g, packed, sha, _ = cached_model
    sparse.sparsify(g, packed, pin=("sparse-test", sha), args=_args("qwen2"))
    info = sparse.state(g)
    assert info is None or "blk.0.attn_q.weight" not in info["tensors"]
    sparse.restore(g)
    assert store.sha256_file(g) == sha


def test_lost_or_wrong_packed_file_says_how_to_reinstall(cached_model, tmp_path):
    g, packed, sha, _ = cached_model
    _sparsify(g, packed)
    info = sparse.state(g)
    if info is None:
        pytest.skip("this file system cannot punch holes")
    data = next(t for t in open_gguf(g).tensors if t.name == "blk.0.attn_q.weight").data
    for change in ({"format": "old"}, {"packed": str(tmp_path / "gone.safetensors")}, {"sha256": "0" * 64}):
        sparse._write_note(g, info | change)
        with pytest.raises(sparse.BlocksLostError, match="specdec models install sparse-test"):
            if "sha256" in change:
                sparse.restore(g)
            else:
                sparse.tensor_data(g, "blk.0.attn_q.weight", data)
    sparse._write_note(g, info)
    assert sparse.restore(g) and store.sha256_file(g) == sha


def test_files_outside_the_cache_are_never_touched(cached_model, tmp_path):
    g, packed, sha, _ = cached_model
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(g.read_bytes())
    assert _sparsify(mine, packed) == 0 and sparse.state(mine) is None
    assert store.sha256_file(mine) == sha
    assert _sparsify(g, packed, pin=False) == 0 and sparse.state(g) is None  # no pin (not registered): left whole


@pytest.mark.real
def test_installed_model_is_sparse_and_loads_the_same():
    """The 0.5B draft as installed: its Q4_K/Q6_K tensors live only in the packed file; a float
    tensor read from the GGUF is what the whole file gives; `full` gives the pinned file back."""
    from specdec.model.gguf_file import float_tensor
    from specdec.model.load import prepare_q4k, q4k_cache_file

    spec = registry.MODELS["qwen2.5-coder-0.5b"]
    if not store.is_installed(spec.name):
        pytest.skip("qwen2.5-coder-0.5b is not installed")
    g = store.gguf_path(spec)
    d = store.resolve("qwen2.5-coder-0.5b")
    prepare_q4k(d)
    info = sparse.state(g)
    if info is None:
        pytest.skip("this file system cannot punch holes")
    from specdec.model.config import ModelArgs

    args = ModelArgs.from_dir(d)
    name = next(iter(info["tensors"]))
    sparse_w = float_tensor(open_gguf(g), name, args)
    with sparse.full(g):
        assert store.sha256_file(g) == spec.sha256
        assert np.array_equal(float_tensor(open_gguf(g), name, args), sparse_w)
    assert sparse.state(g) == info
    # (the GGUF's own packing holds them, not the draft's cheaper one beside it)
    assert json.loads(sparse.note_path(g).read_text())["packed"] == str(q4k_cache_file(d).resolve())
    assert q4k_cache_file(d) in store.packed_files(d)


def test_the_packing_that_holds_punched_blocks_is_never_pruned(cached_model):
    """Pruning old packings (after a kernel change) skips the one a sparse GGUF needs; once the
    GGUF is whole again it goes like any other."""
    import shutil

    from specdec.model.load import _prune_packed

    g, packed, sha, _ = cached_model
    _sparsify(g, packed)
    if sparse.state(g) is None:
        pytest.skip("this file system cannot punch holes")
    newer = packed.with_name("newer.safetensors")
    shutil.copy(packed, newer)
    _prune_packed(keep=newer)
    assert packed.exists()
    assert sparse.restore(g) and store.sha256_file(g) == sha
    _prune_packed(keep=newer)
    assert not packed.exists()  # control: without the note it is pruned
