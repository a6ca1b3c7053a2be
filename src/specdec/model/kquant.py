"""GGUF weight blocks with int8 activations: the `q4k` mode's kernel.

The weights keep the GGUF file's own blocks, repacked for the kernel and nothing rounded: the
K-quants Q4_K, Q5_K, Q6_K (256 weights a block), GGML's 32-weight types Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, and float rows (F16, BF16, F32). A model installed from a GGUF runs on exactly the
numbers llama.cpp runs on, at the file's own bits per weight. Only where a user asks for it
(`--requantize`) are the tensors of other types than Q4_K/Q6_K re-quantized to Q6_K, as
specdec once did for all of them (fewer kernels, but not the file's numbers: a Q8_0 layer's
error against its float original grows about fourfold).

The dot products live in ``csrc/kquant.c`` (AVX2, with an AVX-512 VNNI build), compiled once
per machine with the rest of specdec's native kernels. This module runs the build it is
given: `native.library()` is this machine's (`native` chooses it, running `self_check`).
Activations are quantized per row and per 256-block to int8; inside a block (or a 32-weight
group) all sums are exact integers, and blocks are added to a per-row float accumulator in a
fixed order, so the kernel is batch-invariant: one row's result does not depend on the other
rows in the call. Float rows multiply the float activations, each output's sum in a fixed
order (two chains, even and odd inputs), batch-invariant too.

Q4_K and Q6_K blocks are held here in a structured form (`Q4K_DTYPE`, `Q6K_DTYPE`: scales
unpacked, float16 widened); the other kinds keep the file's bytes (`Blocks.data` is then
[N, blocks per row, bytes per block] uint8) and the `gguf` package is their reference
(`dequantize`).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

QK = 256  # weights per super-block
Q4K = 4
Q6K = 6
# Draft packings (`--draft-bits 3|2`): q4k's format with 3- and 2-bit codes (csrc/kquant.c)
Q3 = 3
Q2 = 2
LOW_BITS = (Q3, Q2)
# The file's own bytes, run as they are (csrc/specdec.h, KIND_*)
Q5K = 5
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 = 8, 40, 41, 50, 51
F16, BF16, F32 = 16, 17, 32
LEGACY = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)  # GGML's 32-weight types
FLOATS = (F16, BF16, F32)
RAW = (Q5K, *LEGACY, *FLOATS)  # kinds whose `Blocks.data` is the file's bytes
# The GGML type of each kind a GGUF tensor can be run as
GGML_TYPES = {
    Q4K: GGMLQuantizationType.Q4_K,
    Q5K: GGMLQuantizationType.Q5_K,
    Q6K: GGMLQuantizationType.Q6_K,
    Q8_0: GGMLQuantizationType.Q8_0,
    Q4_0: GGMLQuantizationType.Q4_0,
    Q4_1: GGMLQuantizationType.Q4_1,
    Q5_0: GGMLQuantizationType.Q5_0,
    Q5_1: GGMLQuantizationType.Q5_1,
    F16: GGMLQuantizationType.F16,
    BF16: GGMLQuantizationType.BF16,
    F32: GGMLQuantizationType.F32,
}
KIND_OF_TYPE = {t: k for k, t in GGML_TYPES.items()}
# How `specdec info` names a kind (the draft packings are specdec's own)
KIND_NAMES = {k: t.name for k, t in GGML_TYPES.items()} | {Q3: "q3 (draft packing)", Q2: "q2 (draft packing)"}

# The C structs, field for field (see csrc/kquant.c).
Q4K_DTYPE = np.dtype([("d", "<f4"), ("dmin", "<f4"), ("sc", "u1", 8), ("mn", "u1", 8), ("qs", "u1", 128)])
Q6K_DTYPE = np.dtype([("d", "<f4"), ("sc", "i1", 16), ("ql", "u1", 128), ("qh", "u1", 64)])
# (the draft packings' blocks: codes one per byte, in weight order; they exist only on the way to tiles)
LOW_DTYPE = np.dtype([("d", "<f4"), ("dmin", "<f4"), ("sc", "u1", 8), ("mn", "u1", 8), ("q", "u1", QK)])
BLOCK_DTYPES = {Q4K: Q4K_DTYPE, Q6K: Q6K_DTYPE, Q3: LOW_DTYPE, Q2: LOW_DTYPE}
# Layers not stored as Q4_K/Q6_K are quantized to this: 6.6 bits, per-16 scales.
REQUANTIZE = Q6K
TILE = 16  # outputs per kernel tile
# The kernel's repacked tiles (16 outputs x 256 inputs), field for field as in csrc/kquant.c.
TILE_DTYPES = {
    Q4K: np.dtype(
        [
            ("d", "<f4", TILE),
            ("dmin", "<f4", TILE),
            ("sc", "u1", (8, TILE)),
            ("mn", "u1", (4, TILE, 2)),
            ("qs", "u1", (8, 4, 4 * TILE)),
        ]
    ),
    Q6K: np.dtype(
        [
            ("d", "<f4", TILE),
            ("sc", "i1", (16, TILE)),
            ("sub", [("ql", "u1", (2, 4 * TILE)), ("qh", "u1", 4 * TILE)], 16),
        ]
    ),
    Q3: np.dtype(
        [
            ("d", "<f4", TILE),
            ("dmin", "<f4", TILE),
            ("sc", "u1", (8, TILE)),
            ("mn", "u1", (4, TILE, 2)),
            ("g", [("qs", "u1", (2, 4 * TILE)), ("qh", "u1", 4 * TILE)], 8),
        ]
    ),
    Q2: np.dtype(
        [
            ("d", "<f4", TILE),
            ("dmin", "<f4", TILE),
            ("sc", "u1", (8, TILE)),
            ("mn", "u1", (4, TILE, 2)),
            ("qs", "u1", (8, 2, 4 * TILE)),
        ]
    ),
}

# The raw kinds' tiles (16 outputs x 256 inputs), field for field as in csrc/kquant.c.
_Q5K_GROUP = np.dtype([("qs", "u1", (4, 4 * TILE)), ("qh", "u1", 4 * TILE)])
TILE_DTYPES[Q5K] = np.dtype(
    [*TILE_DTYPES[Q4K].descr[:4], ("g", _Q5K_GROUP, 8)]  # q4k's header (d, dmin, sc, mn)
)
for _kind in LEGACY:
    _bits = {Q4_0: 4, Q4_1: 4, Q5_0: 5, Q5_1: 5, Q8_0: 8}[_kind]
    _group = [("qs", "u1", (8 if _bits == 8 else 4, 4 * TILE))] + ([("qh", "u1", 4 * TILE)] if _bits == 5 else [])
    _head = [("d", "<u2", (8, TILE))] + ([("m", "<u2", (8, TILE))] if _kind in (Q4_1, Q5_1) else [])
    TILE_DTYPES[_kind] = np.dtype([*_head, ("g", np.dtype(_group), 8)])
TILE_DTYPES[F16] = TILE_DTYPES[BF16] = np.dtype([("w", "<u2", (QK, TILE))])
TILE_DTYPES[F32] = np.dtype([("w", "<f4", (QK, TILE))])

_SOURCE = Path(__file__).with_name("csrc") / "kquant.c"


@cache
def layout_version() -> str:
    """Changes whenever the kernel source or the packing code does (keys the packed-weight cache)."""
    return hashlib.sha256(_SOURCE.read_bytes() + Path(__file__).read_bytes()).hexdigest()[:16]


# -- blocks -------------------------------------------------------------------------------


@dataclass
class Blocks:
    """One weight matrix [N, K] as K-quant super-blocks: `data` is [N, K/256] of the kind's dtype."""

    kind: int  # Q4K, Q6K, a draft packing (Q3, Q2), or a raw kind (`RAW`)
    data: np.ndarray  # [N, K // QK] structured; raw kinds: [N, blocks per row, bytes per block] uint8

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind in RAW:
            return self.data.shape[0], self.data.shape[1] * GGML_QUANT_SIZES[GGML_TYPES[self.kind]][0]
        return self.data.shape[0], self.data.shape[1] * QK

    def permute_rows(self, order: np.ndarray) -> Blocks:
        return Blocks(self.kind, np.ascontiguousarray(self.data[order]))


