"""The native decoder layer (specdec.model.fused, csrc/layer.c): the q4k mode's whole layer in one
call. It must compute what the framework layer computes (up to float rounding, which the int8
activation rounding can turn into a code step here and there), keep batch invariance, give the
same bits in every kernel build, and give a row the same bits however many rows its pass has."""

from __future__ import annotations

import pytest
import torch

from specdec.model import kquant as kq
from specdec.model import load_transformer, native
from specdec.model.transformer import Segment

pytestmark = pytest.mark.skipif(not native.available(), reason="the q4k kernel cannot be built on this machine")

FUSED_ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma3"]


def _model(tiny_dir, arch):
    return load_transformer(tiny_dir(arch), dtype="q4k", device="cpu")


def _layers(model, tokens, on: bool) -> dict[int, torch.Tensor]:
    model.set_native_layers(on)
    try:
        cache = model.new_cache(tokens.shape[1] + 4)
        n = model.args.n_layers
        return model(tokens, cache, output_layers=tuple(range(n))).layers
    finally:
        model.set_native_layers(True)


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_native_layer_computes_the_framework_layer(tiny_dir, arch):
    model = _model(tiny_dir, arch)
    assert all(b.native is not None for b in model.model.layers)
    tokens = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    ours, theirs = _layers(model, tokens, True), _layers(model, tokens, False)
    for i in ours:
        rows = (ours[i] - theirs[i]).abs().amax(-1)[0]  # [T] per-row difference
        scale = float(theirs[i].abs().max())
        # rounding-level almost everywhere; an activation code that rounds the other way moves a row a little
        assert float(rows.median()) <= 1e-5 * scale, (i, rows)
        assert float(rows.max()) <= 2e-2 * scale, (i, rows)


def test_the_comparison_catches_a_wrong_layer(tiny_dir):
    """Negative control: the same check fails when the native layer skips the rotary step
    (tables of cos = 1, sin = 0 handed to it only)."""
    model = _model(tiny_dir, "llama")
    tokens = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    theirs = _layers(model, tokens, False)
    block = model.model.layers[0]
    real = block.native

    def no_rotary(x, rope, layer, nat, attend, scratch):
        cos, sin = rope
        return real(x, (torch.ones_like(cos), torch.zeros_like(sin)), layer, nat, attend, scratch)

    block.native = no_rotary
    try:
        cache = model.new_cache(16)
        ours = model(tokens, cache, output_layers=(0,)).layers[0]
    finally:
        block.native = real
    rows = (ours - theirs[0]).abs().amax(-1)[0]
    assert float(rows.median()) > 1e-5 * float(theirs[0].abs().max())


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_native_layers_are_batch_invariant(tiny_dir, arch, monkeypatch):
    from helpers import verify_vs_decode

    monkeypatch.setattr(kq, "REQUANTIZE", kq.Q4K)
    model = _model(tiny_dir, arch)
    for k in (1, 3, 8, 9, 17):
        together, alone = verify_vs_decode(model, prompt_len=9, k=k, seed=k)
        assert torch.equal(together, alone), k


