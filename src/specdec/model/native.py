"""specdec's native CPU kernels (``csrc/*.c``): built once per machine, called through ctypes.

- ``kquant.c``: linear layers over K-quant weight blocks (the q4k mode, see `kquant`).
- ``attention.c``: attention for chains of up to 64 new tokens, row by row in one call (the
  batch-invariant modes' decoding and verification path, several sequences at once; see
  `SegmentAttention`).
- ``layer.c``: a whole Llama/Qwen2 decoder layer over the two above, in one parallel region
  (see `fused`).
- ``roofline.c``: the probes `specdec bench forward` sets the q4k passes against.
- ``specdec.h``: what they share.

The library is compiled at first use with the system C compiler (gcc, ~2 s) into the specdec
cache, in an AVX2 build, an AVX-512 VNNI build where the CPU has AVX512-BW/VL/VNNI, or an
AVX-512 + AMX build where it also has AMX tiles (`dispatch` picks and says why); all give
bitwise the same results. Where neither can be built (no compiler, no AVX2) the q4k mode is
unavailable and the other modes fall back to framework attention.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from . import kquant

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("kquant.c", "attention.c", "layer.c", "roofline.c")
# Query heads per key/value head the native attention handles (csrc/specdec.h,
# SPECDEC_ATTN_MAXREP); models with more attend through the framework.
ATTN_MAX_REP = 16
_BASE_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared"]
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-DSPECDEC_AVX512"]
_AMX_FLAGS = [*_AVX512_FLAGS, "-mamx-tile", "-mamx-int8", "-DSPECDEC_AMX"]
# Tests only: the AMX path's code with the tile instructions replaced by a scalar model of
# them (csrc/kquant.c, SPECDEC_AMX_EMULATE), so that path is checked on CPUs without AMX.
_AMX_EMULATED_FLAGS = [*_AVX512_FLAGS, "-DSPECDEC_AMX", "-DSPECDEC_AMX_EMULATE"]
AVX2, AVX512, AMX, AMX_EMULATED = "avx2", "avx512", "avx512-amx", "avx512-amx-emulated"
_VARIANT_FLAGS = {AVX2: [], AVX512: _AVX512_FLAGS, AMX: _AMX_FLAGS, AMX_EMULATED: _AMX_EMULATED_FLAGS}


class NativeUnavailableError(RuntimeError):
    """The native kernels cannot run here (CPU without AVX2, no C compiler...)."""


@cache
def cpu_info() -> dict[str, str]:
    """The first CPU's fields of /proc/cpuinfo ("model name", "vendor_id", "cpu family",
    "model", "flags", ...); empty where there is no such file. The one reader of it."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                if out:  # a blank line ends the first CPU's block
                    break
                continue
            out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


def _cpu_flags() -> set[str]:
    return set(cpu_info().get("flags", "").split())


_AVX512_NEEDS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def dispatch() -> tuple[str, str]:
    """The kernel build for this CPU and why (`decide`, on what this CPU reports and
    SPECDEC_KERNELS)."""
    return decide(_cpu_flags(), os.environ.get("SPECDEC_KERNELS", "").strip())


def decide(flags: set[str], forced: str = "", amx_unusable: Callable[[], str | None] | None = None) -> tuple[str, str]:
    """The kernel build for a CPU with these flags, and why: the one place that decides, AMX ->
    AVX-512 VNNI -> AVX2 (AMX only where `amx_unusable` finds nothing against it: the OS grants
    the tile state and the AMX path passes its bitwise self-check against the AVX-512 path);
    `forced`: a build named (SPECDEC_KERNELS), for a before/after comparison on one machine.
    Raises NativeUnavailableError where none can run."""
    amx_unusable = amx_unusable or _amx_unusable
    if forced:  # a before/after comparison on one machine (e.g. AVX-512 on an AMX CPU)
        return _forced(forced, flags, amx_unusable)
    missing = {"avx2", "fma", "f16c"} - flags
    if missing:
        raise NativeUnavailableError(
            f"specdec's CPU kernels need AVX2/FMA/F16C (missing: {', '.join(sorted(missing))}); "
            "use --dtype int8 or fp32"
        )
    if not _AVX512_NEEDS <= flags:
        lacking = ", ".join(sorted(_AVX512_NEEDS - flags))
        return AVX2, f"the CPU has AVX2/FMA/F16C but not {lacking}."
    if {"amx_tile", "amx_int8"} <= flags:
        why_not = amx_unusable()
        if why_not is None:
            return AMX, "the CPU has AMX (amx_tile, amx_int8) and AVX512-VNNI; the AMX path passed its self-check."
        return AVX512, f"the CPU has AVX512-F/BW/VL/VNNI and AMX, but AMX is not used: {why_not}."
    return AVX512, "the CPU has AVX512-F/BW/VL and AVX512-VNNI (no AMX)."


