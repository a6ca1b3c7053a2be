"""The roofline of a q4k pass on this machine: what a k-row forward must cost at least.

Two native probes (csrc/roofline.c) measure the machine as the kernels use it: the read
bandwidth of threads streaming their own contiguous shares of a buffer far larger than the
caches (as the kernel streams its weight tiles), and the rate of the build's integer dot
product with no memory traffic. A pass over k rows reads every packed weight once and issues
k multiply-adds per weight, so it cannot take less than

    floor = max(bytes / bandwidth, multiply-adds / rate)

(plus the keys and values the attention reads). `specdec bench forward` prints each pass's
time against its floor, for the whole pass and for its parts (the LM head, the attention),
so a pass that is far above its floor shows whether memory, work or overhead is in the way.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..model import native
from ..model.kquant import QK, TILE, TILE_DTYPES, KQuantKernel
from ..model.transformer import Transformer


@dataclass(frozen=True)
class Machine:
    """What the probes measured (the best of their rounds, and of the probes of one run: the
    floor is what the hardware can give, not what it gave on average)."""

    bandwidth_gbs: float  # streaming read, all threads
    mac_rate_g: float  # integer multiply-adds per second of the kernel build's dot product, all threads, 1e9
    build: str  # the kernel build the rate belongs to
    threads: int


def probe(threads: int | None = None, mib: int = 256, rounds: int = 5) -> Machine:
    """Measure this machine's roofs with the kernel build `native.dispatch` picks."""
    lib = native.library()
    threads = threads or torch.get_num_threads()
    buf = torch.ones(mib << 20, dtype=torch.uint8)  # touched, so its pages exist (4 KB, as the weights')
    best_bw = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        lib.specdec_stream_read(buf.data_ptr(), buf.numel(), threads)
        best_bw = max(best_bw, buf.numel() / (time.perf_counter() - t0))
    del buf
    steps = 1_000_000  # 16 M dot products per thread: a large fraction of a second
    best_rate = 0.0
    for seed in range(rounds):
        t0 = time.perf_counter()
        macs = lib.specdec_dot_rate(steps, threads, seed)
        best_rate = max(best_rate, macs / (time.perf_counter() - t0))
    return Machine(best_bw / 1e9, best_rate / 1e9, native.build_name(), threads)


def best(a: Machine | None, b: Machine) -> Machine:
    """The higher roofs of two probes of one machine."""
    if a is None:
        return b
    return Machine(max(a.bandwidth_gbs, b.bandwidth_gbs), max(a.mac_rate_g, b.mac_rate_g), b.build, b.threads)


@dataclass(frozen=True)
class Work:
    """What one row of a pass costs in weights: bytes read once per pass, multiply-adds per row."""

    layer_bytes: int  # the decoder layers' packed weights
    layer_macs: int  # per row (the tiles' whole 16 x 256 blocks, padding included: what the kernel issues)
    head_bytes: int
    head_macs: int
    kv_bytes_per_token: int  # keys and values one cached token holds, all layers (float32)


def _kernel_work(kernel: KQuantKernel) -> tuple[int, int]:
    tiles = kernel.weight.numel() // TILE_DTYPES[kernel.kind].itemsize
    return kernel.weight.numel(), tiles * TILE * QK


def work(model: Transformer) -> Work:
    head = model.lm_head.kernel
    if not isinstance(head, KQuantKernel):
        raise ValueError("the roofline needs a model in the q4k mode")
    layers = [m.kernel for m in model.model.modules() if isinstance(getattr(m, "kernel", None), KQuantKernel)]
    lb = sum(_kernel_work(k)[0] for k in layers)  # type: ignore[arg-type]
    lm = sum(_kernel_work(k)[1] for k in layers)  # type: ignore[arg-type]
    hb, hm = _kernel_work(head)
    a = model.args
    return Work(lb, lm, hb, hm, 2 * a.n_layers * a.n_kv_heads * a.head_dim * 4)


