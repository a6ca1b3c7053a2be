"""A whole decoder layer in one native call (``csrc/layer.c``): the q4k mode's decoding path.

In the q4k mode a one-token pass is a few dozen matrix-kernel calls, and around each the
framework ran norms, rotary, residual adds, casts and slicing: over a thousand small
operations per pass, each with its own dispatch and thread start. Here each Llama/Qwen2/Qwen3-style
layer is one call that runs norm, projections, rotary, attention, residual and MLP in one parallel region of the native
library. Every step is per row, so results stay batch-invariant and equal across the kernel
builds; rows whose attention the framework runs (long prefill, mixed batches) go through the
same native steps before and after it (`specdec_layer_qkv`, `specdec_layer_out`), so a row's
bits do not depend on how its batch was made up.

Qwen3's per-head q/k norms and Gemma 3's (its norms of (1 + w), the norms after attention and
after the MLP, GELU's tanh form, sliding-window layers among full ones) run in the layer too. A
model uses one path for all its forwards.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .kquant import KQuantKernel
from .native import SegmentAttention

if TYPE_CHECKING:
    from .config import ModelArgs

_N = 7  # q, k, v, o, gate, up, down (csrc/layer.c's order)


class _LayerStruct(ctypes.Structure):
    """csrc/layer.c's specdec_layer_w."""

    _fields_ = [
        ("kind", ctypes.c_int * _N),
        ("w", ctypes.c_void_p * _N),
        ("bias", ctypes.c_void_p * _N),
        ("norm_attn", ctypes.c_void_p),
        ("norm_mlp", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("D", ctypes.c_int),
        ("H", ctypes.c_int),
        ("Hkv", ctypes.c_int),
        ("Dh", ctypes.c_int),
        ("I", ctypes.c_int),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("norm_attn_out", ctypes.c_void_p),
        ("norm_mlp_out", ctypes.c_void_p),
        ("act", ctypes.c_int),
        ("sliding", ctypes.c_int),
    ]


_ACTS = {"silu": 0, "gelu_tanh": 1}  # csrc/layer.c's ACT_*


def norm_weight(norm: nn.Module) -> torch.Tensor:
    """The weight the native norm multiplies by: Gemma's (1 + w), computed in float32 as its
    framework norm computes it, or w."""
    w = norm.weight
    return (1.0 + w.float()).contiguous() if norm.offset else w


def _kernels(block: nn.Module) -> list[object]:
    a, m = block.self_attn, block.mlp
    return [lin.kernel for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)]


def supported(block: nn.Module, args: ModelArgs) -> bool:
    """Whether csrc/layer.c computes this block: a pre-norm Llama/Qwen2/Qwen3/Gemma 3 layer (RMSNorm
    of w or 1 + w, sandwich norms or not, SiLU or GELU-tanh MLP, per-head q/k norms or none) over
    q4k kernels of one build, float32, sizes its vector code takes."""
    kernels = _kernels(block)
    return (
        all(isinstance(k, KQuantKernel) for k in kernels)
        and len({k.lib._name for k in kernels}) == 1  # type: ignore[union-attr]
        and args.activation in _ACTS
        and block.input_layernorm.weight.dtype == torch.float32
        and args.dim % 8 == 0
        and args.intermediate_size % 8 == 0
        and args.head_dim % 8 == 0
        and args.head_dim <= 512
    )


class NativeLayer:
    """Runs `block` (a supported one) through csrc/layer.c."""

    def __init__(self, block: nn.Module, args: ModelArgs) -> None:
        kernels: list[KQuantKernel] = _kernels(block)  # type: ignore[assignment]
        self.block, self.lib = block, kernels[0].lib
        self.H, self.Hkv, self.Dh, self.D = args.n_heads, args.n_kv_heads, args.head_dim, args.dim
        attn = block.self_attn
        # Llama/Qwen: input norm, then post_attention_layernorm before the MLP. Gemma 3: input norm,
        # post_attention_layernorm on the attention's output, pre_feedforward_layernorm before the
        # MLP, post_feedforward_layernorm on its output.
        sandwich = args.sandwich_norm
        norms = {
            "norm_attn": block.input_layernorm,
            "norm_mlp": block.pre_feedforward_layernorm if sandwich else block.post_attention_layernorm,
            "norm_attn_out": block.post_attention_layernorm if sandwich else None,
            "norm_mlp_out": block.post_feedforward_layernorm if sandwich else None,
            "q_norm": attn.q_norm if args.qk_norm else None,
            "k_norm": attn.k_norm if args.qk_norm else None,
        }
        weights = {field: norm_weight(n) for field, n in norms.items() if n is not None}
        self.struct = _LayerStruct(
            kind=(ctypes.c_int * _N)(*[k.kind for k in kernels]),
            w=(ctypes.c_void_p * _N)(*[k.weight.data_ptr() for k in kernels]),
            bias=(ctypes.c_void_p * _N)(*[None if k.bias is None else k.bias.data_ptr() for k in kernels]),
            eps=args.norm_eps,
            D=args.dim,
            H=args.n_heads,
            Hkv=args.n_kv_heads,
            Dh=args.head_dim,
            I=args.intermediate_size,
            act=_ACTS[args.activation],
            sliding=int(block.sliding),
            **{field: w.data_ptr() for field, w in weights.items()},  # (the others stay NULL)
        )
        self._ref = ctypes.byref(self.struct)
        # the tensors the struct points into, held so their memory lives as long as it does
        self._held = [
            *weights.values(),
            *(k.weight for k in kernels),
            *(k.bias for k in kernels if k.bias is not None),
        ]

    def __call__(
        self,
        x: torch.Tensor,  # [1, N, D] float32: the packed rows entering the layer
        rope: tuple[torch.Tensor, torch.Tensor],  # ([1, N, 1, Dh], [1, N, 1, Dh]) see transformer.Rotary.tables
        layer: int,
        native: SegmentAttention | None,  # every row's attention, when it all runs natively
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],  # else: q, k, v -> out
        scratch: Scratch,
    ) -> torch.Tensor:  # [1, N, D]
        x = x.contiguous()
        N = x.shape[1]
        cos, sin = (t.contiguous() for t in rope)
        out = torch.empty_like(x)
        threads = torch.get_num_threads()
        max_end = native.struct.max_end if native is not None else 0
        work = scratch.buffer(self.lib.specdec_layer_scratch(self._ref, N, max_end, threads))
        buf = work.data_ptr()
        if native is not None:
            rc = self.lib.specdec_layer(
                self._ref,
                x.data_ptr(),
                out.data_ptr(),
                N,
                cos.data_ptr(),
                sin.data_ptr(),
                ctypes.byref(native.struct),
                layer,
                buf,
                threads,
            )
        else:
            q = torch.empty(1, N, self.H, self.Dh)
            k, v = torch.empty(1, N, self.Hkv, self.Dh), torch.empty(1, N, self.Hkv, self.Dh)
            rc = self.lib.specdec_layer_qkv(
                self._ref,
                x.data_ptr(),
                N,
                cos.data_ptr(),
                sin.data_ptr(),
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                buf,
                threads,
            )
            if rc == 0:
                o = attend(q, k, v).contiguous()  # [1, N, H, Dh]
                rc = self.lib.specdec_layer_out(self._ref, x.data_ptr(), o.data_ptr(), out.data_ptr(), N, buf, threads)
        if rc != 0:
            raise RuntimeError(f"the native layer refused layer {layer} (code {rc}); please report this")
        return out