def _forced(name: str, flags: set[str], amx_unusable: Callable[[], str | None]) -> tuple[str, str]:
    """The build SPECDEC_KERNELS names, where this CPU can run it."""
    needs = {
        AVX2: {"avx2", "fma", "f16c"},
        AVX512: {"avx2", "fma", "f16c"} | _AVX512_NEEDS,
        AMX: {"avx2", "fma", "f16c", "amx_tile", "amx_int8"} | _AVX512_NEEDS,
    }
    if name not in needs:
        raise NativeUnavailableError(f"SPECDEC_KERNELS={name!r} is not a kernel build; use one of {', '.join(needs)}")
    lacking = needs[name] - flags
    if lacking:
        raise NativeUnavailableError(f"SPECDEC_KERNELS={name} needs {', '.join(sorted(lacking))}, which this CPU lacks")
    if name == AMX and (why_not := amx_unusable()) is not None:
        raise NativeUnavailableError(f"SPECDEC_KERNELS={name}: {why_not}")
    return name, f"forced by SPECDEC_KERNELS={name}."


@cache
def _amx_unusable() -> str | None:
    """Why the AMX build cannot serve here (None: it can): it must compile, the OS must grant
    the tile state, and its results must equal the AVX-512 path's bitwise."""
    try:
        lib = _library(AMX)
    except NativeUnavailableError as exc:
        return f"the AMX build failed ({str(exc).splitlines()[0]})"
    if lib.specdec_amx_enable(1) != 0:
        return "the OS refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    mismatch = kquant.self_check(lib, _library(AVX512))
    if mismatch:
        lib.specdec_amx_enable(0)
        return f"its self-check differed from the AVX-512 path ({mismatch}); please report this"
    return None


def best_variant() -> str:
    """The build for this CPU (see `dispatch`)."""
    return dispatch()[0]


def build_name() -> str:
    """The build `dispatch` picks, or "none" where no native kernels can run (for records
    that say which path produced a number)."""
    try:
        return dispatch()[0]
    except NativeUnavailableError:
        return "none"


def library(variant: str | None = None) -> ctypes.CDLL:
    """Compile (once per machine, variant and source version) and load the kernel library.
    Both variants compute bitwise the same results; AVX-512 is faster over several rows."""
    return _library(variant or best_variant())


def library_or_none() -> ctypes.CDLL | None:
    """`library()`, or None where no native kernels can run here (callers with a numpy path)."""
    try:
        return library()
    except NativeUnavailableError:
        return None


@cache
def available() -> bool:
    try:
        library()
    except NativeUnavailableError:
        return False
    return True


def build_id() -> str:
    """`build_name` plus the hash of the kernel sources, flags and compiler: what a timing of the
    native kernels depends on (a stored pass-time table is re-measured when the kernels change)."""
    try:
        variant = dispatch()[0]
        return f"{variant}-{_build(variant)[1].hexdigest()[:12]}"
    except NativeUnavailableError:
        return "none"