def test_a_long_prefill_computes_what_one_token_steps_compute(tiny_dir):
    """A prefill longer than ROW_ATTENTION_MAX attends row by row natively too: its cached keys
    and values and its last logits are bitwise what one-token steps compute (what lets a request
    reuse another's cached rows), and a sequence's decode rows get the same bits beside it."""
    model = _model(tiny_dir, "qwen2")
    assert model.rows_bitwise
    g = torch.Generator().manual_seed(3)
    prompt, rows = (
        torch.randint(0, model.args.vocab_size, (7,), generator=g),
        torch.randint(0, model.args.vocab_size, (4,), generator=g),
    )
    long = torch.randint(0, model.args.vocab_size, (80,), generator=g)  # > ROW_ATTENTION_MAX

    def decode(with_prefill: bool) -> torch.Tensor:
        cache = model.new_cache(16)
        model(prompt[None], cache)
        segs = [Segment(rows, cache)]
        if with_prefill:
            segs.append(Segment(long, model.new_cache(90)))
        return model.forward_batch(segs)[0].logits

    assert torch.equal(decode(False), decode(True))

    def cached(tokens: torch.Tensor, steps: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = model.new_cache(90)
        if steps:
            for t in range(tokens.shape[0]):
                logits = model(tokens[None, t : t + 1], cache).logits[0, -1]
        else:
            logits = model(tokens[None], cache, last_only=True).logits[0, -1]
        return cache.k[:, :, :, :80], cache.v[:, :, :, :80], logits

    whole, stepped = cached(long, False), cached(long, True)
    assert all(torch.equal(a, b) for a, b in zip(whole, stepped, strict=True))
    # control: the comparison sees one changed token far back
    other = long.clone()
    other[40] = (other[40] + 1) % model.args.vocab_size
    assert not torch.equal(cached(other, False)[0][:, :, :, 79], whole[0][:, :, :, 79])


@pytest.mark.slow
def test_every_build_gives_the_same_forward(tiny_dir):
    """The native layer's float steps are the same operations in the AVX2 and AVX-512 builds:
    a whole forward (prefill and a 5-row pass) gives the same logits bitwise."""
    flags = native._cpu_flags()
    if not native._AVX512_NEEDS <= flags:
        pytest.skip("this CPU runs only the AVX2 build")
    model = _model(tiny_dir, "qwen2")
    kernels = [m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), kq.KQuantKernel)]
    g = torch.Generator().manual_seed(5)
    prompt, rows = (
        torch.randint(0, model.args.vocab_size, (1, 70), generator=g),
        torch.randint(0, model.args.vocab_size, (1, 5), generator=g),
    )
    outs = []
    for build in (native.AVX2, native.AVX512):
        for k in kernels:
            k.lib, k._calls = native._library(build), {}
        assert model.set_native_layers(True)
        cache = model.new_cache(80)
        outs.append((model(prompt, cache).logits, model(rows, cache).logits))
    for k in kernels:
        k.lib, k._calls = native.library(), {}
    model.set_native_layers(True)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_the_comparison_catches_qwen3_without_its_qk_norms(tiny_dir):
    """Negative control for Qwen3's per-head q/k norms in the native layer: handed no norms
    (NULL), the layer is far from the framework's."""
    model = _model(tiny_dir, "qwen3")
    tokens = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    theirs = _layers(model, tokens, False)
    block = model.model.layers[0]
    with torch.no_grad():  # norm weights far from one, so that leaving them out shows
        block.self_attn.q_norm.weight.mul_(3.0)
    theirs = _layers(model, tokens, False)
    ours = _layers(model, tokens, True)
    assert float((ours[0] - theirs[0]).abs().amax(-1)[0].median()) <= 1e-5 * float(theirs[0].abs().max())
    block.native.struct.q_norm = None
    block.native.struct.k_norm = None
    model._native_stack = None  # (one call per layer, through the struct just changed)
    cache = model.new_cache(16)
    without = model(tokens, cache, output_layers=(0,)).layers[0]
    assert float((without - theirs[0]).abs().amax(-1)[0].median()) > 1e-3 * float(theirs[0].abs().max())


def _gemma_with_norms(tiny_dir):
    """The tiny Gemma 3 with every norm's weight random (the tiny model's are near zero, where a
    norm of w and one of 1 + w would be told apart by little)."""
    model = _model(tiny_dir, "gemma3")
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "RMSNorm":
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.5)
    model.set_native_layers(True)
    return model


@pytest.mark.parametrize("broken", ["none", "norm of w, not 1 + w", "SiLU for GELU", "no sandwich norms"])
def test_the_comparison_catches_each_gemma_step_left_out(tiny_dir, broken):
    """Negative controls for Gemma 3's steps in the native layer: each left out (the norms
    handed w instead of 1 + w, SiLU run for GELU's tanh form, the norms of the attention's and
    the MLP's outputs dropped) puts the first layer far from the framework's; with none left
    out it is within rounding."""
    model = _gemma_with_norms(tiny_dir)
    tokens = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    theirs = _layers(model, tokens, False)
    block = model.model.layers[0]
    st = block.native.struct
    if broken == "norm of w, not 1 + w":
        raw = [block.input_layernorm.weight, block.pre_feedforward_layernorm.weight]
        st.norm_attn, st.norm_mlp = (w.data_ptr() for w in raw)
    elif broken == "SiLU for GELU":
        st.act = 0
    elif broken == "no sandwich norms":
        st.norm_attn_out = st.norm_mlp_out = None
    model._native_stack = None  # (one call per layer, through the struct just changed)
    cache = model.new_cache(16)
    ours = model(tokens, cache, output_layers=(0,)).layers[0]
    err = float((ours - theirs[0]).abs().amax(-1)[0].median()) / float(theirs[0].abs().max())
    if broken == "none":
        assert err <= 1e-5
    else:
        assert err > 1e-3, err


def test_gemma_layers_of_both_kinds_in_one_call(tiny_dir):
    """Gemma 3's sliding-window and full layers share one native call, each with its own
    attention and rotary table: the whole forward is within rounding of the framework's, and
    the same call with every layer marked full (a negative control) is not."""
    model = _gemma_with_norms(tiny_dir)
    a = model.args
    assert set(a.layer_sliding) == {True, False} and model._native_stack is not None
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, a.vocab_size, (1, a.sliding_window + 6), generator=g)

    def logits(native: bool) -> torch.Tensor:
        model.set_native_layers(native)
        return model(tokens, model.new_cache(tokens.shape[1] + 2)).logits[0]

    theirs, ours = logits(False), logits(True)
    scale = float(theirs.abs().max())
    assert float((ours - theirs).abs().amax(-1).median()) <= 1e-4 * scale
    for layer in model._native_stack.layers:
        layer.struct.sliding = 0
    wrong = model(tokens, model.new_cache(tokens.shape[1] + 2)).logits[0]
    model.set_native_layers(True)
    assert float((wrong - theirs).abs().amax(-1).median()) > 1e-2 * scale