def from_gguf(raw: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int) -> Blocks:
    """A GGUF tensor's bytes ([N, K] weights of `qtype`) as blocks the kernel runs; ValueError
    for a type it does not run (`KIND_OF_TYPE` lists those it does)."""
    kind = KIND_OF_TYPE.get(GGMLQuantizationType(qtype))
    if kind is None:
        raise ValueError(f"{GGMLQuantizationType(qtype).name} is not a block type specdec runs")
    if kind == Q4K:
        return from_gguf_q4_k(raw, n, k)
    if kind == Q6K:
        return from_gguf_q6_k(raw, n, k)
    per, size = GGML_QUANT_SIZES[GGML_TYPES[kind]]
    if k % per:
        raise ValueError(f"{k} inputs are not whole {GGML_TYPES[kind].name} blocks of {per}")
    return Blocks(kind, np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // per, size))


def from_gguf_q4_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    """GGUF Q4_K bytes (144 per block: d, dmin f16, 12 bytes of 6-bit scales/mins, 128 of
    nibbles) into the kernel's layout. The nibble order is already the kernel's."""
    b = np.ascontiguousarray(raw).reshape(n, k // QK, 144)
    q = b[..., 4:16].astype(np.uint8)  # packed scales
    sc = np.empty(b.shape[:2] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    out = np.empty(b.shape[:2], Q4K_DTYPE)
    out["d"] = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    out["dmin"] = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    out["sc"], out["mn"], out["qs"] = sc, mn, b[..., 16:144]
    return Blocks(Q4K, out)


def from_gguf_q6_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    """GGUF Q6_K bytes (210 per block: 128 low nibbles, 64 bytes of high bit pairs, 16 int8
    scales, d f16) into the kernel's layout (the same bit layout, d as float32)."""
    b = np.ascontiguousarray(raw).reshape(n, k // QK, 210)
    out = np.empty(b.shape[:2], Q6K_DTYPE)
    out["ql"], out["qh"] = b[..., 0:128], b[..., 128:192]
    out["sc"] = b[..., 192:208].view(np.int8)
    out["d"] = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return Blocks(Q6K, out)


def _codes_q4k(data: np.ndarray) -> np.ndarray:
    """[..., 256] codes 0..15 in weight order."""
    qs = data["qs"].reshape(*data.shape, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=-2)  # [..., 4, 2, 32]: element 64p + 32h + i
    return q.reshape(*data.shape, QK)


def _codes_q6k(data: np.ndarray) -> np.ndarray:
    """[..., 256] codes 0..63 in weight order."""
    ql = data["ql"].reshape(*data.shape, 2, 2, 32)  # [half, l0/l1, 32]
    qh = data["qh"].reshape(*data.shape, 2, 1, 32)
    lo = np.stack([ql[..., 0, :] & 0xF, ql[..., 1, :] & 0xF, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=-2)
    hi = np.concatenate([(qh >> (2 * g)) & 3 for g in range(4)], axis=-2)
    return (lo | (hi << 4)).reshape(*data.shape, QK)


def dequantize(blocks: Blocks) -> np.ndarray:
    """[N, K] float32 weights the blocks stand for (the reference for tests and checks; the
    raw kinds' is the gguf package's de-quantizer, what transformers uses)."""
    d = blocks.data
    if blocks.kind in RAW:
        n = d.shape[0]
        return np.asarray(gguf_dequantize(d.reshape(n, -1), GGML_TYPES[blocks.kind]), np.float32).reshape(blocks.shape)
    if blocks.kind in (Q4K, *LOW_BITS):
        q = (_codes_q4k(d) if blocks.kind == Q4K else d["q"]).reshape(*d.shape, 8, 32).astype(np.float32)
        w = (d["d"][..., None] * d["sc"])[..., None] * q - (d["dmin"][..., None] * d["mn"])[..., None]
    else:
        q = _codes_q6k(d).reshape(*d.shape, 16, 16).astype(np.float32) - 32
        w = (d["d"][..., None] * d["sc"])[..., None] * q
    return w.reshape(blocks.shape).astype(np.float32)


def quantize(weight: np.ndarray, kind: int, lib: ctypes.CDLL | None = None) -> Blocks:
    """Round float weights [N, K] to blocks: plain round-to-nearest with per-group ranges, for
    weights that do not come as K-quant blocks already. K is zero-padded to whole blocks.
    Q6_K (what installs re-quantize to) runs in the native build `lib` where one is given
    (`native.library_or_none()`): the same bytes as `quantize_reference` (tested), much
    faster."""
    if kind in LOW_BITS:
        return quantize_low(weight, kind)
    if kind in RAW:
        return quantize_raw(weight, kind)
    if kind == Q6K:
        if lib is not None:
            w = _padded(weight)
            out = np.empty((w.shape[0], w.shape[1] // QK), Q6K_DTYPE)
            lib.specdec_quantize_q6k(w.ctypes.data, w.shape[0], w.shape[1], out.ctypes.data, torch.get_num_threads())
            return Blocks(Q6K, out)
    return quantize_reference(weight, kind)


def quantize_low(weight: np.ndarray, bits: int, candidates: int = 9) -> Blocks:
    """Float weights [N, K] to a draft packing of `bits` (3 or 2) bits per code: per 32-weight
    group w ~ s * q - m (q in 0..2^bits - 1, m >= 0), s and m fitted by least squares to the
    rounding of each of `candidates` ranges (the group's [min, max] narrowed by up to 20%: at
    2 and 3 bits the extremes cost more than they give), the best kept; then s and m as 8-bit
    multiples of per-block steps, and the codes rounded again against those. In torch (both
    cores), deterministic."""
    levels = (1 << bits) - 1
    w = torch.from_numpy(_padded(weight))
    n, k = w.shape
    nb = k // QK
    g = w.reshape(n, nb, 8, 32)
    lo, hi = g.amin(-1).clamp_max(0.0), g.amax(-1)  # [n, nb, 8] (the format's offset is -m, m >= 0)
    sg, sgg = g.sum(-1), (g * g).sum(-1)
    best_err = torch.full(lo.shape, math.inf)
    best_s, best_m = torch.zeros(lo.shape), torch.zeros(lo.shape)
    q = torch.empty_like(g)
    for c in range(candidates):
        shrink = 0.2 * c / max(candidates - 1, 1)
        a = lo * (1 - shrink)
        inv = levels / ((hi - lo) * (1 - shrink)).clamp_min(1e-30)  # 1 / step over the narrowed range
        torch.sub(g, a[..., None], out=q).mul_(inv[..., None]).round_().clamp_(0, levels)
        # least squares of g ~ s q + t over the group's 32 weights (t = -m), by its sums
        sq, sqq, sqg = q.sum(-1), (q * q).sum(-1), (q * g).sum(-1)
        det = 32 * sqq - sq * sq
        s = torch.where(det > 0, (32 * sqg - sq * sg) / det.clamp_min(1e-30), 1 / inv)
        t = (sg - s * sq) / 32
        pos = t > 0  # a positive offset cannot be stored: the scale alone
        s = torch.where(pos, sqg / sqq.clamp_min(1e-30), s).clamp_min(0.0)
        t = torch.where(pos, torch.zeros_like(t), t)
        err = s * s * sqq + 2 * s * t * sq + 32 * t * t - 2 * s * sqg - 2 * t * sg + sgg
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, -t, best_m)
    d, dmin = best_s.amax(-1) / 255.0, best_m.amax(-1) / 255.0  # [n, nb]
    sc = torch.where(d[..., None] > 0, torch.round(best_s / d.clamp_min(1e-30)[..., None]), 0).clamp(0, 255)
    mn = torch.where(dmin[..., None] > 0, torch.round(best_m / dmin.clamp_min(1e-30)[..., None]), 0).clamp(0, 255)
    step = d[..., None] * sc
    q = torch.round((g + (dmin[..., None] * mn)[..., None]) / step.clamp_min(1e-30)[..., None])
    q = torch.where(step[..., None] > 0, q, 0).clamp(0, levels)
    out = np.empty((n, nb), LOW_DTYPE)
    out["d"], out["dmin"] = d.numpy(), dmin.numpy()
    out["sc"], out["mn"] = sc.to(torch.uint8).numpy(), mn.to(torch.uint8).numpy()
    out["q"] = q.to(torch.uint8).reshape(n, nb, QK).numpy()
    return Blocks(bits, out)


def quantize_raw(weight: np.ndarray, kind: int) -> Blocks:
    """Float weights [N, K] to a raw kind's GGUF bytes: the gguf package's quantizer (round to
    nearest, as llama.cpp's reference code) for the 32-weight and float types, and for Q5_K
    (which it lacks) per-group ranges rounded to nearest, as `quantize_reference` does Q4_K.
    K is zero-padded to whole blocks. For tests and synthetic files: real files come quantized."""
    qtype = GGML_TYPES[kind]
    per = GGML_QUANT_SIZES[qtype][0]
    w = np.ascontiguousarray(weight, np.float32)
    if w.shape[1] % per:
        w = np.pad(w, ((0, 0), (0, -w.shape[1] % per)))
    if kind == Q5K:
        raw = _quantize_q5k(w)
    elif kind == F32:
        raw = w.view(np.uint8)
    else:
        raw = np.asarray(gguf_quantize(w, qtype)).view(np.uint8)
    return from_gguf(raw, qtype, w.shape[0], w.shape[1])


def _quantize_q5k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K a multiple of 256) to GGUF Q5_K bytes [N, K / 256 * 176]: w ~ d sc q -
    dmin mn per 32-weight group, q in 0..31, 6-bit scales and mins, d and dmin float16."""
    n, k = w.shape
    nb = k // QK
    g = w.reshape(n, nb, 8, 32)
    lo = np.minimum(g.min(-1), 0.0)
    s = (g.max(-1) - lo) / 31.0
    d = (s.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.round(s / np.where(d > 0, d, 1)[..., None]).clip(0, 63)
    mn = np.round(-lo / np.where(dmin > 0, dmin, 1)[..., None]).clip(0, 63)
    step = d[..., None] * sc
    q = np.round((g + (dmin[..., None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.where(step[..., None] > 0, q, 0).clip(0, 31).astype(np.uint8)  # [n, nb, group, 32]
    blocks = np.empty((n, nb), Q4K_DTYPE)
    blocks["d"], blocks["dmin"], blocks["sc"], blocks["mn"] = d, dmin, sc.astype(np.uint8), mn.astype(np.uint8)
    head = to_gguf(Blocks(Q4K, blocks))[:, :].reshape(n, nb, 144)[..., :16]  # d, dmin and the packed scales
    out = np.empty((n, nb, 176), np.uint8)
    out[..., :16] = head
    out[..., 16:48] = sum(((q[:, :, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8)  # qh[l]: bit j of group j
    low = q & 0xF
    out[..., 48:] = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(n, nb, 128)
    return out.reshape(n, -1)


def _padded(weight: np.ndarray) -> np.ndarray:
    """[N, K] float32, C-contiguous, K zero-padded to whole blocks."""
    w = np.ascontiguousarray(weight, np.float32)
    return np.pad(w, ((0, 0), (0, -w.shape[1] % QK))) if w.shape[1] % QK else w


def quantize_reference(weight: np.ndarray, kind: int) -> Blocks:
    """`quantize` in numpy: the definition the native Q6_K quantizer is tested against."""
    w = _padded(weight)
    n, k = w.shape
    nb = k // QK
    if kind == Q6K:
        g = w.reshape(n, nb, 16, 16)
        s = np.abs(g).max(-1) / 31.0  # [n, nb, 16] per-group step
        d = s.max(-1) / 127.0  # [n, nb]
        sc = np.where(d[..., None] > 0, np.round(s / np.where(d > 0, d, 1)[..., None]), 0).clip(0, 127)
        step = d[..., None] * sc
        q = np.where(step[..., None] > 0, np.round(g / np.where(step > 0, step, 1)[..., None]), 0)
        q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, nb, 2, 4, 32)  # [half, group, l]
        out = np.empty((n, nb), Q6K_DTYPE)
        out["d"], out["sc"] = d, sc.astype(np.int8)
        lo, hi = q & 0xF, q >> 4
        out["ql"] = np.concatenate(
            [lo[:, :, :, 0] | (lo[:, :, :, 2] << 4), lo[:, :, :, 1] | (lo[:, :, :, 3] << 4)], -1
        ).reshape(n, nb, 128)
        out["qh"] = (hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)).reshape(
            n, nb, 64
        )
        return Blocks(Q6K, out)
    g = w.reshape(n, nb, 8, 32)
    lo = np.minimum(g.min(-1), 0.0)  # the format subtracts a non-negative min
    s = (g.max(-1) - lo) / 15.0
    d, dmin = s.max(-1) / 63.0, (-lo).max(-1) / 63.0
    sc = np.round(s / np.where(d > 0, d, 1)[..., None]).clip(0, 63)
    mn = np.round(-lo / np.where(dmin > 0, dmin, 1)[..., None]).clip(0, 63)
    step = d[..., None] * sc
    q = np.round((g + (dmin[..., None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.where(step[..., None] > 0, q, 0).clip(0, 15).astype(np.uint8).reshape(n, nb, 4, 2, 32)
    out = np.empty((n, nb), Q4K_DTYPE)
    out["d"], out["dmin"] = d, dmin
    out["sc"], out["mn"] = sc.astype(np.uint8), mn.astype(np.uint8)
    out["qs"] = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n, nb, 128)
    return Blocks(Q4K, out)


def tiles(blocks: Blocks, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """Repack [N, nb] blocks into the kernel's [ceil(N/16), nb] tiles: each 64-byte code vector
    holds 4 consecutive inputs of 16 outputs (see csrc/kquant.c). Padded outputs have zero scales.
    Runs in the native build `lib` where one is given (the same bytes as `tiles_reference`),
    else in numpy."""
    if blocks.kind in LOW_BITS or lib is None:  # (a draft packing is made once, from floats: numpy is fast enough)
        return tiles_reference(blocks)
    if blocks.kind in RAW:
        raw = np.ascontiguousarray(blocks.data)
        n, nblk = raw.shape[:2]
        out = np.empty((-(-n // TILE), -(-blocks.shape[1] // QK)), TILE_DTYPES[blocks.kind])
        if lib.specdec_tiles_raw(blocks.kind, raw.ctypes.data, n, nblk, out.ctypes.data, torch.get_num_threads()):
            raise ValueError(f"{KIND_NAMES[blocks.kind]}: the native library does not repack it")
        return out
    d = np.ascontiguousarray(blocks.data)
    n, nb = d.shape
    out = np.empty((-(-n // TILE), nb), TILE_DTYPES[blocks.kind])
    lib.specdec_tiles(blocks.kind, d.ctypes.data, n, nb, out.ctypes.data, torch.get_num_threads())
    return out


def tiles_reference(blocks: Blocks) -> np.ndarray:
    """`tiles` in numpy: the layout written out as array operations, and the definition the
    native repacking is tested against."""
    if blocks.kind in RAW:
        return _tiles_raw(blocks)
    d = blocks.data
    n, nb = d.shape
    pad = -n % TILE
    if pad:
        d = np.concatenate([d, np.zeros((pad, nb), d.dtype)])
    t = d.shape[0] // TILE

    def per_output(field: np.ndarray) -> np.ndarray:  # [N, nb, *rest] -> [T, nb, *rest, TILE]
        f = field.reshape(t, TILE, nb, *field.shape[2:])
        return np.moveaxis(f, 1, -1)

    out = np.zeros((t, nb), TILE_DTYPES[blocks.kind])
    out["d"] = per_output(d["d"])
    if blocks.kind in LOW_BITS:
        out["dmin"], out["sc"] = per_output(d["dmin"]), per_output(d["sc"])
        out["mn"] = np.swapaxes(per_output(d["mn"]).reshape(t, nb, 4, 2, TILE), -1, -2)
        q = d["q"].reshape(t, TILE, nb, 8, 2, 4, 4)  # [T, o, nb, group, w, i, e]: chunk 4w + i
        q = q.transpose(0, 2, 3, 4, 1, 6, 5)  # [T, nb, group, w, o, e, i]
        low = q & 3
        packed = (low[..., 0] | (low[..., 1] << 2) | (low[..., 2] << 4) | (low[..., 3] << 6)).reshape(
            t, nb, 8, 2, 4 * TILE
        )
        if blocks.kind == Q2:
            out["qs"] = packed
        else:
            out["g"]["qs"] = packed
            hb = (q >> 2).reshape(t, nb, 8, 2, 4 * TILE, 4)  # chunk 4w + i's third bit -> bit 4w + i
            out["g"]["qh"] = sum(
                (hb[:, :, :, w, :, i].astype(np.uint8) << (4 * w + i)) for w in range(2) for i in range(4)
            )
    elif blocks.kind == Q4K:
        out["dmin"] = per_output(d["dmin"])
        out["sc"] = per_output(d["sc"])  # [T, nb, group, output]
        out["mn"] = np.swapaxes(per_output(d["mn"]).reshape(t, nb, 4, 2, TILE), -1, -2)  # [.., pair, output, 2]
        q = _codes_q4k(d).reshape(t, TILE, nb, 8, 2, 4, 4)  # [T, o, nb, group, h, v, e]: chunk 4h + v
        q = q.transpose(0, 2, 3, 5, 1, 6, 4)  # [T, nb, group, v, o, e, h]
        out["qs"] = (q[..., 0] | (q[..., 1] << 4)).reshape(t, nb, 8, 4, 4 * TILE)
    else:
        out["sc"] = per_output(d["sc"])  # [T, nb, sub-block, output]
        q = _codes_q6k(d).reshape(t, TILE, nb, 16, 4, 4)  # [T, o, nb, sub-block, chunk, e]
        q = q.transpose(0, 2, 3, 4, 1, 5).reshape(t, nb, 16, 4, 4 * TILE)  # [T, nb, s, chunk, o*4 + e]
        lo, hi = q & 0xF, q >> 4
        out["sub"]["ql"] = np.stack(
            [lo[:, :, :, 0] | (lo[:, :, :, 1] << 4), lo[:, :, :, 2] | (lo[:, :, :, 3] << 4)], axis=3
        )
        out["sub"]["qh"] = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    return out


def _codes_raw(blocks: Blocks) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A raw kind's codes [N, blocks, per block] in weight order (unsigned; Q8_0's as the
    file's signed bytes) and its scales by name (float16 bits; Q5_K's as in `Q4K_DTYPE`)."""
    raw = blocks.data
    if blocks.kind == Q5K:
        n, nb = raw.shape[:2]
        k4 = from_gguf_q4_k(np.concatenate([raw[..., :16], raw[..., 48:]], -1), n, nb * QK).data
        q = _codes_q4k(k4).reshape(n, nb, 8, 32) | (((raw[..., 16:48, None] >> np.arange(8)) & 1).swapaxes(-1, -2) << 4)
        return q.reshape(n, nb, QK), {f: k4[f] for f in ("d", "dmin", "sc", "mn")}
    has_min = blocks.kind in (Q4_1, Q5_1)
    scales = {"d": raw[..., 0:2].copy().view("<u2")[..., 0]}
    if has_min:
        scales["m"] = raw[..., 2:4].copy().view("<u2")[..., 0]
    at = 4 if has_min else 2
    if blocks.kind == Q8_0:
        return raw[..., 2:34], scales
    qh = None
    if blocks.kind in (Q5_0, Q5_1):
        qh = raw[..., at : at + 4].copy().view("<u4")[..., 0]  # bit j: weight j's fifth bit
        at += 4
    qs = raw[..., at : at + 16]
    q = np.concatenate([qs & 0xF, qs >> 4], -1)  # weights 0..15 in the low nibbles, 16..31 in the high
    if qh is not None:
        q = q | ((((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8))
    return q, scales


def _tiles_raw(blocks: Blocks) -> np.ndarray:
    """`tiles` for the raw kinds (see csrc/kquant.c for each layout)."""
    kind, raw = blocks.kind, blocks.data
    n = raw.shape[0]
    t = -(-n // TILE)
    if kind in FLOATS:
        k = raw.shape[1]
        w = np.zeros((t * TILE, -(-k // QK) * QK, raw.shape[2]), np.uint8)
        w[:n, :k] = raw
        w = w.reshape(t, TILE, -1, QK, raw.shape[2]).transpose(0, 2, 3, 1, 4)  # [T, nb, 256 inputs, 16 outputs, B]
        w = np.ascontiguousarray(w)
        return w.reshape(t, w.shape[1], -1).view(TILE_DTYPES[kind])[..., 0]
    codes, scales = _codes_raw(blocks)  # [n, blocks, per block]
    per_block = 1 if kind == Q5K else 8  # file blocks per 256 inputs
    nb = -(-codes.shape[1] // per_block)

    def padded(a: np.ndarray) -> np.ndarray:  # [n, blocks, ...] -> [t * 16, nb * per_block, ...]
        out = np.zeros((t * TILE, nb * per_block, *a.shape[2:]), a.dtype)
        out[:n, : a.shape[1]] = a
        return out

    out = np.zeros((t, nb), TILE_DTYPES[kind])
    # codes -> [T, nb, group, chunk, output, e]: chunk c holds inputs 4c..4c+3 of the 32-input group
    c = padded(codes).reshape(t, TILE, nb, 8, 8, 4).transpose(0, 2, 3, 4, 1, 5).reshape(t, nb, 8, 8, 4 * TILE)
    if kind == Q8_0:
        out["g"]["qs"] = c
    else:
        out["g"]["qs"] = (c[:, :, :, :4] & 0xF) | ((c[:, :, :, 4:] & 0xF) << 4)
        if kind in (Q5K, Q5_0, Q5_1):
            out["g"]["qh"] = sum(((c[:, :, :, v] >> 4) & 1) << v for v in range(8)).astype(np.uint8)
    for name, v in scales.items():
        v = padded(v)  # [t*16, nb*per_block, ...]
        if kind == Q5K:
            f = np.moveaxis(v.reshape(t, TILE, nb, *v.shape[2:]), 1, -1)  # [T, nb, ..., output]
            out[name] = np.swapaxes(f.reshape(t, nb, 4, 2, TILE), -1, -2) if name == "mn" else f
        else:
            out[name] = v.reshape(t, TILE, nb, 8).transpose(0, 2, 3, 1)  # [T, nb, group, output]
    return out


def _leaves(dtype: np.dtype, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of a tile dtype's leaf fields (through nested structures)."""
    out = []
    for name in dtype.names or ():
        sub = dtype[name]
        base = sub.subdtype[0] if sub.subdtype else sub
        out += _leaves(base, (*path, name)) if base.names else [(*path, name)]
    return out


def gather_outputs(tiles: np.ndarray, kind: int, rows: np.ndarray) -> np.ndarray:
    """Tiles [T, nb] (or their bytes) -> the tiles of the layer whose outputs are `rows` of this
    one, in that order: the same bytes moved, nothing decoded (a cut vocabulary of an LM head, in
    any kind). In every tile layout a field's output index is its last axis of 16, the middle one
    of [..., 16, 2] (q4k's mins), or 4o + e in a 64-byte code vector."""
    dtype = TILE_DTYPES[kind]
    tl = np.ascontiguousarray(tiles).view(np.uint8).view(dtype).reshape(tiles.shape[0], -1)
    # only the tiles that hold `rows` are moved: a few of an LM head's thousands (moving the
    # whole head's fields was paid each time a sequence's vocabulary grew: docs/results.md)
    rows = np.asarray(rows)
    need = np.unique(rows // TILE)
    tl = tl[need]
    rows = np.searchsorted(need, rows // TILE) * TILE + rows % TILE
    t, nb = tl.shape
    n = len(rows)
    out = np.zeros((-(-n // TILE), nb), dtype)
    for path in _leaves(dtype):
        src, dst = tl, out
        for name in path:
            src, dst = src[name], dst[name]
        rest = src.shape[2:]
        if rest[-1] == 4 * TILE:
            src, axis = src.reshape(*src.shape[:-1], TILE, 4), -2
        elif rest[-1] == TILE:
            axis = -1
        elif rest[-2:] == (TILE, 2):
            axis = -2
        else:
            raise AssertionError(f"{path}: no output axis in a field of shape {rest}")
        per_out = np.moveaxis(src, axis % src.ndim, 1)  # [T, 16, nb, ...]
        flat = per_out.reshape(t * TILE, *per_out.shape[2:])[rows]
        flat = np.concatenate([flat, np.zeros((-n % TILE, *flat.shape[1:]), flat.dtype)])
        back = np.moveaxis(flat.reshape(-1, TILE, *flat.shape[1:]), 1, axis % src.ndim)
        dst[...] = back.reshape(dst.shape)
    return out


def untiles(tiles: np.ndarray, kind: int, n: int) -> Blocks:
    """The inverse of `tiles`: a [ceil(n/16), nb] tile array (or its bytes) back to the [n, nb]
    blocks it was made from (the padding outputs dropped)."""
    t_dtype = TILE_DTYPES[kind]
    tl = np.ascontiguousarray(tiles).view(np.uint8).view(t_dtype).reshape(-(-n // TILE), -1)
    t, nb = tl.shape

    def per_row(field: np.ndarray) -> np.ndarray:  # [T, nb, *rest, TILE] -> [N, nb, *rest]
        f = np.moveaxis(field, -1, 1)
        return f.reshape(t * TILE, nb, *f.shape[3:])[:n]

    out = np.empty((n, nb), BLOCK_DTYPES[kind])
    out["d"] = per_row(tl["d"])
    if kind == Q4K:
        out["dmin"] = per_row(tl["dmin"])
        out["sc"] = per_row(tl["sc"])
        out["mn"] = per_row(np.swapaxes(tl["mn"], -1, -2).reshape(t, nb, 8, TILE))
        x = tl["qs"].reshape(t, nb, 8, 4, TILE, 4)  # [T, nb, group, v, o, e], nibble h
        q = np.stack([x & 0xF, x >> 4], axis=-1).transpose(0, 4, 1, 2, 6, 3, 5)  # [T, o, nb, group, h, v, e]
        c = q.reshape(t * TILE, nb, 4, 2, 32)[:n]  # codes in weight order: element 64p + 32h + i
        out["qs"] = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(n, nb, 128)
    else:
        out["sc"] = per_row(tl["sc"])
        ql, qh = tl["sub"]["ql"], tl["sub"]["qh"]  # [T, nb, 16, 2, 64], [T, nb, 16, 64]
        lo = [ql[:, :, :, 0] & 0xF, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] & 0xF, ql[:, :, :, 1] >> 4]
        q = np.stack([lo[c] | (((qh >> (2 * c)) & 3) << 4) for c in range(4)], axis=3)  # [T, nb, s, chunk, o*4 + e]
        q = q.reshape(t, nb, 16, 4, TILE, 4).transpose(0, 4, 1, 2, 3, 5)  # [T, o, nb, s, chunk, e]
        c = q.reshape(t * TILE, nb, 2, 4, 32)[:n]  # [half, group, l]: see _codes_q6k
        lo4, hi4 = c & 0xF, c >> 4
        out["ql"] = np.concatenate(
            [lo4[:, :, :, 0] | (lo4[:, :, :, 2] << 4), lo4[:, :, :, 1] | (lo4[:, :, :, 3] << 4)], -1
        ).reshape(n, nb, 128)
        out["qh"] = (
            hi4[:, :, :, 0] | (hi4[:, :, :, 1] << 2) | (hi4[:, :, :, 2] << 4) | (hi4[:, :, :, 3] << 6)
        ).reshape(n, nb, 64)
    return Blocks(kind, out)


def to_gguf(blocks: Blocks) -> np.ndarray:
    """The inverse of `from_gguf_q4_k`/`from_gguf_q6_k`: the GGUF bytes [N, nb * 144 or 210]
    the blocks were read from (their d and dmin are float16 values, so the conversion back is exact)."""
    d = blocks.data
    n, nb = d.shape
    if blocks.kind == Q4K:
        b = np.empty((n, nb, 144), np.uint8)
        b[..., 0:2] = d["d"].astype(np.float16)[..., None].view(np.uint8)
        b[..., 2:4] = d["dmin"].astype(np.float16)[..., None].view(np.uint8)
        sc, mn = d["sc"], d["mn"]
        b[..., 4:8] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
        b[..., 8:12] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
        b[..., 12:16] = (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)
        b[..., 16:144] = d["qs"]
    else:
        b = np.empty((n, nb, 210), np.uint8)
        b[..., 0:128], b[..., 128:192] = d["ql"], d["qh"]
        b[..., 192:208] = d["sc"].view(np.uint8)
        b[..., 208:210] = d["d"].astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(n, -1)


def tile_format() -> str:
    """Names the packed tile layout (not the kernel code): packed files with the same format can
    be turned back into GGUF blocks by this module (`untiles`, `to_gguf`)."""
    desc = repr([(k, BLOCK_DTYPES[k].descr, TILE_DTYPES[k].descr) for k in (Q4K, Q6K)]) + f"{QK}:{TILE}"
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


# -- the linear kernel --------------------------------------------------------------------


class KQuantKernel:
    """y = x @ W^T (+ bias) over K-quant blocks; see the module docstring."""

    def __init__(
        self,
        kind: int,
        packed: torch.Tensor,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        *,
        lib: ctypes.CDLL,
    ) -> None:
        """`packed`: uint8 [ceil(N/16), nb * tile bytes], the output of `tiles`. `lib`: the
        build of the kernel to run (`native.library()`: this machine's)."""
        self.lib = lib
        self.kind, self.out_features, self.in_features = kind, out_features, in_features
        nb = -(-in_features // QK)
        if kind not in TILE_DTYPES:
            raise ValueError(f"{kind} is not a kind of weight blocks the kernel runs ({sorted(TILE_DTYPES)})")
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (
            -(-out_features // TILE),
            nb * TILE_DTYPES[kind].itemsize,
        ):
            raise ValueError(
                f"packed {KIND_NAMES[kind]} weights of shape {tuple(packed.shape)} do not fit a "
                f"{in_features}->{out_features} layer"
            )
        self.weight = packed.contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()  # [N]
        self._calls: dict[tuple[int, ...], _GroupCall] = {}  # see `group`

    @classmethod
    def from_blocks(
        cls, blocks: Blocks, bias: torch.Tensor | None, in_features: int | None = None, *, lib: ctypes.CDLL
    ) -> KQuantKernel:
        """`in_features`: the layer's input size when the blocks are zero-padded past it; `lib`:
        the build of the kernel to run (as in `KQuantKernel`)."""
        n, padded = blocks.shape
        k = padded if in_features is None else in_features
        if not padded - QK < k <= padded:
            raise ValueError(f"{padded // QK} blocks per row cannot hold {k} inputs")
        return cls(blocks.kind, torch.from_numpy(tiles(blocks, lib).view(np.uint8)), n, k, bias, lib=lib)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group((self,), x)[0]

    @staticmethod
    def group(kernels: tuple[KQuantKernel, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """Several layers over the same input (q/k/v, gate/up) in one call: the activations
        are quantized once and one parallel loop covers all the layers' tiles."""
        first = kernels[0]
        call = first._calls.get(tuple(map(id, kernels)))
        if call is None:
            call = first._calls[tuple(map(id, kernels))] = _GroupCall(kernels)
        return call(x)


class _GroupCall:
    """The ctypes arguments of one group of kernels, built once."""

    def __init__(self, kernels: tuple[KQuantKernel, ...]) -> None:
        k = kernels[0].in_features
        if any(kern.in_features != k for kern in kernels) or len(kernels) > 16:
            raise ValueError("grouped q4k layers must share their input size (and be at most 16)")
        n = len(kernels)
        self.kernels, self.in_features, self.lib = kernels, k, kernels[0].lib
        self.kinds = (ctypes.c_int * n)(*(kern.kind for kern in kernels))
        self.weights = (ctypes.c_void_p * n)(*(kern.weight.data_ptr() for kern in kernels))
        self.biases = (ctypes.c_void_p * n)(*(None if kern.bias is None else kern.bias.data_ptr() for kern in kernels))
        self.outs = (ctypes.c_int * n)(*(kern.out_features for kern in kernels))
        self.out_ptrs = ctypes.c_void_p * n

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        # (Called ~100 times per forward: kept to the few operations it needs.)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        m = x2.shape[0]
        ys = [torch.empty(*lead, kern.out_features) for kern in self.kernels]  # [.., N_i]
        if m == 0:
            return ys
        rc = self.lib.specdec_kquant_linears(
            len(ys),
            self.kinds,
            self.weights,
            self.biases,
            self.outs,
            self.in_features,
            x2.data_ptr(),
            m,
            self.out_ptrs(*(y.data_ptr() for y in ys)),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("the q4k kernel could not allocate its activation buffers")
        return ys if x.dtype == torch.float32 else [y.to(x.dtype) for y in ys]


def self_check(lib: ctypes.CDLL, reference: ctypes.CDLL) -> str | None:
    """Run `lib` and `reference` (two builds of the kernel) on random layers of every kind
    (the K-quants, the 32-weight types, float rows, the 3- and 2-bit draft packings) for 1..37
    rows (the AMX path takes whole sweeps of 16 rows and leaves the rest to the AVX-512 path:
    37 = 16 + 16 + 5); None when every output is bitwise equal, else what differed."""
    rng = np.random.default_rng(0)
    for kind in (Q4K, Q6K, *LOW_BITS, *RAW):
        n, k = 40, 768
        blocks = quantize(rng.standard_normal((n, k)).astype(np.float32), kind, lib=reference)
        packed = torch.from_numpy(tiles(blocks, lib=reference).view(np.uint8))
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        x = torch.from_numpy(rng.standard_normal((37, k)).astype(np.float32) * 3)
        outs = []
        for build in (lib, reference):
            kernel = KQuantKernel(kind, packed, n, k, bias, lib=build)
            outs.append(torch.cat([kernel(x[:m]) for m in (1, 2, 5, 16, 20, 37)]))
        if not torch.equal(outs[0], outs[1]):
            return f"{KIND_NAMES[kind]}, max difference {float((outs[0] - outs[1]).abs().max()):.3g}"
    return None


# -- weights from a GGUF file -------------------------------------------------------------


def matches(blocks: Blocks, weight: torch.Tensor, rows: int = 4) -> bool:
    """Whether the blocks stand for `weight` [N, K] (checked on a spread of rows): guards
    against a GGUF file that is not the one the weights were converted from."""
    n, k = weight.shape
    idx = np.unique(np.linspace(0, n - 1, rows).astype(np.int64))
    ref = weight[torch.from_numpy(idx)].float().numpy()
    got = dequantize(Blocks(blocks.kind, blocks.data[idx]))[:, :k]
    return got.shape == ref.shape and bool(np.allclose(got, ref, rtol=1e-6, atol=1e-7 * float(np.abs(ref).max())))
