"""Training Medusa and Hydra heads (the networks: `specdec.networks.medusa`): the head states
over a training example, the loss, and top-k accuracy per head."""

from __future__ import annotations

from typing import Any

import torch

from ..networks.medusa import MedusaHeads
from . import features as fe
from .loop import counted, soft_targets_loss

TOPK_EVAL = 8  # choices per head whose accuracy is measured (the tree's widest level)


def head_states(heads: MedusaHeads, ex: fe.Example, norm: Any, L: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Anchors 0..L-3 of a sequence cut to L tokens: their index [A] and every head's state [A, H]."""
    with torch.no_grad():
        h = norm(ex.features[: L - 2].float()).float()  # [A, H] h_t: the target's final norm of the cached residual
    anchors = torch.arange(L - 2)
    K = heads.cfg.num_heads
    y = ex.tokens[(anchors[:, None] + 1 + torch.arange(K)[None]).clamp(max=L - 1)]  # [A, K] true y_1..y_K
    return anchors, heads.states(h, y)


def heads_loss(
    heads: MedusaHeads,
    ex: fe.Example,
    norm: Any,
    max_len: int,
    fraction: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Summed weighted loss of one sequence and, per head, (top-1 agreements, predictions): head d
    at anchor t predicts token t + 1 + d (`loop.soft_targets_loss`)."""
    return soft_targets_loss(
        heads, ex, heads.cfg.num_heads, max_len, lambda L: head_states(heads, ex, norm, L), fraction, generator
    )


@torch.no_grad()
def topk_accuracy(
    heads: MedusaHeads, examples: list[fe.Example], norm: Any, max_len: int, topk: int = TOPK_EVAL
) -> list[list[float]]:
    """Per head d and rank j: how often the head's (j+1)-th choice is the target's top-1 token
    (answer positions, teacher-forced)."""
    K = heads.cfg.num_heads
    hits = torch.zeros(K, topk, dtype=torch.float64)
    n = torch.zeros(K, dtype=torch.float64)
    for ex in examples:
        L = min(int(ex.tokens.numel()), max_len)
        if L < 3:
            continue
        anchors, states = head_states(heads, ex, norm, L)
        for d, z in enumerate(states, start=1):
            lab = anchors + d
            idx = counted(lab, ex.mask[:L], L)
            if idx.numel() == 0:
                continue
            ranked = heads.draft_ids[heads.logits(z[idx]).topk(topk, -1).indices]  # [n, topk]
            hits[d - 1] += (ranked == ex.top_ids[lab[idx], :1]).double().sum(0)
            n[d - 1] += idx.numel()
    return [[round(float(h / max(m, 1.0)), 4) for h in row] for row, m in zip(hits, n, strict=True)]
