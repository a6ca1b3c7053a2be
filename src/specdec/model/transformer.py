"""A compact native decoder for the families of `families` (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 3 text), driven by `ModelArgs`.

Module names follow the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj`` ...)
so safetensors load without a name map. One forward call scores any number of new tokens
at given positions against the KV cache, with an optional mask among the new tokens (token
trees), and returns logits for every new position plus, on request, hidden states.

`forward_batch` does that for several sequences in one pass (a packed batch): each sequence
(`Segment`) brings its own rows, cache, positions and mask; their rows are stacked so every
linear layer runs once over all of them, and each row attends only to its own sequence's
cache. In the batch-invariant modes a row's result does not depend on the other rows of the
call, so a sequence decodes bitwise the same alone or in any batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import fused, native
from .cache import ContextOverflowError, KVCache
from .config import ModelArgs
from .kernels import MODES
from .linear import Linear, linear_group

# Longer runs of new tokens (prompt prefill) attend in one batched framework call where the
# native kernel is not available: its rows are not bitwise what one-token decoding computes,
# which plain and speculative decoding share anyway (both prefill the same way). The native
# kernel attends row by row at any length (and is faster than the framework call at prefill),
# so there every row of every pass is bitwise the same however it is computed, which lets a
# later request reuse the cached rows of an earlier one (`Engine`'s prefix reuse).
ROW_ATTENTION_MAX = 64


@dataclass
class Segment:
    """One sequence's new rows in a forward (`Transformer.forward_batch`)."""

    tokens: torch.Tensor  # [T] new token ids
    cache: KVCache  # this sequence's own cache; the rows go to its next free slots
    positions: torch.Tensor | None = None  # [T]; default: cache.length + arange(T)
    # [T, S] bool (S >= T): which of the last S keys each new row sees — the T new rows and the
    # S - T cached just before them (a draft model growing a token tree over several passes);
    # earlier keys are all seen. [T, T]: among the new rows (token trees, extra rows)
    tree_mask: torch.Tensor | None = None
    hidden_in: torch.Tensor | None = None  # [T, D] residual entering block `lo`; required exactly when lo > 0
    lo: int = 0  # first block to run (self-speculation already ran blocks [0, lo) for these rows)
    last_only: bool = False  # logits (and hidden/residual) for the last row only (prefill)


@dataclass
class _SegmentPlan:
    """How one segment attends in this forward."""

    seg: Segment
    start: int  # slot of its first new row
    T: int
    positions: torch.Tensor  # [1, T]
    masks: dict[bool, torch.Tensor | None]  # per layer kind (sliding?): [1, 1, T, start+T] bool, None = all keys
    native: dict[bool, torch.Tensor | None] | None = None  # row by row in the native kernel: per-kind [T, end] masks
    rows: dict[bool, list[torch.Tensor | None]] | None = None  # row by row through the framework: per-row masks

    @property
    def end(self) -> int:
        return self.start + self.T


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, T, V] float32 ([B, 1, V] with last_only)
    hidden: torch.Tensor | None = None  # [B, T, D] final-normed hidden (the LM head's input)
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # residual after layer i, [B, T, D]
    residual: torch.Tensor | None = None  # [B, T, D] residual after the last block run (before the final norm)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.native = None  # the native library, where the model's layers run in it (see set_native_layers)
        self.native_weight: torch.Tensor | None = None  # what the native norm multiplies by (fused.norm_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the storage dtype, as the reference implementations do.
        if self.native is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            # the native layers' own norm (csrc/layer.c), on this thread: the same bits for a
            # row however many rows come with it
            x = x.contiguous()
            out = torch.empty_like(x)
            w = self.native_weight
            self.native.specdec_rmsnorm_rows(
                x.data_ptr(), w.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], self.eps, out.data_ptr()
            )
            return out
        if x.dtype == torch.float32 and not self.offset:
            # torch's rms_norm runs these same operations (bitwise equal, tested against
            # transformers) with less per-call overhead
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: (x * (1 + w)) computed in float32, then cast
            return (h * (1.0 + self.weight.float())).type_as(x)
        return self.weight * h.to(x.dtype)  # Llama/Qwen: cast, then scale


