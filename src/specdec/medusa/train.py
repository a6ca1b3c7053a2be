"""`specdec train medusa|hydra`: Medusa-1 / Hydra heads on the frozen target, from conversations.

The recipe and trainer are EAGLE-3's (`specdec.eagle3.recipe`, `specdec.eagle3.train`): the
same data modes (teacher: the data's answers; self: the target's own), the same feature
cache — here the residual after the target's last layer, which the target's final norm turns
into h_t, the state the LM head reads — the same draft vocabulary, seeded resumable training
with progress, checkpoints and torchrun/DDP.

Loss: head d at anchor t predicts token t + 1 + d; its label is the target's own distribution
there (top-k, mapped into the draft vocabulary), a soft cross-entropy weighted 0.8^(d-1)
(Medusa's λ_d), counted where the predicted token belongs to an answer. Hydra's heads read
the true tokens y_1..y_d (teacher forcing: the accepted path is what they follow when
drafting).

After training, the validation sequences give each head's top-k accuracy — how often its
(j+1)-th choice is the target's own next token there — the table Medusa's tree is built from.
"""

from __future__ import annotations

from typing import Any

import torch

from ..eagle3 import features as fe
from ..eagle3.train import DECAY, TrainConfig, counted, soft_loss, train
from .heads import MedusaHeads, attach_target, config_for_target

TOPK_EVAL = 8  # choices per head whose accuracy is measured (the tree's widest level)


def head_states(heads: MedusaHeads, ex: fe.Example, norm: Any, L: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Anchors 0..L-3 of a sequence cut to L tokens: their index [A] and every head's state [A, H]."""
    with torch.no_grad():
        h = norm(ex.features[: L - 2].float()).float()  # [A, H] h_t: the target's final norm of the cached residual
    anchors = torch.arange(L - 2)
    K = heads.cfg.num_heads
    y = ex.tokens[(anchors[:, None] + 1 + torch.arange(K)[None]).clamp(max=L - 1)]  # [A, K] true y_1..y_K
    return anchors, heads.states(h, y)


def heads_loss(heads: MedusaHeads, ex: fe.Example, norm: Any, max_len: int, fraction: float = 1.0,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[tuple[int, int]]]:  # fmt: skip
    """Summed weighted loss of one sequence and, per head, (top-1 agreements, predictions)."""
    K = heads.cfg.num_heads
    L = min(int(ex.tokens.numel()), max_len)
    total = sum((p.reshape(-1)[0] * 0.0 for p in heads.parameters() if p.requires_grad), torch.zeros(()))
    if L < 3:
        return total, [(0, 0)] * K
    mask, top_ids, top_p = ex.mask[:L], ex.top_ids[:L], ex.top_p[:L].float()
    t2d_index = torch.cumsum(heads.t2d.long(), 0) - 1  # target id -> draft id
    anchors, states = head_states(heads, ex, norm, L)
    stats: list[tuple[int, int]] = []
    for d, z in enumerate(states, start=1):
        lab = anchors + d  # the target's distribution at t + d predicts token t + 1 + d
        idx = counted(lab, mask, L, fraction, generator)
        if idx.numel() == 0:
            stats.append((0, 0))
            continue
        logits = heads.logits(z[idx])  # [n, N]
        ids, probs = top_ids[lab[idx]], top_p[lab[idx]]  # [n, k]
        total = total + DECAY ** (d - 1) * soft_loss(logits, ids, probs, heads.t2d, t2d_index)
        pred = heads.draft_ids[logits.argmax(-1)]
        stats.append((int((pred == ids[:, 0]).sum()), int(idx.numel())))
    return total, stats


@torch.no_grad()
def topk_accuracy(heads: MedusaHeads, examples: list[fe.Example], norm: Any, max_len: int,
                  topk: int = TOPK_EVAL) -> list[list[float]]:  # fmt: skip
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


def run(r: Any, tc: TrainConfig, kind: str, num_heads: int, *, hydra_inner: int = 512, command: str | None = None,
        progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Features, vocabulary, training, per-head accuracies; returns the training record.
    `r`: the EAGLE-3 recipe's settings (`specdec.eagle3.recipe.Recipe`)."""
    from .. import store
    from ..api import load
    from ..eagle3.recipe import prepare
    from ..eagle3.train import _dist

    rank, world = _dist()
    lm = load(r.target)
    examples, val, record = prepare(r, lm, (lm.model.args.n_layers - 1,), seed=tc.seed, command=command,
                                    progress=progress)  # fmt: skip
    cfg = config_for_target(lm.model, r.target, kind, num_heads=num_heads, draft_vocab_size=r.draft_vocab,
                            hydra_inner=hydra_inner)  # fmt: skip
    heads = MedusaHeads(cfg)
    heads.init_weights(torch.Generator().manual_seed(tc.seed))
    heads.set_vocab(fe.draft_vocabulary(examples, cfg.draft_vocab_size, cfg.target_vocab_size))
    attach_target(heads, lm.model, store.resolve(r.target))
    norm = lm.model.model.norm
    for p in norm.parameters():
        p.requires_grad_(False)

    def loss(h: Any, ex: fe.Example, fraction: float, gen: torch.Generator | None) -> Any:
        return heads_loss(h, ex, norm, tc.max_len, fraction, gen)

    result = train(heads, examples, tc, r.out, record=record, progress=progress, loss=loss, name=kind)
    if rank == 0:
        acc = topk_accuracy(heads, val, norm, tc.max_len)
        result["validation_topk_accuracy"] = acc  # [head][rank]: the tree's input
        heads.save(r.out, extra={k: v for k, v in result.items() if k != "history"})
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return result


