"""A compact native decoder for Llama, Qwen2 and Gemma 3 text, driven by `ModelArgs`.

Module names follow the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj`` ...)
so safetensors load without a name map. One forward call scores any number of new tokens
at given positions against the KV cache, with an optional mask among the new tokens (token
trees), and returns logits for every new position plus, on request, hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .cache import ContextOverflowError, KVCache
from .config import ModelArgs
from .kernels import MODES
from .linear import Linear, linear_group

# Longer runs of new tokens (prompt prefill) attend in one batched call: prefill is the same
# call in plain and speculative decoding, so it needs no row-by-row treatment.
ROW_ATTENTION_MAX = 64


@dataclass
class RowAttention:
    """How a layer attends row by row (batch-invariant modes, chains of new tokens): with the
    native kernel (`mask`: [B, T, end] uint8, nonzero = may attend, or None for all earlier
    keys), or one framework call per row (`rows`: the per-row masks a one-token step would pass)."""

    native: bool
    mask: torch.Tensor | None = None
    rows: list[torch.Tensor | None] | None = None


def _kernel_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, end] bool -> the native attention's [B, T, end] uint8."""
    return mask[:, 0].to(torch.uint8).contiguous()


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the storage dtype, as the reference implementations do.
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

    def __init__(self, head_dim: int, theta: float, max_pos: int, device: torch.device) -> None:
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        inv_freq = 1.0 / (theta**exponent)  # [D/2]
        angles = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]  # [P, D/2]
        self.cos, self.sin = angles.cos(), angles.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) laid out for `rotate`, looked up once per forward. positions: [B, T]."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [B, 1, T, D/2]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)  # [B, 1, T, D]


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE: (x1 cos - x2 sin, x2 cos + x1 sin), computed as x*cos + (x2, x1)*(-sin, sin),
    which is the same floating-point result in fewer operations. x: [B, H, T, D]."""
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
        x: torch.Tensor,  # [B, T, D]
        rope: tuple[torch.Tensor, torch.Tensor],  # this layer's (cos, sin) tables, see Rotary.tables
        k_cache: torch.Tensor,  # [B, H_kv, S_cap, Dh] this layer's slice
        v_cache: torch.Tensor,
        start: int,  # slot of the first new token
        mask: torch.Tensor | None,  # [B, 1, T, start+T] bool, True = may attend
        row_masks: RowAttention | None = None,  # row-by-row attention (see Transformer)
    ) -> torch.Tensor:
        a = self.a
        B, T, _ = x.shape
        q, k, v = linear_group((self.q_proj, self.k_proj, self.v_proj), x)
        q = q.view(B, T, a.n_heads, a.head_dim).transpose(1, 2)  # [B, H, T, Dh]
        k = k.view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)  # [B, Hkv, T, Dh]
        v = v.view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, rope), rotate(k, rope)
        end = start + T
        k_cache[:, :, start:end] = k
        v_cache[:, :, start:end] = v
        if row_masks is not None and row_masks.native:
            # one native call for every row and head; row i sees exactly what one-token
            # decoding at its position sees
            out = native.attend_rows(q.transpose(1, 2), k_cache, v_cache, start, row_masks.mask, a.attn_scale)
            return self.o_proj(out.view(B, T, a.n_heads * a.head_dim))  # fmt: skip
        if row_masks is None:
            out = F.scaled_dot_product_attention(
                q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask, scale=a.attn_scale,
                enable_gqa=a.n_rep > 1,
            )  # [B, H, T, Dh]
        else:
            # Each row attends exactly as a one-token decoding step at its position would:
            # same key range, same mask, same kernel shape -> bitwise the same result.
            out = torch.cat([
                F.scaled_dot_product_attention(
                    q[:, :, i : i + 1], k_cache[:, :, : start + i + 1], v_cache[:, :, : start + i + 1],
                    attn_mask=row_masks.rows[i], scale=a.attn_scale, enable_gqa=a.n_rep > 1,
                )
                for i in range(T)
            ], dim=2)  # fmt: skip
        return self.o_proj(out.transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim))


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

    def forward(self, x, rope, k_cache, v_cache, start, mask, row_masks=None) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, start, mask, row_masks)
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
        self.mode = "fp32"  # precision/kernel mode, set by the loader (see kernels.MODES)

    # -- set-up ---------------------------------------------------------------------------
    def finalize(self) -> Transformer:
        """Tie embeddings and build RoPE tables; call after weights are loaded/moved."""
        if self.args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        dev = self.model.embed_tokens.weight.device
        a = self.args
        self._rotary = {False: Rotary(a.head_dim, a.rope_theta, a.max_seq_len, dev)}
        if a.rope_theta_local is not None:
            self._rotary[True] = Rotary(a.head_dim, a.rope_theta_local, a.max_seq_len, dev)
        return self

    @property
    def row_invariant_attention(self) -> bool:
        """In batch-invariant modes short chains of new tokens attend row by row, so a k-token
        verification pass computes bitwise what one-token decoding computes."""
        return MODES[self.mode].batch_invariant

    @property
    def _native_attention(self) -> bool:
        """Row-by-row attention runs in specdec's native kernel where it can (CPU, float32)."""
        return (
            self.row_invariant_attention and self.device.type == "cpu" and self.dtype == torch.float32
            and self.args.head_dim % 8 == 0 and native.available()
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        a = self.args
        return KVCache(
            a.n_layers, batch, a.n_kv_heads, capacity, a.head_dim, dtype=self.dtype, device=self.device
        )

    # -- forward --------------------------------------------------------------------------
    def _masks(
        self, cache: KVCache, positions: torch.Tensor, start: int, tree_mask: torch.Tensor | None
    ) -> dict[bool, torch.Tensor | None]:
        """Attention masks [B, 1, T, start+T] (True = attend), one per layer kind."""
        B, T = positions.shape
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
        full = torch.ones(B, T, end, dtype=torch.bool, device=dev)
        if tree_mask is None:
            full[:, :, start:] = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        else:
            full[:, :, start:] = tree_mask.expand(B, T, T)
        masks = {False: full.unsqueeze(1)}
        if need_sliding:
            masks[True] = (full & self._window(cache, positions, end)).unsqueeze(1)
        return masks

    def _window(self, cache: KVCache, positions: torch.Tensor, end: int) -> torch.Tensor:
        """[B, T, end] True where a key lies inside the query's sliding window."""
        assert self.args.sliding_window is not None
        return cache.pos[:, None, :end] > positions[:, :, None] - self.args.sliding_window

    def _row_attention(
        self, masks: dict[bool, torch.Tensor | None], start: int, T: int, tree: bool = False
    ) -> dict[bool, RowAttention]:
        """Row-by-row attention per layer kind: exactly what one-token decoding at each position
        would do (no mask on full layers, the window row on sliding layers; with `tree`, the
        tree mask: masked keys add exactly nothing in the native kernel)."""
        if self._native_attention:
            # the kernel already limits row i to keys 0..start+i; only windows and trees need a mask
            # (as the kernel's bytes, converted once per forward rather than once per layer)
            full = masks[False]
            rows_native = {False: RowAttention(True, _kernel_mask(full) if tree and full is not None else None)}
            if masks.get(True) is not None:
                rows_native[True] = RowAttention(True, _kernel_mask(masks[True]))
            return rows_native
        rows: dict[bool, RowAttention] = {False: RowAttention(False, rows=[None] * T)}
        if masks.get(True) is not None:
            rows[True] = RowAttention(False, rows=[masks[True][:, :, i : i + 1, : start + i + 1] for i in range(T)])
        return rows

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] new token ids
        cache: KVCache,
        positions: torch.Tensor | None = None,  # [B, T]; default: cache.length + arange(T)
        *,
        tree_mask: torch.Tensor | None = None,  # [T, T] or [B, T, T] bool among new tokens
        last_only: bool = False,  # logits for the last position only (prefill)
        return_hidden: bool = False,
        output_layers: tuple[int, ...] = (),
        blocks: tuple[int, int] | None = None,  # run only blocks [lo, hi) (self-speculation); default all
        hidden_in: torch.Tensor | None = None,  # [B, T, D] residual entering block lo; required iff lo > 0
        head: bool = True,  # False: no final norm / LM head (logits is then an empty [B, T, 0] tensor)
    ) -> ForwardOutput:
        """Score `tokens` against the cache: their KV go to the next free slots of every block
        that runs, and the cache length grows by T (also for a partial run of `blocks`: the
        caller that drafts from early blocks truncates it back)."""
        a = self.args
        B, T = tokens.shape
        lo, hi = blocks if blocks is not None else (0, a.n_layers)
        if not 0 <= lo < hi <= a.n_layers:
            raise ValueError(f"blocks must satisfy 0 <= lo < hi <= {a.n_layers} (got {blocks})")
        if (lo > 0) != (hidden_in is not None):
            raise ValueError("hidden_in (the residual entering block lo) is required exactly when blocks starts above 0")
        start = cache.reserve(T)
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        if int(positions.max()) >= a.max_seq_len:
            raise ContextOverflowError(
                f"position {int(positions.max())} is beyond the model's context of {a.max_seq_len}"
            )
        if tree_mask is not None and torch.triu(tree_mask, 1).any():
            raise ValueError("tree_mask must list tokens in topological order: a token may attend only to earlier ones")
        cache.pos[:, start : start + T] = positions
        masks = self._masks(cache, positions, start, tree_mask)
        row_masks = None
        if self.row_invariant_attention and T <= ROW_ATTENTION_MAX:
            if tree_mask is not None:
                # token trees: each row attends to the cache and its ancestors only, in the
                # native kernel bitwise as one-token decoding along its path would
                if self._native_attention:
                    row_masks = self._row_attention(masks, start, T, tree=True)
            elif T > 1 or self._native_attention:
                # (one-token steps too, when the native kernel runs the rows: decoding and
                # verification must go through the same code)
                row_masks = self._row_attention(masks, start, T)
        if hidden_in is not None:
            if hidden_in.shape != (B, T, a.dim):
                raise ValueError(f"hidden_in has shape {tuple(hidden_in.shape)}, expected {(B, T, a.dim)}")
            x = hidden_in
        else:
            x = self.model.embed_tokens(tokens)  # [B, T, D]
            if a.embed_scale != 1.0:
                x = x * torch.tensor(a.embed_scale, dtype=x.dtype)
        layers: dict[int, torch.Tensor] = {}
        ropes = {kind: r.tables(positions, x.dtype) for kind, r in self._rotary.items()}
        for i in range(lo, hi):
            block = self.model.layers[i]
            rope = ropes.get(block.sliding, ropes[False])
            mask = masks.get(block.sliding, masks[False])
            rows = None if row_masks is None else row_masks.get(block.sliding, row_masks[False])
            x = block(x, rope, cache.k[i], cache.v[i], start, mask, rows)
            if i in output_layers:
                layers[i] = x
        cache.length = start + T
        if last_only:
            x = x[:, -1:]
        if not head:
            return ForwardOutput(logits=x.new_empty(B, x.shape[1], 0), layers=layers, residual=x)
        h = self.model.norm(x)
        return ForwardOutput(logits=self.head_logits(h), hidden=h if return_hidden else None, layers=layers, residual=x)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [B, T, D] -> float32 logits [B, T, V] (softcap applied)."""
        logits = self.lm_head(h).float()
        if self.args.final_logit_softcap:
            logits = torch.tanh(logits / self.args.final_logit_softcap) * self.args.final_logit_softcap
        return logits
