"""Precision/kernel modes for the native model's linear layers.

A mode decides the weight storage and the kernel every `Linear` runs. Modes differ in speed
and in whether they are *batch-invariant*: whether the result for one row (one token) is
bitwise independent of how many other rows share the call. Speculative decoding scores k
drafted tokens in one pass; only a batch-invariant forward makes that pass compute exactly
what one-token plain decoding computes, and with it guarantees greedy identity.

| mode | weights | activations | batch-invariant |
|------|---------|-------------|-----------------|
| fp32 | fp32    | fp32 GEMM (BLAS picks kernels by shape) | no (last-bit differences) |
| bf16 | bf16    | bf16 GEMM  | no |
| fp16 | fp16    | fp16 GEMM (for CUDA) | no |
| int8 | int8, one scale per output channel | int8, one scale per row | yes: exact int32 accumulation |
| q4k  | GGUF Q4_K/Q6_K (4.75/6.6 bits) | int8, a scale per row and 256 inputs | yes: exact block sums, fixed order |

int8 is W8A8 with *per-row* activation scales: ``y = (x_q @ W_q^T) * s_x * s_w``. The integer
product is exact whatever the blocking, and every float operation after it is elementwise,
so a row's output depends on that row alone (tested bitwise for every row count we use).
(fbgemm's dynamic quantization uses one scale per tensor, which makes rows depend on each
other.) q4k keeps the GGUF file's own K-quant blocks and runs its own kernel
(`specdec.model.kquant`); it reads about half the bytes per token that int8 does.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .linear import Linear, LinearKernel


@dataclass(frozen=True)
class Mode:
    name: str
    storage: torch.dtype  # dtype of embeddings, norms, activations and the KV cache
    batch_invariant: bool
    description: str


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("fp32", torch.float32, False, "float32 weights and math"),
        Mode("bf16", torch.bfloat16, False, "bfloat16 weights and math"),
        Mode("fp16", torch.float16, False, "float16 weights and math (GPU)"),
        Mode("int8", torch.float32, True, "int8 weights and per-row int8 activations, exact int32 sums"),
        Mode("q4k", torch.float32, True, "GGUF Q4_K/Q6_K weight blocks, int8 activations, exact integer sums"),
    )
}


AUTO = "auto"
PACKED_SOURCE_KEY = "specdec.source"  # metadata of a q4k packed-weight file: the model directory
PACKED_BITS_KEY = "specdec.bits"  # ...and the packing asked for ("" = the GGUF's own blocks; "4": all Q4_K)
DRAFT_BITS = (4, 3, 2)  # the cheaper packings a model may be loaded with (`load_transformer(bits=)`)


def default_mode_name(device: torch.device) -> str:
    """The fastest mode that keeps greedy identity exact, where one exists for the device.

    On the CPU that is q4k when its kernel can be built here (AVX2 and a C compiler), else
    int8 (q4k reads about half the bytes per token; `specdec bench forward` measures both, and
    docs/results.md has the figures with the CPU they came from).
    The integer kernels are CPU-only for now, so CUDA gets bf16, which is fast there but not
    batch-invariant.
    """
    if device.type != "cpu":
        return "bf16"
    from . import native

    return "q4k" if native.available() else "int8"


def get_mode(name: str, device: torch.device | None = None) -> Mode:
    if name == AUTO:
        name = default_mode_name(device or torch.device("cpu"))
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; choose one of {AUTO}, {', '.join(MODES)}") from None


def _onednn_int8_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")


class Int8Kernel:
    """W8A8 linear: per-output-channel symmetric weights, per-row symmetric activations.

    With oneDNN (PyTorch's x86 CPU builds) the weight is prepacked once and the integer GEMM
    runs with unit scales, so it returns float(Σ u·w) of the exact int32 sum; activations go
    in as unsigned bytes (x_q + 128) because that is oneDNN's fast path (signed bytes fall to
    a path >100x slower), and the constant 128·Σ_k w_q[n, k] is removed through the GEMM's
    bias; on the Qwen 1.5B's shapes this was faster than `torch._int_mm` for several rows and
    the same for one. Without oneDNN, `torch._int_mm` computes the same exact sums.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.float()  # [N, K]
        n_out = w.shape[0]
        self.out_features = n_out
        self.w_scale = w.abs().amax(1).clamp_min(1e-12) / 127.0  # [N]
        wq = torch.round(w / self.w_scale[:, None]).to(torch.int8)  # [N, K]
        self.bias = None if bias is None else bias.float()  # [N]
        self.packed: torch.Tensor | None = None
        self.wq: torch.Tensor | None = None
        if _onednn_int8_available() and w.device.type == "cpu":
            self.packed = torch.ops.onednn.qlinear_prepack(wq, None)
            # Passed as the GEMM's bias so the offset is removed in the same pass.
            self.neg_offset = -(128 * wq.sum(1, dtype=torch.int64)).float()  # [N]
            self.unit_scale = torch.ones(n_out)
            self.zero_point = torch.zeros(n_out, dtype=torch.long)
        else:
            self.wq = wq  # stored [N, K], passed transposed: faster than a [K, N] copy

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float()  # [M, K]
        x_scale = x2.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127.0  # [M, 1]
        # x_q + 128 in one pass: x / s lies in [-127, 127], so adding 128.5 and truncating
        # rounds half up into [1, 255].
        xu = (x2 / x_scale).add_(128.5).to(torch.uint8)  # [M, K]
        if self.packed is not None:
            acc = torch.ops.onednn.qlinear_pointwise(
                xu,
                1.0,
                0,
                self.packed,
                self.unit_scale,
                self.zero_point,
                self.neg_offset,
                1.0,
                0,
                torch.float32,
                "none",
                [],
                "",
            )  # [M, N] = float(Σ u·w) - 128·Σw
        else:
            xq = (xu.to(torch.int16) - 128).to(torch.int8)
            acc = torch._int_mm(xq, self.wq.t()).float()  # [M, N], exact sums
        y = acc.mul_(x_scale).mul_(self.w_scale)  # elementwise: row-local
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*lead, self.out_features).to(x.dtype)


