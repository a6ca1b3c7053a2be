"""Precision/kernel modes: batch invariance as a tested property, and the int8 kernel."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import verify_vs_decode

import specdec
from specdec.bench import forward as bench_forward
from specdec.drafters import DraftModelDrafter
from specdec.model import kernels, load_transformer, native
from specdec.model.kernels import MODES, Int8Kernel, get_mode

# q4k needs specdec's native kernels (gcc and AVX2 on the machine); where they cannot be built,
# auto falls back to int8 and q4k is not tested here.
INVARIANT_MODES = [m for m in MODES.values() if m.batch_invariant and (m.name != "q4k" or native.available())]


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "int_mm"])
def test_int8_kernel_is_accurate_and_row_local(monkeypatch, onednn):
    if onednn and not kernels._onednn_int8_available():
        pytest.skip("this torch build has no oneDNN int8 ops")
    monkeypatch.setattr(kernels, "_onednn_int8_available", lambda: onednn)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 640, generator=g), torch.randn(96, generator=g)
    x = torch.randn(33, 640, generator=g) * torch.linspace(0.1, 10, 33)[:, None]
    kern = Int8Kernel(w, b)
    assert (kern.packed is not None) == onednn
    y = kern(x)
    ref = torch.nn.functional.linear(x, w, b)
    assert ((y - ref).norm() / ref.norm()) < 0.02
    for m in (1, 2, 5, 9, 16, 33):  # any row is bitwise what it is in a call of any size
        part = kern(x[:m])
        assert torch.equal(part, y[:m])
        assert torch.equal(kern(x[m - 1 : m]), y[m - 1 : m])


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown mode 'int3'"):
        get_mode("int3")


@pytest.mark.parametrize("mode", INVARIANT_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma3"])
def test_batch_invariant_modes_are_bitwise_invariant_tiny(tiny_dir, arch, mode):
    model = load_transformer(tiny_dir(arch), dtype=mode.name, device="cpu")
    for k in (1, 2, 4, 8, 16):
        together, alone = verify_vs_decode(model, prompt_len=13, k=k, seed=k)  # 13 + k > Gemma's window
        assert torch.equal(together, alone), (arch, k)


@pytest.mark.real
@pytest.mark.parametrize("mode", INVARIANT_MODES, ids=lambda m: m.name)
def test_batch_invariant_modes_are_bitwise_invariant_smollm2(smollm2, mode):
    model = load_transformer(smollm2.path, dtype=mode.name, device="cpu")
    for k in (2, 5, 9):
        together, alone = verify_vs_decode(model, prompt_len=40, k=k)
        assert torch.equal(together, alone), k


@pytest.mark.parametrize("mode", INVARIANT_MODES, ids=lambda m: m.name)
def test_greedy_identity_in_invariant_modes_tiny(tiny_dir, mode):
    target = specdec.load(tiny_dir("qwen2"), dtype=mode.name, device="cpu")
    draft = specdec.load(tiny_dir("qwen2", "close"), dtype=mode.name, device="cpu")
    for prompt in ("abcabcabc", "def f(x):\n", "Hello, world. Hello"):
        for k in (1, 4, 7):
            plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
            spec = specdec.generate(
                target, prompt, assistant_model=draft, k=k, max_new_tokens=24, ignore_eos=True, adaptive_k=False
            )
            assert spec.token_ids == plain.token_ids


@pytest.mark.real
def test_greedy_identity_int8_smollm2(smollm2):
    target = specdec.load("smollm2-135m", dtype="int8", device="cpu")
    noisy = load_transformer(smollm2.path, dtype="int8", device="cpu")
    g = torch.Generator().manual_seed(0)
    emb = noisy.model.embed_tokens.weight
    emb.add_(0.15 * emb.std() * torch.randn(emb.shape, generator=g))  # a draft that is sometimes wrong
    rejected = 0
    for prompt in ("What is the capital of France?", "Write a haiku about the sea.", "Count from 1 to 10."):
        plain = specdec.generate(target, prompt, max_new_tokens=32)
        spec = specdec.generate(
            target, prompt, drafter=DraftModelDrafter(noisy), k=5, max_new_tokens=32, adaptive_k=False
        )
        assert spec.token_ids == plain.token_ids, prompt
        rejected += spec.metrics.proposed - spec.metrics.accepted
    assert rejected > 0


def test_bench_forward_harness_on_tiny(tiny_dir):
    """Harness check only (speed is never asserted): well-formed output, invariance flags."""
    out = bench_forward.run(
        str(tiny_dir("llama")),
        modes=["fp32", "int8"],
        context=16,
        ks=(1, 2, 8),
        repeats=1,
        device="cpu",
        progress=lambda s: None,
    )
    assert set(out["modes"]) == {"fp32", "int8"}
    for r in out["modes"].values():
        assert set(r["ms"]) == {"1", "2", "8"} and all(v > 0 for v in r["ms"].values())
    assert out["modes"]["int8"]["batch_invariant"] is True
    assert "k=8" in bench_forward.table(out)


@pytest.mark.slow
def test_bench_forward_cli_json(tiny_dir):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "bench",
            "forward",
            "--model",
            str(tiny_dir("qwen2")),
            "--modes",
            "int8",
            "--context",
            "8",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["modes"]["int8"]["batch_invariant"] is True and set(out["modes"]["int8"]["ms"]) == {
        "1",
        "2",
        "4",
        "8",
        "16",
    }


def test_auto_mode_is_the_exact_fast_one_on_cpu(tiny_dir, monkeypatch):
    lm = specdec.load(tiny_dir("llama"), device="cpu")
    expected = "q4k" if native.available() else "int8"
    assert lm.model.mode == expected and get_mode("auto").batch_invariant
    # Where the q4k kernel cannot be built (no compiler, no AVX2), auto falls back to int8.
    monkeypatch.setattr(native, "available", lambda: False)
    assert get_mode("auto").name == "int8"


@pytest.mark.real
def test_bench_forward_sets_llama_cpp_beside_ours_when_built(smollm2):
    from specdec import registry, store
    from specdec.bench import side_by_side
    from specdec.model import load_transformer

    if side_by_side.llama_bench() is None:
        pytest.skip(side_by_side.unavailable())
    gguf = store.gguf_path(registry.MODELS["smollm2-135m"])
    model = load_transformer(store.resolve("smollm2-135m"), dtype="q4k", device="cpu")
    got = side_by_side.compare(model, gguf, context=16, ks=(1, 4), prefill=(32,), rounds=2, repeats=1, progress=str)
    assert set(got["rows"]) == {"k1", "k4", "pp32"}
    assert all(r["ours_ms"] > 0 and r["llama_cpp_ms"] > 0 for r in got["rows"].values())
    assert got["rss"]["llama_cpp"] > 0 and "k=4" in side_by_side.table(got)


def test_bench_forward_says_why_llama_cpp_was_not_timed(tiny_dir):
    got = bench_forward.run(str(tiny_dir("llama")), modes=["q4k"], context=4, ks=(1, 2), repeats=1, progress=str)
    assert "no .gguf file" in got["llama_cpp"]["unavailable"]
    assert "llama.cpp: not timed (" in bench_forward.table(got)


AVX512_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.mark.parametrize(
    "flags, amx_problem, build, says",
    [
        (AVX512_FLAGS, None, native.AVX512, "no AMX"),
        (AVX512_FLAGS | {"amx_tile", "amx_int8"}, None, native.AMX, "passed its self-check"),
        (AVX512_FLAGS | {"amx_tile", "amx_int8"}, "the OS refused the tile state", native.AVX512, "the OS refused"),
        ({"avx2", "fma", "f16c", "avx512f", "amx_tile", "amx_int8"}, None, native.AVX2, "not avx512_vnni, avx512bw"),
        ({"avx2", "fma"}, None, None, "missing: f16c"),
    ],
)
def test_kernel_dispatch_from_cpu_flags(flags, amx_problem, build, says):
    """One place picks the kernel build from what the CPU reports (AMX -> AVX-512 VNNI ->
    AVX2), and says why (`native.decide`, which `dispatch` asks with this CPU's flags)."""
    if build is None:
        with pytest.raises(native.NativeUnavailableError, match=says):
            native.decide(set(flags), "", lambda: amx_problem)
    else:
        got, why = native.decide(set(flags), "", lambda: amx_problem)
        assert got == build and says in why


def test_kernel_build_can_be_forced_for_a_before_after_comparison(monkeypatch):
    flags = set(AVX512_FLAGS)
    assert native.decide(flags, "avx2") == (native.AVX2, "forced by SPECDEC_KERNELS=avx2.")
    with pytest.raises(native.NativeUnavailableError, match="needs amx_int8, amx_tile"):
        native.decide(flags, "avx512-amx")
    with pytest.raises(native.NativeUnavailableError, match="not a kernel build"):
        native.decide(flags, "sse4")
    monkeypatch.setenv("SPECDEC_KERNELS", "sse4")  # (what `dispatch` reads)
    with pytest.raises(native.NativeUnavailableError, match="SPECDEC_KERNELS='sse4' is not a kernel build"):
        native.dispatch()


@pytest.mark.slow
def test_info_reports_the_machine_and_the_kernel_path():
    res = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "info", "--json", "--no-bandwidth"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    flags = info["cpu"]["flags"]
    if native.available():
        assert info["kernels"]["build"] == native.dispatch()[0] and info["default_mode"] == "q4k"
        assert (info["kernels"]["build"] != native.AVX2) == all(
            flags[f] for f in ("avx512f", "avx512bw", "avx512_vnni")
        )
    else:
        assert info["kernels"]["build"] is None and info["default_mode"] == "int8"
    assert info["torch_threads"] >= 1 and info["memory_gib"] > 0
    text = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "info", "--no-bandwidth"], capture_output=True, text=True
    ).stdout
    assert "native kernels:" in text and "default precision mode" in text


