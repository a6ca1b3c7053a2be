"""Logits -> probabilities, and drawing from them with an explicit generator.

The same `probs` is applied to the target's logits (p) and the drafter's (q): exactness of
rejection sampling holds for the *processed* target distribution only if both sides see the
same temperature, top-k and top-p.
"""

from __future__ import annotations

import torch

from .config import SamplingParams


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, top-p."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    x = logits.float() / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass
        # strictly before it already reaches top_p. The most likely token always survives.
        before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


BLOCK = 512  # tokens per block of the two-level inverse CDF in `sample`


def sample(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one index per row with probability proportional to `weights` (non-negative, not
    necessarily normalised): [B, V] -> [B], or [V] -> a 0-dim tensor.

    Inverse CDF in two levels, in float64: one uniform u picks the block of BLOCK tokens whose
    cumulative mass first exceeds u, then the token inside it by the block's own cumulative
    sums. The same law as `torch.multinomial(weights, 1)` (a zero weight is never drawn) at a
    small fraction of its CPU cost on a large vocabulary, which every sampled decoding step and
    every residual draw of a verification pays (docs/exactness.md; timings in docs/results.md). Two levels
    keep each token's share exact to float64 rounding of sums of at most a few hundred terms,
    where one float32 cumsum over the whole vocabulary would blur tokens of probability ~1e-7."""
    one = weights.dim() == 1
    w = weights[None] if one else weights  # [B, V]
    B, V = w.shape
    n = -(-V // BLOCK)
    blocks = torch.nn.functional.pad(w, (0, n * BLOCK - V)).view(B, n, BLOCK)  # [B, n, BLOCK]
    acc = torch.float64 if w.device.type != "mps" else torch.float32  # (MPS has no float64)
    mass = blocks.sum(-1, dtype=acc)  # [B, n]
    cdf = mass.cumsum(-1)  # [B, n]
    total = cdf[:, -1:]  # [B, 1]
    if bool((total <= 0).any()) or bool(torch.isnan(total).any()):
        raise ValueError("cannot sample from weights that are all zero (or NaN)")
    u = torch.rand(B, 1, generator=generator, dtype=acc, device=w.device) * total  # [B, 1]
    # first block whose cumulative mass exceeds u (it has mass > 0); rounding may push u past
    # the end: then the last block with mass
    last_block = (n - 1) - (mass > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)  # [B, 1]
    b = torch.minimum(torch.searchsorted(cdf, u, right=True), last_block)  # [B, 1]
    u = u - torch.where(b > 0, cdf.gather(1, (b - 1).clamp_min(0)), torch.zeros_like(u))
    row = blocks.gather(1, b[..., None].expand(B, 1, BLOCK)).squeeze(1)  # [B, BLOCK]
    last_token = (BLOCK - 1) - (row > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)  # [B, 1]
    i = torch.minimum(torch.searchsorted(row.to(acc).cumsum(-1), u, right=True), last_token)  # [B, 1]
    out = (b * BLOCK + i).squeeze(-1)  # [B]
    return out[0] if one else out


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """The plain decoder's choice: argmax when greedy, else a sample. logits [B, V] -> [B]."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(probs(logits, params), generator)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