def apply_mode(
    model: torch.nn.Module,
    mode: Mode,
    *,
    gguf: Path | None = None,
    packed: Path | None = None,
    source: str = "",
    from_gguf: bool = False,
    bits: int | None = None,
    requantize: bool = False,
) -> None:
    """Install `mode`'s kernel in every `Linear` (weights are already in `mode.storage`).

    `gguf`: the file the weights were converted from, if any; the q4k mode then runs the
    file's own blocks (every type `kquant.KIND_OF_TYPE` names) instead of quantizing the float
    weights, and refuses a layer of another type unless `requantize`.
    `requantize`: layers the GGUF holds in other types than Q4_K/Q6_K run re-quantized to Q6_K
    (the user's choice at install: `--requantize`).
    `packed`: a file where the q4k mode keeps its repacked weights between loads, recording
    `source` (the model directory) so stale files can be found.
    `from_gguf`: the linear layers have no float weights loaded (they are still on the meta
    device); layers the GGUF holds in other types than Q4_K/Q6_K are de-quantized from it.
    `bits` (q4k): a cheaper packing for a model that drafts. 4 puts every linear layer in Q4_K
    blocks, re-quantizing those the GGUF holds in other types (Q6_K, Q5_0, Q8_0...); 3 and 2
    put the transformer layers in the kernel's 3- and 2-bit codes (`kquant.quantize_low`) and
    the LM head in Q4_K.
    """
    if mode.name not in ("int8", "q4k"):
        return
    device = model.device if hasattr(type(model), "device") else next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"the {mode.name} mode runs on the CPU only for now (model is on {device}); use bf16 or fp16")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    kernels = (
        _kquant_kernels(model, linears, gguf, packed, source, from_gguf, bits, requantize) if mode.name == "q4k" else {}
    )
    for name, module in linears.items():
        module.set_kernel(kernels.get(name) or Int8Kernel(module.weight, module.bias))
        if not _shares_storage(module, model):
            # The float weight is no longer read; keep memory at the quantized size.
            module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def _kquant_kernels(
    model: torch.nn.Module,
    linears: dict[str, Linear],
    gguf: Path | None,
    packed: Path | None,
    source: str,
    from_gguf: bool = False,
    bits: int | None = None,
    requantize: bool = False,
) -> dict[str, LinearKernel]:
    """q4k kernels: the GGUF's own blocks where it has them (checked against the float
    weights), in whatever type the file holds them; weights that come without a GGUF (a float
    directory) quantized here to `kquant.REQUANTIZE`. Repacking takes seconds to tens of
    seconds, so the result is kept in `packed` (one uint8 tensor per layer, its kind in the
    metadata) and later loads read it."""
    from . import kquant, native, packed_file
    from .families import gguf_linear
    from .gguf_file import gguf_blocks, linear_weight, unsupported_type
    from .gguf_reader import open_gguf, release_pages

    lib = native.library()  # fail early, with the reason, if the kernel cannot be built here

    def kernel(name: str, kind: int, tiles: torch.Tensor) -> LinearKernel:
        m = linears[name]
        return kquant.KQuantKernel(kind, tiles, m.out_features, m.in_features, m.bias, lib=lib)

    def from_file() -> dict[str, LinearKernel] | None:  # the packing on disk (see `packed_file`)
        tensors, kinds = packed_file.load(packed)
        if (
            set(tensors) == set(linears)
            and set(linears) <= set(kinds)
            and kinds.get(PACKED_BITS_KEY, "") == str(bits or "")
        ):
            return {name: kernel(name, int(kinds[name]), tensors[name]) for name in linears}
        return None

    if packed is not None and packed.exists() and (done := from_file()) is not None:
        return done
    args = model.args

    def pack(name: str) -> tuple[int, torch.Tensor]:
        m = linears[name]
        b = None
        if gguf is not None:  # this layer's blocks, read in the worker thread like the rest of its packing
            b = gguf_blocks(gguf, {name: m.out_features}, args).get(name)
        if b is not None and not from_gguf and not kquant.matches(b, m.weight):
            warnings.warn(f"{gguf}: {name} does not match the converted weights; quantizing it again", stacklevel=3)
            b = None
        if b is None and from_gguf and not requantize and bits is None:
            where = gguf_linear(name, args)
            t = next((t for t in open_gguf(gguf).tensors if where is not None and t.name == where.tensor), None)
            if t is not None and t.tensor_type not in kquant.KIND_OF_TYPE:
                raise unsupported_type(gguf, t.name, t.tensor_type)
        if requantize and b is not None and b.kind not in (kquant.Q4K, kquant.Q6K) and bits is None:
            b = kquant.quantize(kquant.dequantize(b)[:, : m.in_features], kquant.REQUANTIZE, lib)
        # 3 and 2 bits: the layers' codes narrower, the LM head kept at Q4_K (its rows are what
        # the draft's top choices are read from, and a cut vocabulary reads them as Q4_K tiles)
        want = kquant.Q4K if bits == 4 or (bits is not None and name == "lm_head") else bits
        if b is not None and want is not None and b.kind != want:
            weight = kquant.dequantize(b)[:, : m.in_features]
            b = None
        elif b is None:
            if from_gguf:
                weight = linear_weight(gguf, name, args)
            else:
                weight = m.weight.detach().float().numpy()
        if b is None:
            b = kquant.quantize(weight, want if want is not None else kquant.REQUANTIZE, lib)
        return b.kind, torch.from_numpy(kquant.tiles(b, lib).view(np.uint8))

    # numpy does the work and releases the GIL: one thread per core repacks layers side by side
    # (the results do not depend on the order).
    from concurrent.futures import ThreadPoolExecutor

    from . import sparse

    # A GGUF whose blocks were kept only in an older packing (see `sparse`) is made whole
    # first: that packing is deleted once this one exists (not for a cheaper packing made beside
    # it: that reads the blocks through `sparse` and leaves the GGUF's own packing in place). The
    # lock keeps another process from punching the file while its blocks are read.
    managed = gguf is not None and sparse.managed(gguf)
    with sparse.lock(gguf) if managed else contextlib.nullcontext():
        if managed and bits is None:
            sparse.restore(gguf)
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            layers = pool.map(pack, linears)
            if packed is None:
                built = {name: kernel(name, kind, t) for name, (kind, t) in zip(linears, layers, strict=True)}
                return built  # type: ignore[return-value]
            # Layer by layer into the file, then read from it: a model's tiles are never all in
            # memory at once, and the GGUF pages read for a layer leave this process with it.
            meta = {PACKED_SOURCE_KEY: source, PACKED_BITS_KEY: str(bits or "")}
            with packed_file.Writer(packed, list(linears), meta) as writer:
                for name, (kind, t) in zip(linears, layers, strict=True):
                    writer.add(name, t.numpy())
                    meta[name] = str(kind)  # (the header, written last, holds each layer's kind)
                    if gguf is not None:
                        release_pages(gguf)
    done = from_file()
    if done is None:
        raise RuntimeError(f"{packed}: the packed weights just written do not read back; please report this")
    return done


def _shares_storage(linear: Linear, model: torch.nn.Module) -> bool:
    """A tied LM head shares its weight with the embedding, which still needs it."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return isinstance(embed, torch.nn.Embedding) and linear.weight is embed.weight