class Rotary:
    """Rotate-half RoPE tables, indexed by position id."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_pos: int,
        device: torch.device,
        llama3: tuple[float, float, float, float] | None = None,
    ) -> None:
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        inv_freq = 1.0 / (theta**exponent)  # [D/2]
        if llama3 is not None:
            inv_freq = _llama3_frequencies(inv_freq, *llama3)
        angles = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]  # [P, D/2]
        self.cos, self.sin = angles.cos(), angles.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) laid out for `rotate`, looked up once per forward. positions: [B, T]."""
        cos = self.cos[positions].unsqueeze(2).to(dtype)  # [B, T, 1, D/2]
        sin = self.sin[positions].unsqueeze(2).to(dtype)
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)  # [B, T, 1, D]


def _llama3_frequencies(inv_freq: torch.Tensor, factor: float, low: float, high: float, context: float) -> torch.Tensor:
    """Llama 3's rotary scaling: long wavelengths slowed by `factor`, short ones kept, the band
    between interpolated (the same operations as transformers', so the same bits)."""
    low_wavelen, high_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE: (x1 cos - x2 sin, x2 cos + x1 sin), computed as x*cos + (x2, x1)*(-sin, sin),
    which is the same floating-point result in fewer operations. x: [B, T, H, D]."""
    cos, sin = tables
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), -1) * sin


class Attention(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.a = a
        self.q_proj = Linear(a.dim, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = Linear(a.n_heads * a.head_dim, a.dim, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.norm_eps, a.norm_offset)
            self.k_norm = RMSNorm(a.head_dim, a.norm_eps, a.norm_offset)

    def forward(
        self,
        x: torch.Tensor,  # [1, N, D] the packed rows of every segment
        rope: tuple[torch.Tensor, torch.Tensor],  # this layer kind's (cos, sin) tables, see Rotary.tables
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],  # see _PackedAttention
    ) -> torch.Tensor:
        a = self.a
        _, N, _ = x.shape
        q, k, v = linear_group((self.q_proj, self.k_proj, self.v_proj), x)
        q = q.view(1, N, a.n_heads, a.head_dim)  # [1, N, H, Dh]
        k = k.view(1, N, a.n_kv_heads, a.head_dim)  # [1, N, Hkv, Dh]
        v = v.view(1, N, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, rope), rotate(k, rope)
        out = attend(q, k, v)  # [1, N, H, Dh]; writes k, v to each segment's cache
        return self.o_proj(out.reshape(1, N, a.n_heads * a.head_dim))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = Linear(a.dim, a.intermediate_size)
        self.up_proj = Linear(a.dim, a.intermediate_size)
        self.down_proj = Linear(a.intermediate_size, a.dim)
        self.gelu = a.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = linear_group((self.gate_proj, self.up_proj), x)
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down_proj(g * u)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.sandwich = a.sandwich_norm
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.dim, a.norm_eps, a.norm_offset)
        # Llama/Qwen name their pre-MLP norm `post_attention_layernorm`; Gemma 3 has four norms.
        self.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps, a.norm_offset)
        if a.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(a.dim, a.norm_eps, a.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(a.dim, a.norm_eps, a.norm_offset)
        self.native: fused.NativeLayer | None = None  # the whole layer in one native call (q4k; see `fused`)

    def forward(self, x, rope, attend) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, attend)
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.dim)
        self.embed_tokens.weight.requires_grad_(False)
        sliding = a.layer_sliding or (False,) * a.n_layers
        self.layers = nn.ModuleList(Block(a, sliding[i]) for i in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps, a.norm_offset)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Decoder(args)
        self.lm_head = Linear(args.dim, args.vocab_size)
        self._rotary: dict[bool, Rotary] = {}
        self._scratch = fused.Scratch()  # the native layers' working memory (see `fused`)
        self._native_stack: fused.NativeStack | None = None  # every block in native calls, several at a time
        self.mode = "fp32"  # precision/kernel mode, set by the loader (see kernels.MODES)
        self.bits: int | None = None  # q4k: a cheaper packing than the file's (see load_transformer), set by the loader
        self.source_dir: Path | None = None  # the model directory it was loaded from (set by the loader)

    # -- set-up ---------------------------------------------------------------------------
    def finalize(self) -> Transformer:
        """Tie embeddings and build RoPE tables; call after weights are loaded/moved."""
        if self.args.tie_embeddings and isinstance(self.model.embed_tokens, nn.Embedding):
            self.lm_head.weight = self.model.embed_tokens.weight
        dev = self.device
        a = self.args
        self._rotary = {False: Rotary(a.head_dim, a.rope_theta, a.max_seq_len, dev, a.rope_llama3)}
        if a.rope_theta_local is not None:
            self._rotary[True] = Rotary(a.head_dim, a.rope_theta_local, a.max_seq_len, dev)
        return self

    def set_native_layers(self, on: bool) -> bool:
        """Run every block through the native layer (`fused`), where all of them can; returns
        whether they now do. All or none: a model's forwards must all take one path, or its
        rows would not be bitwise the same in every pass."""
        blocks = list(self.model.layers)
        on = on and self._native_attention and all(fused.supported(b, self.args) for b in blocks)
        for b in blocks:
            b.native = fused.NativeLayer(b, self.args) if on else None
        # the final norm in the same library
        norm = self.model.norm
        norm.native = blocks[0].native.lib if on and blocks else None  # type: ignore[union-attr]
        norm.native_weight = fused.norm_weight(norm) if on else None
        # several layers per call, each with its own kind of attention (Gemma 3 mixes sliding-window
        # and full layers) and its rotary table
        self._native_stack = fused.NativeStack.build([b.native for b in blocks]) if on else None  # type: ignore[misc]
        return on

    @property
    def row_invariant_attention(self) -> bool:
        """In batch-invariant modes short chains of new tokens attend row by row, so a k-token
        verification pass computes bitwise what one-token decoding computes."""
        return MODES[self.mode].batch_invariant

    @property
    def rows_bitwise(self) -> bool:
        """Every row of every pass (prefill chunk, verification, one-token step) computes bitwise
        what one-token decoding computes: a cached row can stand in for any other computation
        of it."""
        return self._native_attention

    @property
    def _native_attention(self) -> bool:
        """Row-by-row attention runs in specdec's native kernel where it can (CPU, float32)."""
        return (
            self.row_invariant_attention
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and self.args.head_dim % 8 == 0
            and self.args.n_heads // self.args.n_kv_heads <= native.ATTN_MAX_REP
            and native.available()
        )

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device  # (the embedding may be read from a GGUF file)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        a = self.args
        return KVCache(a.n_layers, batch, a.n_kv_heads, capacity, a.head_dim, dtype=self.dtype, device=self.device)

    # -- forward --------------------------------------------------------------------------
    def _masks(
        self, cache: KVCache, positions: torch.Tensor, start: int, tree_mask: torch.Tensor | None
    ) -> dict[bool, torch.Tensor | None]:
        """Attention masks [1, 1, T, start+T] (True = attend), one per layer kind."""
        T = positions.shape[1]
        end = start + T
        window = self.args.sliding_window
        need_sliding = window is not None and True in self.args.layer_sliding
        if tree_mask is None and T == 1:
            # One new token sees the whole cache: no mask on full-attention layers.
            masks: dict[bool, torch.Tensor | None] = {False: None}
            if need_sliding:
                masks[True] = self._window(cache, positions, end).unsqueeze(1)
            return masks
        dev = positions.device
        full = torch.ones(1, T, end, dtype=torch.bool, device=dev)
        if tree_mask is None:
            full[:, :, start:] = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        else:
            full[:, :, end - tree_mask.shape[1] :] = tree_mask
        masks = {False: full.unsqueeze(1)}
        if need_sliding:
            masks[True] = (full & self._window(cache, positions, end)).unsqueeze(1)
        return masks

    def _window(self, cache: KVCache, positions: torch.Tensor, end: int) -> torch.Tensor:
        """[1, T, end] True where a key lies inside the query's sliding window."""
        assert self.args.sliding_window is not None
        return cache.pos[:, None, :end] > positions[:, :, None] - self.args.sliding_window

    def _plan(self, seg: Segment, hi: int) -> _SegmentPlan:
        """Check a segment, reserve its cache slots and decide how its rows attend: row by row
        (batch-invariant modes: any number of rows in the native kernel, else chains and trees
        of up to ROW_ATTENTION_MAX rows; exactly what one-token decoding at each position
        computes), else one framework call."""
        a = self.args
        if seg.tokens.dim() != 1:
            raise ValueError(f"a segment's tokens must be 1-D [T], got shape {tuple(seg.tokens.shape)}")
        T = seg.tokens.shape[0]
        if not 0 <= seg.lo < hi <= a.n_layers:
            raise ValueError(f"blocks must satisfy 0 <= lo < hi <= {a.n_layers} (got {(seg.lo, hi)})")
        if (seg.lo > 0) != (seg.hidden_in is not None):
            raise ValueError(
                "hidden_in (the residual entering block lo) is required exactly when blocks starts above 0"
            )
        if seg.hidden_in is not None and seg.hidden_in.shape != (T, a.dim):
            raise ValueError(f"hidden_in has shape {tuple(seg.hidden_in.shape)}, expected {(T, a.dim)}")
        tree = seg.tree_mask
        if tree is not None and (
            tree.dim() != 2 or tree.shape[0] != T or not T <= tree.shape[1] <= seg.cache.length + T
        ):
            raise ValueError(
                f"tree_mask must be [T, S] with T = {T} new rows and T <= S <= the cached rows + T, got "
                f"{tuple(tree.shape)}"
            )
        if tree is not None and torch.triu(tree[:, tree.shape[1] - T :], 1).any():
            raise ValueError("tree_mask must list tokens in topological order: a token may attend only to earlier ones")
        start = seg.cache.reserve(T)
        if seg.positions is None:
            last = start + T - 1
            positions = torch.arange(start, start + T, device=seg.cache.pos.device).reshape(1, T)
        else:
            positions = seg.positions.reshape(1, T)
            last = int(positions.max())
        if last >= a.max_seq_len:
            raise ContextOverflowError(f"position {last} is beyond the model's context of {a.max_seq_len}")
        seg.cache.pos[:, start : start + T] = positions
        plan = _SegmentPlan(seg, start, T, positions, self._masks(seg.cache, positions, start, tree))
        if not self.row_invariant_attention or (T > ROW_ATTENTION_MAX and not self._native_attention):
            return plan  # one framework call (prefill, or modes that are not batch-invariant anyway)
        if self._native_attention:
            # the kernel already limits row i to keys 0..start+i; only windows and trees need a mask
            plan.native = {
                kind: None if m is None or (not kind and tree is None) else m[0, 0] for kind, m in plan.masks.items()
            }
        elif tree is None and T > 1:
            # one framework call per row, with the key range and mask of a one-token step
            plan.rows = {
                kind: [None if m is None else m[:, :, i : i + 1, : start + i + 1] for i in range(T)]
                for kind, m in plan.masks.items()
            }
        return plan

    @torch.inference_mode()
    def forward_batch(
        self,
        segments: list[Segment],
        *,
        hi: int | None = None,  # run blocks up to hi (exclusive); default all
        head: bool = True,  # False: no final norm / LM head (logits are empty [1, T, 0] tensors)
        return_hidden: bool = False,
        output_layers: tuple[int, ...] = (),
    ) -> list[ForwardOutput]:
        """Score several sequences' new rows in one pass; one `ForwardOutput` per segment
        (batch dimension 1). Each segment's rows go to the next free slots of its own cache,
        whose length grows by T (also for a partial run of the blocks: a drafter that drafts
        from early blocks truncates it back)."""
        if not segments:
            return []
        a = self.args
        hi = a.n_layers if hi is None else hi
        plans = [self._plan(seg, hi) for seg in segments]
        order: list[int] = []  # segments in packed row order
        x: torch.Tensor | None = None  # [1, N, D]
        layers: dict[int, torch.Tensor] = {}
        attend: _PackedAttention | None = None
        ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(min(seg.lo for seg in segments), hi):
            joining = [n for n, seg in enumerate(segments) if seg.lo == i]
            if joining:  # rows whose earlier blocks ran elsewhere join the packed stream here
                parts = [] if x is None else [x]
                if i == 0:
                    ids = torch.cat([segments[n].tokens for n in joining])[None]  # [1, N0]
                    h = self.model.embed_tokens(ids)
                    if a.embed_scale != 1.0:
                        h = h * torch.tensor(a.embed_scale, dtype=h.dtype)
                    parts.append(h)
                else:
                    parts += [segments[n].hidden_in[None] for n in joining]  # type: ignore[index]
                x = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                order += joining
                active = [plans[n] for n in order]
                positions = torch.cat([p.positions for p in active], dim=1)  # [1, N]
                ropes = {kind: r.tables(positions, x.dtype) for kind, r in self._rotary.items()}
                attend = _PackedAttention(self, active)
            assert x is not None and attend is not None
            stack = self._native_stack
            if stack is not None and attend.native and len(order) == len(segments) and not output_layers:
                x = stack(x, ropes, i, hi, attend.native, self._scratch)  # every remaining block in one call
                break
            block = self.model.layers[i]
            rope = ropes.get(block.sliding, ropes[False])
            if block.native is not None:
                x = block.native(
                    x, rope, i, attend.all_native(block.sliding), attend.layer(i, block.sliding), self._scratch
                )
            else:
                x = block(x, rope, attend.layer(i, block.sliding))
            if i in output_layers:
                layers[i] = x
        assert x is not None
        for p in plans:
            p.seg.cache.length = p.end
        # each segment's first row in the packed stream, and the rows it returns (the last one only for last_only)
        first, row0 = {}, 0
        for n in order:
            first[n], row0 = row0, row0 + plans[n].T
        spans = {
            n: (first[n] + plans[n].T - 1 if segments[n].last_only else first[n], first[n] + plans[n].T) for n in order
        }
        x_out = x
        if any(seg.last_only for seg in segments):
            x_out = x.index_select(1, torch.cat([torch.arange(*spans[n]) for n in order]).to(x.device))
            r = 0
            for n in order:  # the same spans in the reduced stream
                size = spans[n][1] - spans[n][0]
                spans[n], r = (r, r + size), r + size
        h = self.model.norm(x_out) if head else None
        logits = self.head_logits(h) if h is not None else None
        outs = []
        for n, p in enumerate(plans):
            lo, up = spans[n]
            outs.append(
                ForwardOutput(
                    logits=logits[:, lo:up] if logits is not None else x_out.new_empty(1, up - lo, 0),
                    hidden=h[:, lo:up] if (h is not None and return_hidden) else None,
                    layers={i: t[:, first[n] : first[n] + p.T] for i, t in layers.items() if i >= p.seg.lo},
                    residual=x_out[:, lo:up],
                )
            )
        return outs

    def forward(
        self,
        tokens: torch.Tensor,  # [1, T] new token ids
        cache: KVCache,
        positions: torch.Tensor | None = None,  # [1, T]; default: cache.length + arange(T)
        *,
        tree_mask: torch.Tensor | None = None,  # [T, T] bool among new tokens
        last_only: bool = False,  # logits for the last position only (prefill)
        return_hidden: bool = False,
        output_layers: tuple[int, ...] = (),
        blocks: tuple[int, int] | None = None,  # run only blocks [lo, hi) (self-speculation); default all
        hidden_in: torch.Tensor | None = None,  # [1, T, D] residual entering block lo; required iff lo > 0
        head: bool = True,  # False: no final norm / LM head (logits is then an empty [1, T, 0] tensor)
    ) -> ForwardOutput:
        """One sequence: `forward_batch` with one segment."""
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(
                f"forward takes one sequence, tokens [1, T] (got {tuple(tokens.shape)}); use forward_batch for several"
            )
        lo, hi = blocks if blocks is not None else (0, self.args.n_layers)
        seg = Segment(
            tokens[0],
            cache,
            None if positions is None else positions[0],
            tree_mask,
            None if hidden_in is None else hidden_in[0],
            lo,
            last_only,
        )
        return self.forward_batch([seg], hi=hi, head=head, return_hidden=return_hidden, output_layers=output_layers)[0]

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [B, T, D] -> float32 logits [B, T, V] (softcap applied)."""
        logits = self.lm_head(h).float()
        if self.args.final_logit_softcap:
            logits = torch.tanh(logits / self.args.final_logit_softcap) * self.args.final_logit_softcap
        return logits


class _PackedAttention:
    """Attention for one forward's packed rows: each segment's new keys/values go to its own
    cache, and each row attends to its own sequence only. Natively, every segment's rows in one
    call per layer; else through the framework, one call per segment (or per row)."""

    def __init__(self, model: Transformer, plans: list[_SegmentPlan]) -> None:
        self.a = model.args
        self.plans = plans
        self.row0 = [0]
        for p in plans:
            self.row0.append(self.row0[-1] + p.T)
        # (all or none: a model attends natively at every length or not at all, see `_plan`)
        nat = [n for n, p in enumerate(plans) if p.native is not None]
        self.framework = [n for n, p in enumerate(plans) if p.native is None]
        assert not (nat and self.framework), "a pass mixes native and framework attention"
        self.native: dict[bool, native.SegmentAttention] = {}
        if nat:
            kinds = {kind for n in nat for kind in plans[n].native}  # type: ignore[union-attr]
            for kind in kinds:
                self.native[kind] = native.SegmentAttention(
                    [(plans[n].seg.cache.k, plans[n].seg.cache.v) for n in nat],
                    [plans[n].start for n in nat],
                    [plans[n].T for n in nat],
                    [plans[n].native.get(kind) for n in nat],  # type: ignore[union-attr]
                    self.a.attn_scale if self.a.attn_scale is not None else self.a.head_dim**-0.5,
                )

    def all_native(self, sliding: bool) -> native.SegmentAttention | None:
        """The native attention of every row, when no row attends through the framework."""
        return self.native.get(sliding, self.native[False]) if self.native else None

    def layer(self, i: int, sliding: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda q, k, v: self(i, sliding, q, k, v)

    def __call__(self, i: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, N, H, Dh], k/v [1, N, Hkv, Dh] -> [1, N, H, Dh]."""
        a = self.a
        if self.native:
            return self.native.get(sliding, self.native[False])(i, q[0], k[0], v[0])[None]
        out = torch.empty_like(q)
        for n in self.framework:
            p, r0, r1 = self.plans[n], self.row0[n], self.row0[n + 1]
            k_cache, v_cache = p.seg.cache.k[i], p.seg.cache.v[i]  # [1, Hkv, S, Dh]
            k_cache[:, :, p.start : p.end] = k[:, r0:r1].transpose(1, 2)
            v_cache[:, :, p.start : p.end] = v[:, r0:r1].transpose(1, 2)
            qs = q[:, r0:r1].transpose(1, 2)  # [1, H, T, Dh]
            if p.rows is None:
                mask = p.masks.get(sliding, p.masks[False])
                o = F.scaled_dot_product_attention(
                    qs,
                    k_cache[:, :, : p.end],
                    v_cache[:, :, : p.end],
                    attn_mask=mask,
                    scale=a.attn_scale,
                    enable_gqa=a.n_rep > 1,
                )
            else:
                # Each row attends exactly as a one-token decoding step at its position would:
                # same key range, same mask, same kernel shape -> bitwise the same result.
                masks = p.rows.get(sliding, p.rows[False])
                o = torch.cat(
                    [
                        F.scaled_dot_product_attention(
                            qs[:, :, t : t + 1],
                            k_cache[:, :, : p.start + t + 1],
                            v_cache[:, :, : p.start + t + 1],
                            attn_mask=masks[t],
                            scale=a.attn_scale,
                            enable_gqa=a.n_rep > 1,
                        )
                        for t in range(p.T)
                    ],
                    dim=2,
                )
            out[:, r0:r1] = o.transpose(1, 2)
        return out