class NativeStack:
    """A model's native layers run several at a time (`specdec_layers`): for a forward in which
    every row's attention is native and nothing is read between layers, one call runs blocks
    lo..hi-1, the same steps as one `NativeLayer` call each, without a call and a thread start
    per layer: on a busy machine each parallel region's start waits for a descheduled thread,
    so many short ones cost far more than one long one. Layers of both attention kinds (Gemma 3's
    sliding-window layers among full ones) share a call: each uses its kind's attention and
    rotary tables."""

    def __init__(self, layers: list[NativeLayer]) -> None:
        self.layers, self.lib = layers, layers[0].lib
        self._ptrs = (ctypes.c_void_p * len(layers))(*[ctypes.addressof(n.struct) for n in layers])

    @staticmethod
    def build(layers: list[NativeLayer]) -> NativeStack | None:
        """None where the layers differ in shape or build (then each runs alone)."""
        shape = {(n.H, n.Hkv, n.Dh, n.D, n.struct.I, n.lib._name) for n in layers}
        return NativeStack(layers) if layers and len(shape) == 1 else None

    def __call__(
        self,
        x: torch.Tensor,  # [1, N, D] float32: the rows entering block lo
        ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]],  # per kind (sliding?), as NativeLayer's rope
        lo: int,
        hi: int,
        native: dict[bool, SegmentAttention],  # per kind (sliding?): every row's attention
        scratch: Scratch,
    ) -> torch.Tensor:  # [1, N, D] leaving block hi - 1
        x = x.contiguous()
        N = x.shape[1]
        tables = [tuple(t.contiguous() for t in ropes.get(kind, ropes[False])) for kind in (False, True)]
        attns = [native.get(kind, native.get(not kind)) for kind in (False, True)]
        cos = (ctypes.c_void_p * 2)(*[t[0].data_ptr() for t in tables])
        sin = (ctypes.c_void_p * 2)(*[t[1].data_ptr() for t in tables])
        att = (ctypes.c_void_p * 2)(*[ctypes.addressof(a.struct) for a in attns])  # type: ignore[union-attr]
        out = torch.empty_like(x)
        tmp = torch.empty_like(x) if hi - lo > 1 else out
        threads = torch.get_num_threads()
        first = self.layers[lo]
        max_end = max(a.struct.max_end for a in attns)  # type: ignore[union-attr]
        work = scratch.buffer(self.lib.specdec_layer_scratch(first._ref, N, max_end, threads))
        ptrs = ctypes.addressof(self._ptrs) + lo * ctypes.sizeof(ctypes.c_void_p)
        rc = self.lib.specdec_layers(
            ptrs,
            hi - lo,
            lo,
            x.data_ptr(),
            out.data_ptr(),
            tmp.data_ptr(),
            N,
            cos,
            sin,
            att,
            work.data_ptr(),
            threads,
        )
        if rc != 0:
            raise RuntimeError(f"the native layers refused blocks {lo}..{hi - 1} (code {rc}); please report this")
        return out


class Scratch:
    """The native layers' working memory, kept by the model between forwards and grown as
    needed: fresh memory each call would cost page faults each call. One buffer per thread:
    threads may run forwards of one model at once (a server's worker beside a caller of
    `generate`), and the native calls run without the GIL."""

    def __init__(self) -> None:
        self._per_thread = threading.local()

    KEEP = 64 << 20  # bytes: larger needs (a long prefill's rows) get memory for that call only

    def buffer(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes` of working memory for one call on this thread (keep the tensor
        alive until the call returns)."""
        if nbytes > self.KEEP:
            return torch.empty(nbytes, dtype=torch.uint8)
        buf: torch.Tensor | None = getattr(self._per_thread, "buf", None)
        if buf is None or buf.numel() < nbytes:
            size = min(self.KEEP, max(nbytes, 0 if buf is None else buf.numel() * 3 // 2))
            buf = self._per_thread.buf = torch.empty(size, dtype=torch.uint8)
        return buf