def test_bench_forward_sets_q4k_passes_against_the_roofline(tiny_dir, monkeypatch):
    """The q4k mode's passes come with their floors: bytes are the packed weights plus the cache
    read, multiply-adds grow with k, floor = max(memory, compute) from the probed machine, and
    the table prints it (speed is never asserted)."""
    from specdec.bench import roofline
    from specdec.model import load_transformer, native
    from specdec.model.kquant import KQuantKernel

    if not native.available():
        pytest.skip("the q4k kernel cannot be built on this machine")
    machine = roofline.Machine(bandwidth_gbs=10.0, mac_rate_g=5.0, build="avx2", threads=1)
    monkeypatch.setattr(roofline, "probe", lambda rounds: machine)  # the real probes take a second; tested below
    out = bench_forward.run(
        str(tiny_dir("llama")), modes=["q4k"], context=16, ks=(1, 8), repeats=1, device="cpu", progress=lambda s: None
    )
    roof = out["modes"]["q4k"]["roofline"]
    model = load_transformer(tiny_dir("llama"), dtype="q4k", device="cpu")
    packed = sum(
        m.kernel.weight.numel() for m in model.modules() if isinstance(getattr(m, "kernel", None), KQuantKernel)
    )
    a = model.args
    for k in ("1", "8"):
        p = roof["ks"][k]["pass"]
        kv = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 4 * (16 + int(k))
        assert p["bytes"] == packed + kv
        assert p["memory_ms"] == pytest.approx(p["bytes"] / 10e9 * 1e3)
        assert p["compute_ms"] == pytest.approx(p["macs"] / 5e9 * 1e3)
        assert p["floor_ms"] == max(p["memory_ms"], p["compute_ms"])
        assert p["achieved_over_floor"] == pytest.approx(out["modes"]["q4k"]["ms"][k] / p["floor_ms"])
    assert roof["ks"]["8"]["pass"]["macs"] == 8 * roof["ks"]["1"]["pass"]["macs"] > 0
    assert roof["ks"]["8"]["head"]["bytes"] == model.lm_head.kernel.weight.numel()
    assert "floor" in bench_forward.table(out) and "10.0 GB/s" in bench_forward.table(out)


def test_roofline_probes_measure_something():
    from specdec.bench import roofline
    from specdec.model import native

    if not native.available():
        pytest.skip("the native kernels cannot be built on this machine")
    m = roofline.probe(threads=1, mib=32, rounds=1)
    assert m.bandwidth_gbs > 0.1 and m.mac_rate_g > 0.1 and m.build == native.build_name()


def test_the_roof_is_the_best_of_the_probes():
    from specdec.bench import roofline

    a = roofline.Machine(30.0, 200.0, "avx512", 2)
    b = roofline.Machine(40.0, 150.0, "avx512", 2)
    assert roofline.best(None, a) == a
    assert roofline.best(a, b) == roofline.best(b, a) == roofline.Machine(40.0, 200.0, "avx512", 2)
