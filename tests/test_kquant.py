"""The q4k kernel: K-quant blocks, their repacking, the integer kernel and its batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.model import kquant as kq
from specdec.model import native
from specdec.model.families import llama_rows

pytestmark = pytest.mark.skipif(not native.available(), reason="the q4k kernel cannot be built on this machine")
LIB = native.library_or_none()  # this machine's build (None: every test here skips)

KINDS = [kq.Q4K, kq.Q6K, kq.Q3, kq.Q2]
LEVELS = {kq.Q4K: 15, kq.Q6K: 31, kq.Q3: 7, kq.Q2: 3}


def reference(blocks: kq.Blocks, x: torch.Tensor, k: int) -> torch.Tensor:
    """What the kernel computes, in float64 and in the plainest form: activations rounded per
    row and 256-block to int8 (half to even), times the dequantized weights."""
    w = torch.from_numpy(kq.dequantize(blocks)).double()  # [N, Kpad]
    xp = torch.nn.functional.pad(x.double(), (0, w.shape[1] - k)).view(x.shape[0], -1, kq.QK)
    amax = xp.abs().amax(-1, keepdim=True).float().double()
    scale = (amax.float() / 127.0).double()
    inv = torch.where(amax > 0, (127.0 / amax.float()).double(), torch.zeros_like(amax))
    xq = torch.round((xp.float() * inv.float()).double()) * scale  # [M, nb, 256]
    return xq.reshape(x.shape[0], -1) @ w.T


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(40, 512), (13, 896), (9, 100), (24, 256)])
def test_kernel_matches_its_reference(kind, n, k):
    rng = np.random.default_rng(n * k + kind)
    w = rng.standard_normal((n, k)).astype(np.float32)
    blocks = kq.quantize(w, kind, LIB)
    kernel = kq.KQuantKernel.from_blocks(blocks, None, in_features=k, lib=LIB)
    x = torch.from_numpy(rng.standard_normal((6, k)).astype(np.float32))
    y = kernel(x).double()
    ref = reference(blocks, x, k)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # The dequantized weights are a faithful rounding of the originals.
    step = np.abs(w).max() / LEVELS[kind]
    err = kq.dequantize(blocks)[:, :k] - w
    if kind in kq.LOW_BITS:  # (the draft packings' fit trades the extremes for the bulk: a mean bound)
        assert np.sqrt((err**2).mean()) <= 2 * step / np.sqrt(12)
    else:
        assert np.abs(err).max() <= step


def test_reference_check_catches_a_wrong_layout():
    """Negative control: the same check fails for tiles packed with the nibbles swapped."""
    rng = np.random.default_rng(0)
    blocks = kq.quantize(rng.standard_normal((16, 512)).astype(np.float32), kq.Q4K, LIB)
    tiles = kq.tiles(blocks, LIB)
    tiles["qs"] = ((tiles["qs"] & 0xF) << 4) | (tiles["qs"] >> 4)
    kernel = kq.KQuantKernel(kq.Q4K, torch.from_numpy(tiles.view(np.uint8)), 16, 512, None, lib=LIB)
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))
    ref = reference(blocks, x, 512)
    assert not torch.allclose(kernel(x).double(), ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_is_bitwise_batch_invariant(kind):
    """Row i's output is bitwise the same alone and among 1..20 rows (crossing the kernel's
    row-chunk sizes), with a bias, an output count off the tile size and a padded input."""
    rng = np.random.default_rng(kind)
    n, k = 37, 1100
    blocks = kq.quantize(rng.standard_normal((n, k)).astype(np.float32), kind, LIB)
    kernel = kq.KQuantKernel.from_blocks(
        blocks, torch.from_numpy(rng.standard_normal(n).astype(np.float32)), in_features=k, lib=LIB
    )
    x = torch.from_numpy(rng.standard_normal((20, k)).astype(np.float32) * 3)
    x[5] = 0.0  # an all-zero row (zero scales)
    together = kernel(x)
    alone = torch.cat([kernel(x[i : i + 1]) for i in range(20)])
    assert torch.equal(together, alone)
    for m in range(1, 20):
        assert torch.equal(kernel(x[:m]), together[:m])
    assert torch.equal(kernel(x.view(4, 5, k)), together.view(4, 5, n))


def test_packed_shape_is_checked():
    with pytest.raises(ValueError, match="do not fit"):
        kq.KQuantKernel(kq.Q4K, torch.zeros(2, 10, dtype=torch.uint8), 16, 512, None, lib=LIB)


@pytest.mark.real
def test_gguf_blocks_are_the_files_numbers():
    """Blocks read from the Qwen 1.5B GGUF dequantize to exactly what gguf's own reader gives,
    for a Q4_K and a Q6_K tensor, and `matches` tells them from other weights."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from specdec import registry, store

    path = store.gguf_path(registry.MODELS["qwen2.5-coder-1.5b"])
    if not path.exists():
        pytest.skip("qwen2.5-coder-1.5b is not installed")
    from specdec.model import sparse

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for name, read in (("blk.0.attn_q.weight", kq.from_gguf_q4_k), ("blk.0.ffn_down.weight", kq.from_gguf_q6_k)):
        t = tensors[name]
        k, n = int(t.shape[0]), int(t.shape[1])
        data = sparse.tensor_data(path, name, t.data)  # the file's bytes (kept in the q4k file once installed)
        assert np.asarray(data).any()
        want = dequantize(data, t.tensor_type).reshape(n, k)
        blocks = read(data, n, k)
        assert blocks.kind == (kq.Q4K if t.tensor_type == GGMLQuantizationType.Q4_K else kq.Q6K)
        assert np.array_equal(kq.dequantize(blocks), want)
        assert kq.matches(blocks, torch.from_numpy(want))
        assert not kq.matches(blocks, torch.from_numpy(want[::-1].copy()))