def _part(ms: float, nbytes: int, macs: int, m: Machine) -> dict[str, float]:
    mem, comp = nbytes / (m.bandwidth_gbs * 1e9) * 1e3, macs / (m.mac_rate_g * 1e9) * 1e3
    floor = max(mem, comp)
    return {
        "ms": ms,
        "bytes": nbytes,
        "macs": macs,
        "memory_ms": mem,
        "compute_ms": comp,
        "floor_ms": floor,
        "bound": "memory" if mem >= comp else "compute",
        "achieved_over_floor": ms / floor if floor else float("nan"),
    }


def _median_ms(fn, repeats: int) -> float:  # noqa: ANN001
    times = []
    for r in range(repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        fn()
        if r:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def parts(model: Transformer, cache: Any, context: int, k: int, repeats: int) -> tuple[float, float]:  # noqa: ANN401
    """(ms of the LM head over k rows, ms of the attention of k rows over every layer), timed
    alone: the head on random final hidden rows, the attention on the cache as the last k-row
    pass left it (its keys already written)."""
    a = model.args
    g = torch.Generator().manual_seed(k)
    h = torch.randn(1, k, a.dim, generator=g)
    head_ms = _median_ms(lambda: model.head_logits(h), repeats)
    scale = a.attn_scale if a.attn_scale is not None else a.head_dim**-0.5
    attend = native.SegmentAttention([(cache.k, cache.v)], [context], [k], [None], scale)
    q = torch.randn(k, a.n_heads, a.head_dim, generator=g)
    attn_ms = _median_ms(lambda: [attend(i, q, None, None) for i in range(a.n_layers)], repeats)
    return head_ms, attn_ms


def rows(
    model: Transformer,
    machine: Machine,
    totals: dict[int, float],
    heads: dict[int, float],
    attns: dict[int, float],
    context: int,
) -> dict[str, Any]:
    """Per k: the whole pass, the LM head and the attention against their floors."""
    w = work(model)
    out: dict[str, Any] = {"machine": asdict(machine), "ks": {}}
    for k, ms in totals.items():
        kv = w.kv_bytes_per_token * (context + k)
        out["ks"][str(k)] = {
            "pass": _part(ms, w.layer_bytes + w.head_bytes + kv, k * (w.layer_macs + w.head_macs), machine),
            "head": _part(heads[k], w.head_bytes, k * w.head_macs, machine),
            "attention": _part(attns[k], kv, 0, machine),  # its float work is small beside reading the cache
        }
    return out


def table(roof: dict[str, Any]) -> str:
    m = roof["machine"]
    lines = [
        f"roofline (q4k): streaming read {m['bandwidth_gbs']:.1f} GB/s, {m['build']} dot products "
        f"{m['mac_rate_g']:.0f} G multiply-adds/s, {m['threads']} threads",
        f"{'k':>3s} {'MB read':>8s} {'G MAC':>7s} {'memory':>7s} {'compute':>8s} {'floor':>7s} {'pass':>7s} "
        f"{'x floor':>7s} | {'head':>6s} {'x floor':>7s} | {'attn':>6s} {'x floor':>7s}",
    ]
    for k, r in roof["ks"].items():
        p, h, a = r["pass"], r["head"], r["attention"]
        lines.append(
            f"{k:>3s} {p['bytes'] / 1e6:8.0f} {p['macs'] / 1e9:7.2f} {p['memory_ms']:7.1f} {p['compute_ms']:8.1f} "
            f"{p['floor_ms']:7.1f} {p['ms']:7.1f} {p['achieved_over_floor']:7.2f} | {h['ms']:6.1f} "
            f"{h['achieved_over_floor']:7.2f} | {a['ms']:6.2f} {a['achieved_over_floor']:7.1f}"
        )
    lines.append(
        "(ms; floor = max(memory, compute); x floor = achieved / floor. The rest of a pass beyond the head "
        "and the attention is the decoder layers' kernels and what runs around them)"
    )
    return "\n".join(lines)