@cache
def _build(variant: str) -> tuple[list[str], Any]:
    """The compile command (without sources and output) and the hash of everything it reads."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise NativeUnavailableError(
            "specdec's CPU kernels are compiled at first use and need gcc; install it or use --dtype int8"
        )
    cmd = [cc, *_BASE_FLAGS, *_VARIANT_FLAGS[variant]]
    sources = [_CSRC / name for name in (*_SOURCES, "specdec.h")]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    return cmd, hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(cmd).encode() + version.encode())


@cache
def _library(variant: str) -> ctypes.CDLL:
    from ..paths import cache_root

    cmd, key = _build(variant)
    sources = [_CSRC / name for name in _SOURCES]
    out = cache_root() / "kernels" / key.hexdigest()[:16] / "libspecdec_cpu.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            proc = subprocess.run(
                [*cmd, "-o", str(tmp_out), *map(str, sources)], capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:
                raise NativeUnavailableError(
                    f"compiling specdec's CPU kernels failed ({' '.join(cmd)}):\n{proc.stderr.strip()[-2000:]}\n"
                    "use --dtype int8 or fp32 meanwhile"
                )
            os.replace(tmp_out, out)  # atomic: concurrent first uses never see half a file
    # torch already loaded its libgomp.so.1; the library links the same soname, so both share
    # one OpenMP runtime and thread pool.
    lib = ctypes.CDLL(str(out))
    c_int, c_ptr, c_float = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    lib.specdec_kquant_linears.argtypes = [c_int, c_ptr, c_ptr, c_ptr, c_ptr, c_int, c_ptr, c_int, c_ptr, c_int]
    lib.specdec_kquant_linears.restype = c_int
    lib.specdec_quantize_q6k.argtypes = [c_ptr, ctypes.c_int64, ctypes.c_int64, c_ptr, c_int]
    lib.specdec_quantize_q6k.restype = None
    lib.specdec_tiles.argtypes = [c_int, c_ptr, ctypes.c_int64, ctypes.c_int64, c_ptr, c_int]
    lib.specdec_tiles.restype = None
    lib.specdec_tiles_raw.argtypes = [c_int, c_ptr, ctypes.c_int64, ctypes.c_int64, c_ptr, c_int]
    lib.specdec_tiles_raw.restype = c_int
    lib.specdec_dequantize_legacy.argtypes = [c_int, c_ptr, ctypes.c_int64, c_ptr, c_int]
    lib.specdec_dequantize_legacy.restype = c_int
    lib.specdec_tile_bytes.argtypes = [c_int]
    lib.specdec_tile_bytes.restype = c_int
    lib.specdec_tile_outputs.restype = c_int
    lib.specdec_amx_enable.argtypes = [c_int]
    lib.specdec_amx_enable.restype = c_int
    lib.specdec_attend.argtypes = [c_ptr, c_int, c_ptr, c_ptr, c_ptr, c_int, c_int, c_int, c_int, c_ptr, c_int]
    lib.specdec_attend.restype = c_int
    lib.specdec_layer.argtypes = [c_ptr, c_ptr, c_ptr, c_int, c_ptr, c_ptr, c_ptr, c_int, c_ptr, c_int]
    lib.specdec_layer.restype = c_int
    # (cos, sin and the attention: two pointers each, full and sliding-window)
    lib.specdec_layers.argtypes = [c_ptr, c_int, c_int, c_ptr, c_ptr, c_ptr, c_int, c_ptr, c_ptr, c_ptr, c_ptr, c_int]
    lib.specdec_layers.restype = c_int
    lib.specdec_rmsnorm_rows.argtypes = [c_ptr, c_ptr, c_int, c_int, c_float, c_ptr]
    lib.specdec_rmsnorm_rows.restype = None
    lib.specdec_layer_qkv.argtypes = [c_ptr, c_ptr, c_int, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_int]
    lib.specdec_layer_qkv.restype = c_int
    lib.specdec_layer_out.argtypes = [c_ptr, c_ptr, c_ptr, c_ptr, c_int, c_ptr, c_int]
    lib.specdec_layer_out.restype = c_int
    lib.specdec_layer_scratch.argtypes = [c_ptr, c_int, c_int, c_int]
    lib.specdec_layer_scratch.restype = ctypes.c_int64
    lib.specdec_stream_read.argtypes = [c_ptr, ctypes.c_int64, c_int]
    lib.specdec_stream_read.restype = ctypes.c_int64
    lib.specdec_dot_rate.argtypes = [ctypes.c_int64, c_int, c_int]
    lib.specdec_dot_rate.restype = ctypes.c_int64
    if lib.specdec_tile_outputs() != kquant.TILE or any(
        lib.specdec_tile_bytes(k) != dt.itemsize for k, dt in kquant.TILE_DTYPES.items()
    ):
        raise NativeUnavailableError("the compiled q4k kernel's tile layout does not match specdec's")
    return lib


class AttnStruct(ctypes.Structure):
    """csrc/specdec.h's specdec_attn: a forward's packed rows and their caches."""

    _fields_ = [
        ("seg", ctypes.POINTER(ctypes.c_int)),
        ("t", ctypes.POINTER(ctypes.c_int)),
        ("start", ctypes.POINTER(ctypes.c_int)),
        ("T", ctypes.POINTER(ctypes.c_int)),
        ("cap", ctypes.POINTER(ctypes.c_int)),
        ("k", ctypes.POINTER(ctypes.c_void_p)),
        ("v", ctypes.POINTER(ctypes.c_void_p)),
        ("stride", ctypes.POINTER(ctypes.c_int64)),
        ("mask", ctypes.POINTER(ctypes.c_void_p)),
        ("scale", ctypes.c_float),
        ("max_end", ctypes.c_int),
    ]


class SegmentAttention:
    """One forward's row-by-row attention over several sequences (a packed batch), prepared once
    and called once per layer: segment s has T[s] new rows starting at slot start[s] of its
    own cache and an optional mask [T[s], start[s] + T[s]] (nonzero = may attend; None: every
    earlier key). Each row is computed exactly as one-token decoding at its position computes
    it (see csrc/attention.c), whatever else shares the call. `struct` is what the native
    layer (csrc/layer.c) takes to run this attention inside its own call."""

    def __init__(
        self,
        caches: list[tuple[torch.Tensor, torch.Tensor]],  # per segment: K, V buffers [L, 1, H_kv, S_cap, D] float32
        starts: list[int],
        lengths: list[int],
        masks: list[torch.Tensor | None],  # per segment [T, start+T] bool/uint8, or None
        scale: float,
    ) -> None:
        for k, v in caches:
            if k.dtype != torch.float32 or not (k.is_contiguous() and v.is_contiguous()) or k.shape[-1] % 8:
                raise ValueError(
                    "native attention needs contiguous float32 caches and a head size that is a multiple of 8"
                )
        # plain ctypes arrays: built once per forward, a few microseconds (this runs every step)
        c_int, c_ptr = ctypes.c_int, ctypes.c_void_p
        n = len(lengths)
        self.n_rows = sum(lengths)
        self.n_kv_heads = caches[0][0].shape[2]
        self.masks = [None if m is None else m.to(torch.uint8).contiguous() for m in masks]  # kept alive
        self._arrays = (
            (c_int * self.n_rows)(*[s for s, T in enumerate(lengths) for _ in range(T)]),
            (c_int * self.n_rows)(*[t for T in lengths for t in range(T)]),
            (c_int * n)(*starts),
            (c_int * n)(*lengths),
            (c_int * n)(*[k.shape[3] for k, _ in caches]),
            (c_ptr * n)(*[k.data_ptr() for k, _ in caches]),
            (c_ptr * n)(*[v.data_ptr() for _, v in caches]),
            (ctypes.c_int64 * n)(*[k.stride(0) for k, _ in caches]),
            (c_ptr * n)(*[None if m is None else m.data_ptr() for m in self.masks]),
        )
        max_end = max(s + T for s, T in zip(starts, lengths, strict=True))
        self.struct = AttnStruct(
            *[ctypes.cast(a, ctypes.POINTER(a._type_)) for a in self._arrays], float(scale), max_end
        )

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [N, H, D] float32 rotated queries, rows packed segment after segment
        k_new: torch.Tensor | None,  # [N, H_kv, D] the new rows' keys (rotated), written to their slots first
        v_new: torch.Tensor | None,  # [N, H_kv, D]; None (both): the caches hold them already
    ) -> torch.Tensor:  # [N, H, D]
        N, H, D = q.shape
        if H % self.n_kv_heads or H // self.n_kv_heads > ATTN_MAX_REP:
            raise ValueError(
                f"native attention takes 1..{ATTN_MAX_REP} query heads per key/value head, not {H}/{self.n_kv_heads}"
            )
        q = q.contiguous()
        if k_new is not None and v_new is not None:
            k_new, v_new = k_new.contiguous(), v_new.contiguous()
        out = torch.empty_like(q)
        kv = (k_new.data_ptr(), v_new.data_ptr()) if k_new is not None and v_new is not None else (None, None)
        rc = library().specdec_attend(
            ctypes.byref(self.struct),
            layer,
            q.data_ptr(),
            *kv,
            N,
            H,
            self.n_kv_heads,
            D,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("native attention could not allocate its score buffers")
        return out


def attend_rows(
    q: torch.Tensor,  # [B, T, H, D] float32, rotated
    k_cache: torch.Tensor,  # [B, H_kv, S_cap, D] float32 (new keys already written)
    v_cache: torch.Tensor,
    start: int,  # slot of the first new token
    mask: torch.Tensor | None,  # [B, T, start+T] bool or uint8 (nonzero = may attend), or None: all earlier keys
    scale: float | None,  # None: 1/sqrt(D), as in scaled_dot_product_attention
) -> torch.Tensor:  # [B, T, H, D]
    """Causal attention of T new tokens over a batch of caches that share one length: each
    batch element is a segment of `SegmentAttention`."""
    B, T, H, D = q.shape
    caches = [(k_cache[b : b + 1, None].contiguous(), v_cache[b : b + 1, None].contiguous()) for b in range(B)]
    masks = [None if mask is None else mask[b] for b in range(B)]
    attend = SegmentAttention(caches, [start] * B, [T] * B, masks, D**-0.5 if scale is None else scale)
    out = attend(0, q.reshape(B * T, H, D).float(), None, None)
    return out.view(B, T, H, D)