def test_llama_row_order_undoes_the_rotary_interleave():
    # 2 heads of 4 rows: GGUF rows (h, i, t) -> HF rows (h, t, i)
    assert llama_rows(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_tiny_model_on_4bit_blocks_is_invariant_and_exact(tiny_dir, monkeypatch):
    """The model path with Q4_K blocks (tiny float models get Q6_K by default): a k-token pass
    equals one-token decoding bitwise, and speculative greedy output equals plain decoding."""
    from helpers import verify_vs_decode

    import specdec
    from specdec.model import load_transformer

    monkeypatch.setattr(kq, "REQUANTIZE", kq.Q4K)
    model = load_transformer(tiny_dir("llama"), dtype="q4k", device="cpu")
    assert {m.kernel.kind for m in model.modules() if getattr(m, "kernel", None) is not None} == {kq.Q4K}
    for k in (2, 5, 9, 16):
        together, alone = verify_vs_decode(model, prompt_len=11, k=k, seed=k)
        assert torch.equal(together, alone), k
    target = specdec.load(tiny_dir("llama"), dtype="q4k", device="cpu")
    draft = specdec.load(tiny_dir("llama", "close"), dtype="q4k", device="cpu")
    for prompt in ("abcabcabc", "def f(x):\n"):
        plain = specdec.generate(target, prompt, max_new_tokens=20, ignore_eos=True)
        spec = specdec.generate(
            target, prompt, assistant_model=draft, k=4, max_new_tokens=20, ignore_eos=True, adaptive_k=False
        )
        assert spec.token_ids == plain.token_ids


def _builds_here() -> dict[str, object]:
    """Every kernel build this machine can run (the AMX build runs its AVX-512 path where the
    CPU has no AMX)."""
    flags = native._cpu_flags()
    builds = {native.AVX2: native._library(native.AVX2)}
    if native._AVX512_NEEDS <= flags:
        builds[native.AVX512] = native._library(native.AVX512)
        try:
            builds[native.AMX] = native._library(native.AMX)
        except native.NativeUnavailableError as exc:  # a compiler without AMX support
            pytest.skip(f"the AMX build cannot be compiled here: {exc}")
    return builds


@pytest.mark.slow
def test_every_build_agrees_bitwise():
    """AVX2, AVX-512 VNNI and the AMX build (its AMX path where the CPU has AMX and the OS
    grants it, else its AVX-512 path) give the same bits, for 1..37 rows and every kind (the
    K-quants, the 32-weight types, float rows, the draft packings: `self_check`)."""
    builds = _builds_here()
    if len(builds) < 2:
        pytest.skip("this CPU runs only the AVX2 build")
    names = list(builds)
    for other in names[1:]:
        assert kq.self_check(builds[other], builds[names[0]]) is None, other


@pytest.mark.parametrize("kind", KINDS)
def test_builds_agree_at_the_largest_integer_sums(kind):
    """Every code at its maximum and every activation at +-127 (the same sign across a group):
    the AVX2 build's 16-bit partial sums are at their bound (q4k: 8 pairs of 15 * 127; q6k: two
    pairs of 63 * 127), so are the AVX-512 build's 16-bit half-group sums (q4k: 16 * 15 * 127),
    and scales at both ends of their range. An overflow there would be far
    from the reference; every build must match it and each other bitwise."""
    n, k = 32, 512
    data = np.zeros((n, k // kq.QK), dtype=kq.BLOCK_DTYPES[kind])
    data["d"] = 1e-3
    if kind == kq.Q4K:
        data["dmin"], data["sc"], data["mn"], data["qs"] = 1e-3, 63, 63, 0xFF
    elif kind in kq.LOW_BITS:  # (q3: 8 pairs of 7 * 127 in the AVX2 build's 16-bit sums; 8-bit scales)
        data["dmin"], data["sc"], data["mn"], data["q"] = 1e-3, 255, 255, LEVELS[kind]
    else:
        data["ql"], data["qh"] = 0xFF, 0xFF
        data["sc"] = np.where(np.arange(16) % 2, 127, -128).astype(np.int8)
    _builds_agree_at_the_extremes(kq.Blocks(kind, data), reference)


def _builds_agree_at_the_extremes(blocks: kq.Blocks, ref_of) -> None:  # noqa: ANN001
    """Activations of +-1 (all the same sign, alternating, half and half) against `blocks`: every
    build within float rounding of `ref_of(blocks, x, k)`, and all builds bitwise equal."""
    n, k = blocks.shape
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs: small sums, for contrast
    x[3, : k // 2] = -1.0
    ref = ref_of(blocks, x, k)
    packed = torch.from_numpy(kq.tiles(blocks, LIB).view(np.uint8))
    outs = {}
    for name, lib in _builds_here().items():
        outs[name] = kq.KQuantKernel(blocks.kind, packed, n, k, None, lib=lib)(x)
        assert torch.allclose(outs[name].double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), name
    first = next(iter(outs.values()))
    assert all(torch.equal(o, first) for o in outs.values())


def test_amx_path_is_bitwise_equal_to_avx512():
    if not {"amx_tile", "amx_int8"} <= native._cpu_flags():
        pytest.skip("this CPU has no AMX (amx_tile/amx_int8 absent): the AMX path is tested on one that has it")
    amx = native._library(native.AMX)
    assert amx.specdec_amx_enable(1) == 0, "the OS refused the tile state (arch_prctl)"
    assert kq.self_check(amx, native._library(native.AVX512)) is None
    assert native.dispatch()[0] == native.AMX


@pytest.mark.slow
def test_amx_path_logic_on_emulated_tiles():
    """The AMX path's own code (tile configuration, A/B layouts, strides, row counts, the
    integer and float steps around each tile multiply) run through a scalar model of the tile
    instructions gives the AVX-512 path's bits: checked on every AVX-512 machine, AMX or not."""
    if not native._AVX512_NEEDS <= native._cpu_flags():
        pytest.skip("the AMX path's vector code needs AVX-512 VNNI, which this CPU lacks")
    emulated = native._library(native.AMX_EMULATED)
    assert emulated.specdec_amx_enable(1) == 0
    try:
        assert kq.self_check(emulated, native._library(native.AVX512)) is None
    finally:
        emulated.specdec_amx_enable(0)


@pytest.mark.slow
def test_self_check_catches_a_wrong_tile_multiply(monkeypatch):
    """Negative control for the check above: the emulated build with the wrong tile multiply
    (tdpbusd, which reads the activations' bytes as unsigned) must fail the self-check."""
    if not native._AVX512_NEEDS <= native._cpu_flags():
        pytest.skip("the AMX path's vector code needs AVX-512 VNNI, which this CPU lacks")
    monkeypatch.setitem(
        native._VARIANT_FLAGS, "broken-amx", [*native._AMX_EMULATED_FLAGS, "-DSPECDEC_AMX_EMULATE_TDPBUSD"]
    )
    broken = native._library("broken-amx")
    assert broken.specdec_amx_enable(1) == 0
    assert kq.self_check(broken, native._library(native.AVX512)) is not None


def test_amx_enable_is_refused_without_amx():
    """On a CPU without AMX the AMX build still loads, and enabling AMX fails cleanly."""
    if {"amx_tile", "amx_int8"} <= native._cpu_flags() or not native._AVX512_NEEDS <= native._cpu_flags():
        pytest.skip("needs a CPU with AVX-512 VNNI and without AMX")
    amx = _builds_here()[native.AMX]
    assert amx.specdec_amx_enable(1) != 0 and amx.specdec_amx_enable(0) == 0  # type: ignore[attr-defined]


def test_grouped_layers_equal_separate_calls():
    rng = np.random.default_rng(4)
    kernels = tuple(
        kq.KQuantKernel.from_blocks(
            kq.quantize(rng.standard_normal((n, 512)).astype(np.float32), kind, LIB),
            torch.randn(n, generator=torch.Generator().manual_seed(n)),
            lib=LIB,
        )
        for n, kind in ((48, kq.Q4K), (16, kq.Q6K), (20, kq.Q4K))
    )
    x = torch.from_numpy(rng.standard_normal((2, 3, 512)).astype(np.float32))
    for together, alone in zip(kq.KQuantKernel.group(kernels, x), [k(x) for k in kernels], strict=True):
        assert torch.equal(together, alone)


@pytest.mark.parametrize("H,Hkv,D", [(6, 2, 32), (14, 2, 64), (12, 2, 128), (9, 3, 24), (4, 4, 16)])
def test_native_attention_matches_sdpa_and_is_row_invariant(H, Hkv, D):
    """Rows of one call equal separate one-row calls bitwise, and match the framework's
    attention (GQA, causal, with and without a sliding-window mask) to float32 accuracy; query
    heads per key/value head that fill the kernel's groups of heads or not, head sizes with
    and without a last half block."""
    g = torch.Generator().manual_seed(5)
    B, T, start, cap = 2, 6, 9, 20
    q = torch.randn(B, T, H, D, generator=g)
    k_cache, v_cache = torch.randn(B, Hkv, cap, D, generator=g), torch.randn(B, Hkv, cap, D, generator=g)
    end = start + T
    causal = torch.ones(T, end, dtype=torch.bool).tril(start)
    window = causal & (torch.arange(end)[None, :] > torch.arange(start, end)[:, None] - 4)
    for mask in (None, window.expand(B, T, end)):
        got = native.attend_rows(q, k_cache, v_cache, start, mask, None)
        attn_mask = (causal if mask is None else mask[0])[None, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=attn_mask, enable_gqa=True
        ).transpose(1, 2)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        for t in range(T):  # row t alone, as a one-token step at slot start + t
            m = None if mask is None else mask[:, t : t + 1, : start + t + 1]
            alone = native.attend_rows(q[:, t : t + 1], k_cache, v_cache, start + t, m, None)
            assert torch.equal(alone[:, 0], got[:, t])


def test_native_attention_weights_under_its_floor_are_exactly_zero():
    """Softmax weights under e^-64 of the largest are exactly 0 (their products with the values
    were denormal numbers, computed far slower; csrc/attention.c's SOFTMAX_FLOOR); those just
    above it are kept. Each key's value is a one-hot vector, so the output is the weights."""
    D, n = 16, 5
    k = torch.zeros(1, 1, 8, D)
    k[0, 0, :n, 0] = torch.tensor([0.0, -70.0, -50.0, -63.0, -65.0])  # scores s_j = q . k_j, q = e_0
    v = torch.zeros(1, 1, 8, D)
    v[0, 0, torch.arange(n), torch.arange(n)] = 1.0
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    w = native.attend_rows(q, k, v, n - 1, None, 1.0)[0, 0, 0, :n].double()
    want = torch.tensor([0.0, -70.0, -50.0, -63.0, -65.0], dtype=torch.float64).exp()
    want /= want.sum()
    assert w[0] == want[0] and w[1] == 0 and w[4] == 0  # (past the floor: 0, where e^-70 > 0)
    assert want[1] > 0 and want[4] > 0
    assert torch.allclose(w[[2, 3]], want[[2, 3]], rtol=1e-5)  # kept (e^-63 is a normal float)


def test_native_attention_rows_of_unequal_segments_equal_one_row_calls():
    """A packed batch whose segments have different lengths and starts (so the kernel's blocks of
    rows end at different places in each), with a tree-like mask on one of them: every row is
    bitwise what a one-row call at its position computes."""
    g = torch.Generator().manual_seed(11)
    H, Hkv, D, cap = 12, 2, 64, 40
    lengths, starts = [7, 3, 9], [5, 17, 0]
    caches = [
        (torch.randn(1, 1, Hkv, cap, D, generator=g), torch.randn(1, 1, Hkv, cap, D, generator=g)) for _ in lengths
    ]
    tree = torch.ones(3, 20, dtype=torch.bool).tril(17)
    tree[2, 18] = False  # the third new token does not see the second: a branch
    masks = [None, tree, None]
    q = torch.randn(sum(lengths), H, D, generator=g)
    got = native.SegmentAttention(caches, starts, lengths, masks, D**-0.5)(0, q, None, None)
    r = 0
    for s, (T, start) in enumerate(zip(lengths, starts, strict=True)):
        for t in range(T):
            m = None if masks[s] is None else masks[s][t : t + 1, : start + t + 1]
            alone = native.SegmentAttention([caches[s]], [start + t], [1], [m], D**-0.5)(0, q[r : r + 1], None, None)
            assert torch.equal(alone[0], got[r]), (s, t)
            r += 1


def test_native_attention_refuses_more_heads_per_group_than_it_handles():
    k = torch.zeros(1, 1, 1, 8, 8)
    attend = native.SegmentAttention([(k, k.clone())], [0], [1], [None], 1.0)
    with pytest.raises(ValueError, match="query heads per key/value head"):
        attend(0, torch.zeros(1, native.ATTN_MAX_REP + 1, 8), None, None)


def test_packed_weights_are_cached_and_stale_packings_pruned(tmp_path):
    """The first q4k load writes the repacked weights, later loads reuse them; when the model's
    files change, the new packing replaces the old one."""
    import os

    from specdec.model import load_transformer
    from specdec.model.load import q4k_cache_file
    from specdec.testing import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "qwen2", seed=4)
    first = load_transformer(path, dtype="q4k", device="cpu")
    old = q4k_cache_file(path)
    assert old.exists()
    again = load_transformer(path, dtype="q4k", device="cpu")
    ids = torch.tensor([[3, 5, 7]])
    assert torch.equal(first(ids, first.new_cache(8)).logits, again(ids, again.new_cache(8)).logits)
    weights = next(path.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000_000))
    load_transformer(path, dtype="q4k", device="cpu")
    assert q4k_cache_file(path).exists() and q4k_cache_file(path) != old and not old.exists()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_token_tree_rows_equal_decoding_along_their_paths(tiny_dir, arch):
    """In the batch-invariant modes a token tree scored in one pass gives each node bitwise the
    logits that one-token decoding along its root path gives (the basis of exact tree
    verification). Tree: r -> (a -> c, b -> d), listed r, a, b, c, d."""
    from specdec.model import load_transformer

    model = load_transformer(tiny_dir(arch), dtype="q4k", device="cpu")
    g = torch.Generator().manual_seed(6)
    prefix = torch.randint(3, 200, (1, 14), generator=g)  # longer than Gemma's test window
    nodes = torch.tensor([[11, 22, 33, 44, 55]])
    parent = [-1, 0, 0, 1, 2]
    depth = [0, 1, 1, 2, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    cache = model.new_cache(32)
    model(prefix, cache)
    positions = torch.tensor([[14 + d for d in depth]])
    tree = model(nodes, cache, positions, tree_mask=mask).logits  # [1, 5, V]
    for i in range(5):
        path, j = [], i
        while j >= 0:
            path.insert(0, int(nodes[0, j]))
            j = parent[j]
        c = model.new_cache(32)
        model(prefix, c)
        for tok in path[:-1]:
            model(torch.tensor([[tok]]), c)
        alone = model(torch.tensor([[path[-1]]]), c).logits[:, 0]
        assert torch.equal(tree[:, i], alone), i


def test_tree_mask_must_be_topological(tiny_dir):
    from specdec.model import load_transformer

    model = load_transformer(tiny_dir("llama"), dtype="q4k", device="cpu")
    cache = model.new_cache(16)
    model(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="topological order"):
        model(torch.tensor([[4, 5]]), cache, tree_mask=torch.ones(2, 2, dtype=torch.bool))


# -- the native install-time helpers against their numpy definitions ------------------------------


def _ties(rng: np.random.Generator) -> np.ndarray:
    """Weights whose Q6_K step is exactly 1 (every 16-group holds a 31) and that sit on .5:
    round-half-to-even and round-half-away give different codes on them."""
    w = rng.integers(-31, 31, (16, 256)).astype(np.float32) + 0.5
    w[:, ::16] = 31
    return w


def _awkward_weights(rng: np.random.Generator) -> list[np.ndarray]:
    """Random layers plus the cases where rounding could differ: ties, all-zero blocks and
    groups, values near float32's range ends, an input size off the block size."""
    zeros = rng.standard_normal((4, 512)).astype(np.float32)
    zeros[:, :16], zeros[1, 256:] = 0, 0
    return [
        rng.standard_normal((37, 700)).astype(np.float32),
        _ties(rng),
        zeros,
        np.zeros((3, 256), np.float32),
        (rng.standard_normal((20, 512)) * 1e-30).astype(np.float32),
        (rng.standard_normal((8, 256)) * 1e30).astype(np.float32),
    ]


def test_native_q6k_quantizer_gives_the_references_bytes():
    rng = np.random.default_rng(6)
    for w in _awkward_weights(rng):
        assert kq.quantize(w, kq.Q6K, LIB).data.tobytes() == kq.quantize_reference(w, kq.Q6K).data.tobytes(), w.shape


def test_the_tie_case_tells_rounding_modes_apart():
    """The comparison above would catch a quantizer rounding halves away from zero: on the tie
    case the step is exactly 1 and the two roundings give different codes."""
    w = _ties(np.random.default_rng(6))
    ref = kq.quantize_reference(w, kq.Q6K)
    assert np.all(ref.data["d"] * ref.data["sc"].max(-1) == 1.0)  # [N, 1]: step 1 in every group
    codes = kq.dequantize(ref)  # the reference's rounding, back in weight units
    away = np.clip(np.sign(w) * np.floor(np.abs(w) + 0.5), -32, 31)
    assert np.array_equal(codes, np.round(w).clip(-32, 31)) and not np.array_equal(codes, away)


@pytest.mark.parametrize("kind", KINDS)
def test_native_tiles_are_the_references_layout(kind):
    """Random block bytes (finite scales), output counts on and off the tile size."""
    rng = np.random.default_rng(kind)
    dt = kq.BLOCK_DTYPES[kind]
    for n, nb in [(16, 1), (37, 3), (5, 2), (100, 4)]:
        data = rng.integers(0, 256, (n, nb, dt.itemsize), dtype=np.uint8).view(dt).reshape(n, nb)
        for field in ("d", "dmin") if kind != kq.Q6K else ("d",):
            data[field] = rng.standard_normal((n, nb)).astype(np.float32)
        blocks = kq.Blocks(kind, data)
        assert kq.tiles(blocks, LIB).tobytes() == kq.tiles_reference(blocks).tobytes(), (n, nb)


def test_native_legacy_dequantizer_gives_ggufs_floats():
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: random blocks with finite f16 scales, bit for bit what
    gguf's numpy de-quantizer (transformers' converter) gives."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gguf_dequantize

    from specdec.model.gguf_file import _LEGACY, dequantize

    rng = np.random.default_rng(0)
    for qtype, size in _LEGACY.items():
        raw = rng.integers(0, 256, (7, 5 * size), dtype=np.uint8)
        blocks = raw.reshape(7, 5, size)
        for off in (0, 2) if qtype in (T.Q4_1, T.Q5_1) else (0,):
            blocks[..., off : off + 2] = rng.standard_normal((7, 5, 1)).astype(np.float16).view(np.uint8)
        ours, theirs = dequantize(raw, qtype), np.asarray(gguf_dequantize(raw, qtype), np.float32)
        assert ours.shape == theirs.shape == (7, 160) and ours.tobytes() == theirs.tobytes(), qtype.name


# -- the file's own blocks: Q5_K, GGML's 32-weight types, float rows --------------------------------

RAW_SHAPES = [(40, 512), (13, 896), (9, 96), (37, 1120)]  # (outputs, inputs): on and off the tile and block sizes


def _raw_reference(blocks: kq.Blocks, x: torch.Tensor, k: int) -> torch.Tensor:
    """The float64 value the kernel stands for, from the gguf package's de-quantization: the
    integer kinds on int8-rounded activations (`reference`), float rows on the activations."""
    if blocks.kind in kq.FLOATS:
        return x.double() @ torch.from_numpy(kq.dequantize(blocks)).double()[:, :k].T
    w = kq.dequantize(blocks)
    padded = np.pad(w, ((0, 0), (0, -w.shape[1] % kq.QK)))
    return reference(kq.Blocks(kq.F32, padded[..., None].view(np.uint8)), x, k)


@pytest.mark.parametrize("kind", kq.RAW)
def test_file_blocks_match_ggufs_dequantization(kind):
    """Each kind's layers, quantized as llama.cpp's reference code does (the gguf package; Q5_K
    by `quantize_raw`), against float64 arithmetic on gguf's own de-quantized weights: within
    the float32 rounding of the sums (rtol 1e-5), for output and input counts on and off the
    tile and block sizes; bitwise the same for each row alone and in the batch."""
    rng = np.random.default_rng(kind)
    for n, k in RAW_SHAPES:
        if kind == kq.Q5K and k % kq.QK:
            k = -(-k // kq.QK) * kq.QK  # (a K-quant row is whole blocks of 256)
        w = rng.standard_normal((n, k)).astype(np.float32)
        blocks = kq.quantize(w, kind, LIB)
        assert kq.dequantize(blocks).shape == (n, -(-k // 32) * 32 if kind in kq.LEGACY else k)
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        kernel = kq.KQuantKernel.from_blocks(blocks, bias, in_features=k, lib=LIB)
        x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32) * 3)
        x[4] = 0.0
        y = kernel(x)
        ref = _raw_reference(blocks, x, k) + bias.double()
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), (n, k)
        assert torch.equal(torch.cat([kernel(x[i : i + 1]) for i in range(11)]), y), (n, k)
        for m in (2, 5, 9):
            assert torch.equal(kernel(x[:m]), y[:m]), (n, k, m)


def _wrongly_packed(kind: int, tiles: np.ndarray) -> np.ndarray:
    """The tiles with one mistake a packing could make for the kind."""
    t = tiles.copy()
    if kind in kq.FLOATS:
        t["w"] = t["w"][..., ::-1, :]  # inputs in reverse
    elif kind == kq.Q8_0:
        t["g"]["qs"] ^= 0x80  # codes read as unsigned
    else:
        qs = t["g"]["qs"]
        t["g"]["qs"] = ((qs & 0xF) << 4) | (qs >> 4)  # nibbles swapped
    return t


@pytest.mark.parametrize("kind", kq.RAW)
def test_file_blocks_check_catches_a_wrong_packing(kind):
    """Negative control: the same comparison fails for tiles with one packing mistake."""
    rng = np.random.default_rng(1)
    n, k = 16, 512
    blocks = kq.quantize(rng.standard_normal((n, k)).astype(np.float32), kind, LIB)
    bad = _wrongly_packed(kind, kq.tiles(blocks, LIB))
    kernel = kq.KQuantKernel(kind, torch.from_numpy(bad.view(np.uint8)), n, k, None, lib=LIB)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    ref = _raw_reference(blocks, x, k)
    assert not torch.allclose(kernel(x).double(), ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", [kq.Q5K, *kq.LEGACY])
def test_file_blocks_builds_agree_at_the_largest_integer_sums(kind):
    """Every code at its extreme (Q8_0: -128, whose magnitude the AVX2 path's sign trick must
    carry; the 4/5-bit kinds: all ones) against activations of +-127: the AVX2 path's 16-bit
    partial sums at their bound. Every build matches gguf's reference and the others bitwise."""
    from gguf import GGML_QUANT_SIZES

    qtype = kq.GGML_TYPES[kind]
    per, size = GGML_QUANT_SIZES[qtype]
    n, k = 32, 512
    raw = np.full((n, k // per, size), 0xFF, np.uint8)
    scale = np.array([1e-3], np.float16).view(np.uint8)
    if kind == kq.Q5K:
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:
        raw[..., 0:2] = scale
        if kind in (kq.Q4_1, kq.Q5_1):
            raw[..., 2:4] = np.array([-0.5], np.float16).view(np.uint8)
        if kind == kq.Q8_0:
            raw[..., 2:] = 0x80
    _builds_agree_at_the_extremes(kq.from_gguf(raw.reshape(n, -1), qtype, n, k), _raw_reference)


def test_from_gguf_refuses_a_type_it_does_not_run():
    from gguf import GGMLQuantizationType as T

    with pytest.raises(ValueError, match="IQ2_XS is not a block type specdec runs"):
        kq.from_gguf(np.zeros((2, 66), np.uint8), T.IQ2_XS, 2, 256)


@pytest.fixture(scope="module")
def tiny_of_kind(tmp_path_factory):
    """A tiny llama (hidden 256: whole K-quant blocks) written into a GGUF with its layers in a
    given kind, converted once per kind; and its float checkpoint."""
    from specdec import store
    from specdec.testing import make_tiny_model, write_tiny_gguf

    root = tmp_path_factory.mktemp("kinds")
    hf = make_tiny_model(root / "hf", "llama", seed=7, hidden=256)
    made: dict[int, object] = {}

    def get(kind: int):
        if kind not in made:
            made[kind] = store.resolve(write_tiny_gguf(hf, root / f"k{kind}.gguf", kind=kind))
        return made[kind]

    return get


@pytest.mark.parametrize("kind", kq.RAW)
def test_a_model_in_the_files_own_blocks_is_invariant_exact_and_close(tiny_of_kind, kind, monkeypatch, tmp_path):
    """A model whose layers the file holds in `kind` runs them as such (no re-quantizing): a
    k-token pass equals one-token decoding bitwise, and its logits are within the mode's bound of
    float32 arithmetic on gguf's de-quantization of the same file (transformers' fp32 load):
    relative RMS 1e-4 for float rows, 10% for the integer kinds, whose int8 activations this
    random model amplifies (the Q4_K path: 4.7%, the int8 mode 7-10%, all kinds 4.7-6.4%, on a
    Xeon, 2026-12-06); logits of other positions are far outside it (the control)."""
    from helpers import verify_vs_decode

    from specdec.model import load_transformer
    from specdec.model.linear import Linear

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    converted = tiny_of_kind(kind)
    model = load_transformer(converted, dtype="q4k", device="cpu")
    layer_kinds = {m.kernel.kind for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"}
    assert layer_kinds == {kind}
    for k in (2, 5, 9):
        together, alone = verify_vs_decode(model, prompt_len=11, k=k, seed=k)
        assert torch.equal(together, alone), k
    ids = torch.randint(0, 250, (1, 24), generator=torch.Generator().manual_seed(0))

    def logits(m) -> torch.Tensor:  # noqa: ANN001
        return m(ids, m.new_cache(24)).logits.double()

    ours, ref = logits(model), logits(load_transformer(converted, dtype="fp32", device="cpu"))
    bound = 1e-4 if kind in kq.FLOATS else 0.1

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

    assert rel(ours, ref) <= bound
    shuffled = ref[:, torch.randperm(ref.shape[1], generator=torch.Generator().manual_seed(1))]
    assert rel(ours, shuffled) > bound  # the control: logits of other positions are far outside


def _tiny_gguf_with(tmp_path, qtype_name: str):
    """A tiny llama GGUF with one layer's tensor stored in a type specdec does not run."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter

    from specdec.testing import make_tiny_model, write_tiny_gguf

    hf = make_tiny_model(tmp_path / "hf", "llama", seed=8, hidden=256)
    plain = write_tiny_gguf(hf, tmp_path / "plain.gguf")
    reader = GGUFReader(plain)
    qtype = GGMLQuantizationType[qtype_name]
    out = tmp_path / f"{qtype_name}.gguf"
    w = GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if len(field.types) > 1 else None
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            per, size = GGML_QUANT_SIZES[qtype]
            n, k = int(t.shape[1]), int(t.shape[0])
            raw = rng.integers(0, 256, (n, k // per * size), dtype=np.uint8)
            raw.reshape(n, k // per, size)[..., -2:] = np.array([1e-3], np.float16).view(np.uint8)  # d: finite
            w.add_tensor(t.name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_type_it_does_not_run_is_refused_in_one_line_or_requantized_when_asked(tmp_path, monkeypatch):
    """Q3_K (one of the types without a kernel): loading says which tensor, which type and what
    to do, in one line; installed with --requantize the model runs (that tensor as Q6_K)."""
    from specdec import store
    from specdec.model import load_transformer
    from specdec.model.gguf_file import UnsupportedBlockTypeError

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    gguf = _tiny_gguf_with(tmp_path, "Q3_K")
    converted = store.resolve(gguf)
    with pytest.raises(UnsupportedBlockTypeError) as err:
        load_transformer(converted, dtype="q4k", device="cpu")
    line = str(err.value)
    assert "\n" not in line and "blk.0.ffn_up.weight is stored as Q3_K" in line and "--requantize" in line
    store.install_file(gguf, requantize=True, log=lambda s: None)
    model = load_transformer(converted, dtype="q4k", device="cpu")
    assert model.model.layers[0].mlp.up_proj.kernel.kind == kq.Q6K
    assert model.model.layers[0].mlp.down_proj.kernel.kind == kq.Q6K  # (float rows: re-quantized too, as asked)


@pytest.mark.parametrize("kind", [kq.Q4K, kq.Q6K, *kq.RAW])
def test_a_layers_chosen_outputs_are_its_own_bytes_moved(kind):
    """`gather_outputs` (a draft's cut vocabulary): the kernel over the gathered tiles gives
    bitwise the chosen outputs of the whole layer's, in their order; for Q4_K/Q6_K the tiles are
    those of the blocks unpacked, reordered and packed again."""
    rng = np.random.default_rng(kind)
    n, k = 70, 512
    blocks = kq.quantize(rng.standard_normal((n, k)).astype(np.float32), kind, LIB)
    tiles = kq.tiles(blocks, LIB)
    rows = np.array([69, 3, 17, 16, 0, 40, 41, 5, 33, 64, 65, 2, 7, 8, 50, 1, 20], np.int64)
    got = kq.gather_outputs(tiles, kind, rows)
    if kind in (kq.Q4K, kq.Q6K):
        assert got.tobytes() == kq.tiles(blocks.permute_rows(rows), LIB).tobytes()
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    whole = kq.KQuantKernel(kind, torch.from_numpy(tiles.view(np.uint8)), n, k, None, lib=LIB)(x)
    cut = kq.KQuantKernel(kind, torch.from_numpy(got.view(np.uint8)), len(rows), k, None, lib=LIB)(x)
    assert torch.equal(cut, whole[:, torch.from_numpy(rows)])
    wrong = kq.gather_outputs(tiles, kind, rows[::-1].copy())  # (the control: another order differs)
    other = kq.KQuantKernel(kind, torch.from_numpy(wrong.view(np.uint8)), len(rows), k, None, lib=LIB)(x)
    assert not torch.equal(other, whole[:, torch.from_numpy(rows)])


@pytest.mark.parametrize("kind", kq.RAW)
def test_native_repacking_of_the_file_blocks_is_the_references(kind):
    """Random file blocks (finite float16 scales; output and input counts on and off the tile
    and block sizes): the native repacking gives the numpy definition's bytes."""
    from gguf import GGML_QUANT_SIZES

    rng = np.random.default_rng(kind)
    per, size = GGML_QUANT_SIZES[kq.GGML_TYPES[kind]]
    for n, k in [(16, 256), (37, 768), (5, 96 if per == 32 else 256), (40, 1120 if per == 32 else 512)]:
        if k % per:
            continue
        raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
        if kind in kq.FLOATS:
            raw = rng.standard_normal((n, k)).astype(np.float32).view(np.uint8).reshape(n, k, 4)
            raw = (
                raw
                if kind == kq.F32
                else raw[..., 2:]
                if kind == kq.BF16
                else np.ascontiguousarray(
                    rng.standard_normal((n, k)).astype(np.float16).view(np.uint8).reshape(n, k, 2)
                )
            )
        else:
            for at in (0, 2) if kind in (kq.Q5K, kq.Q4_1, kq.Q5_1) else (0,):
                raw[..., at : at + 2] = rng.standard_normal((n, k // per, 1)).astype(np.float16).view(np.uint8)
        blocks = kq.Blocks(kind, np.ascontiguousarray(raw))
        assert kq.tiles(blocks, LIB).tobytes() == kq.tiles_reference(blocks).tobytes(), (n, k)
