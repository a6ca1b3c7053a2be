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


def sample(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row: p [B, V] -> [B]."""
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """The plain decoder's choice: argmax when greedy, else a sample. logits [B, V] -> [B]."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(probs(logits, params), generator)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