def test_gemma_final_norm_is_one_plus_w_natively(tiny_dir):
    model = _gemma_with_norms(tiny_dir)
    norm = model.model.norm
    assert norm.native is not None
    x = torch.randn(1, 5, model.args.dim, generator=torch.Generator().manual_seed(4)) * 3
    ours = norm(x)
    model.set_native_layers(False)
    try:
        theirs = norm(x)
    finally:
        model.set_native_layers(True)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_threads_running_one_model_at_once_get_their_own_results(tiny_dir):
    """A server's worker and a caller of generate may run forwards of one model at the same
    time (the native calls run without the GIL): each thread's rows must come out as they do
    alone (each thread has its own scratch)."""
    import threading

    model = _model(tiny_dir, "qwen2")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, model.args.vocab_size, (1, 40), generator=g) for _ in range(2)]

    def run(tokens):
        cache = model.new_cache(64)
        return torch.cat([model(tokens[:, i : i + 8], cache).logits for i in range(0, 40, 8)], 1)

    alone = [run(p) for p in prompts]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def worker(n):
        for _ in range(30):
            got[n].append(run(prompts[n]))

    threads = [threading.Thread(target=worker, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in (0, 1):
        assert all(torch.equal(x, alone[n]) for x in got[n]), n


def test_scratch_is_kept_per_thread_up_to_a_bound():
    import threading

    from specdec.model.fused import Scratch

    s = Scratch()
    a = s.buffer(1000)
    assert s.buffer(500).data_ptr() == a.data_ptr() and a.numel() >= 1000  # kept and reused
    assert s.buffer(2000).numel() >= 2000
    big = s.buffer(Scratch.KEEP + 1)
    assert big.numel() == Scratch.KEEP + 1 and s.buffer(10).numel() < Scratch.KEEP  # a big need is not kept
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(s.buffer(10).data_ptr()))
    t.start()
    t.join()
    assert other[0] != s.buffer(10).data_ptr()  # another thread, another buffer


def test_a_forward_of_no_rows_returns_no_rows(tiny_dir):
    model = _model(tiny_dir, "llama")
    out = model.forward_batch([Segment(torch.zeros(0, dtype=torch.long), model.new_cache(4))])[0]
    assert out.logits.shape == (1, 0, model.args.vocab_size)


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_layers_in_one_call_equal_one_call_per_layer(tiny_dir, arch):
    """A forward whose blocks run in one native call (`NativeStack`) gives the bits of one call
    per block: logits, the keys and values it leaves in the cache, and a partial run of the
    blocks (an early-exit drafter's) with the hidden rows it returns."""
    model = _model(tiny_dir, arch)
    assert model._native_stack is not None
    g = torch.Generator().manual_seed(3)
    prompt, step = (torch.randint(0, model.args.vocab_size, (1, n), generator=g) for n in (12, 3))
    hi = model.args.n_layers - 1

    def run(stacked: bool):
        keep = model._native_stack
        if not stacked:
            model._native_stack = None
        try:
            cache = model.new_cache(20)
            full = [model(prompt, cache).logits, model(step, cache).logits]
            part = model(step, cache, blocks=(0, hi), head=False).residual
            return full, part, cache.k[:, :, :, : cache.length].clone()
        finally:
            model._native_stack = keep

    (f1, p1, k1), (f2, p2, k2) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(f1, f2, strict=True))
    assert torch.equal(p1, p2) and torch.equal(k1, k2)


def test_final_norm_runs_in_the_native_library_with_the_layers(tiny_dir):
    """With native layers the model's final norm is the library's (per row: a row alone gets its
    bits among others), equal to the framework's up to float rounding; without them, the
    framework's again."""
    model = _model(tiny_dir, "qwen2")
    norm = model.model.norm
    assert norm.native is not None
    x = torch.randn(1, 5, model.args.dim, generator=torch.Generator().manual_seed(4)) * 3
    ours = norm(x)
    assert torch.equal(norm(x[:, 2:3]), ours[:, 2:3])
    model.set_native_layers(False)
    try:
        assert norm.native is None
        theirs = norm(x)
    finally:
        model.set_native_layers(True)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours, theirs * 1.001, rtol=1e-5, atol=1e-6)  # (it would see a 0.1% error)
