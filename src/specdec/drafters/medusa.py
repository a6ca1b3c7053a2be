"""Medusa and Hydra drafting: extra heads on the target's last hidden state, sparse token trees.

After each verification pass the drafter holds h_t, the target's final-normed hidden state at
the last committed position whose features are known, and y_1, the target's own next token
(committed, not yet scored). Head d guesses token t + 1 + d (see `specdec.networks.medusa`).

The tree (Medusa's construction, `specdec.networks.medusa.greedy_tree`): a node is a path of
choice ranks (j_1, ..., j_d) — at depth d, head d's (j_d + 1)-th choice — expected to be
accepted with the product of those ranks' measured accuracies (the head directory's
validation table). The best M nodes go to the target as one tree, M chosen by the cost model
for this machine: 1 + the sum of their expected acceptances over the target's pass time for
1 + M rows (`specdec.costs`) plus the drafting time, the best ratio; none (a plain step)
where no tree beats plain decoding. Medusa's heads do not read the path, so one call gives
every depth's candidates; Hydra's heads read the tokens guessed before them, so each depth is
one call over the nodes that have children.

Verification is exact: greedy decoding follows the target's argmax down the tree
(`tree_greedy_verify`); under sampling each node's children are *drawn* from its head's
distribution q (the sampling settings applied to the head's logits) without replacement,
Gumbel top-k, in draw order, and verified by recursive rejection sampling
(`tree_rejection_sample`), the multi-draft rule that keeps the target's distribution.
Under `--drafter auto` (`chain_only`): a chain of the k asked for (top-1, or one draw, per depth).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..model.transformer import Transformer
from ..networks.medusa import MedusaHeads, greedy_tree
from ..offers import Estimates, Offer
from ..sampling import probs as sampling_probs
from . import heads
from .base import Draft, DraftSession, Feedback, Option, Switchable, register
from .heads import HeadRunner

ASSUMED_ACCURACY = 0.6  # heads without a measured table: head d's rank j taken as 0.6^d * 0.5^j


class _Runner(HeadRunner):
    """The heads' linear layers on the kernels: one per heads object and target, shared by
    every drafter of them."""

    def __init__(self, heads: MedusaHeads, target: Transformer) -> None:
        params = dict(heads.named_parameters())
        linears = {
            name: (p, params.get(name[: -len("weight")] + "bias"))
            for name, p in params.items()
            if name.endswith(".weight")
        }
        super().__init__(target, {**linears, "lm": (heads.lm_weight, None)})
        self.heads = heads
        self.kind = heads.cfg.kind

    def weights(self) -> Iterable[torch.Tensor]:
        return list(self.heads.parameters())

    def probe(self) -> None:
        z, y = torch.zeros(1, self.heads.cfg.hidden_size), torch.zeros(1, dtype=torch.long)
        self.logits(self.block(0, z, y))

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in self.kernels:
            return self.kernels[name](x)
        if name == "lm":
            return self.heads.logits(x)
        p = dict(self.heads.named_parameters())
        return F.linear(x, p[name], p.get(name[: -len("weight")] + "bias"))

    @torch.no_grad()
    def block(self, d: int, z: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """Head d's (0-based) state, as `MedusaHeads.block`, on the kernels."""
        if self.heads.cfg.kind == "medusa":
            return z + F.silu(self.linear(f"blocks.{d}.layers.0.weight", z))
        e = F.embedding(y, self.heads.embed_weight)
        inner = F.silu(self.linear(f"blocks.{d}.fc1.weight", torch.cat([z, e], -1)))
        return z + self.linear(f"blocks.{d}.fc2.weight", inner)

    @torch.no_grad()
    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return self.linear("lm", z)


OPTIONS = (
    Option(
        "head",
        "directory of trained heads (`specdec train medusa|hydra`; default: those shipped for the target)",
        type=str,
    ),
    Option(
        "total", "tree: draft tokens sent to the target per step (unset: the cost model's choice)", flag="--tree-tokens"
    ),
    Option("topk", "tree: choices per head it may use", flag="--tree-topk"),
)


class _HeadsDrafter(Switchable):
    """`k` (the generation config's) is the tree's depth, at most the number of heads."""

    kind = "medusa"

    def __init__(
        self,
        target: Transformer,
        head: str | Path | MedusaHeads | None = None,
        total: int | None = None,
        topk: int = 8,
        max_total: int = 31,
    ) -> None:
        super().__init__()
        self.chain_only = False  # this sequence's `DraftSession.chain_only` (set at begin)
        self.heads, self.run = heads.load(self.kind, target, head, MedusaHeads.load, _Runner)
        if self.heads.cfg.kind != self.kind:
            raise ValueError(f"{head} holds {self.heads.cfg.kind} heads; use --drafter {self.heads.cfg.kind}")
        if min(topk, total or 1, max_total) < 1:
            raise ValueError("topk, total (--tree-tokens) and max_total must be at least 1")
        self.target, self.total, self.topk = target, total, topk
        self.max_total = total or max_total
        self.scratch_rows = self.max_total
        self.feature_layers = (target.args.n_layers - 1,)
        K = self.heads.cfg.num_heads
        table = self.heads.record.get("validation_topk_accuracy")
        if not table:
            table = [[ASSUMED_ACCURACY ** (d + 1) * 0.5**j for j in range(topk)] for d in range(K)]
        self.accuracy = [[float(a) for a in row[:topk]] for row in table[:K]]
        self.pass_ms: Any = None  # the target's pass table (`costs.pass_costs`)
        self.costs: Any = None  # ...unscaled, as a `repro` request reads it
        self.repro, self._step_ms, self._estimate = False, 0.0, 0.0
        self._sizes: list[int] = []
        self.info = {
            "heads": self.kind,
            "num_heads": K,
            "draft_vocab": self.heads.cfg.draft_vocab_size,
            "accuracy": "measured" if self.heads.record.get("validation_topk_accuracy") else "assumed",
            "total": total or "cost model",
        }

    # -- lifecycle ------------------------------------------------------------------------
    def _h(self, residual: torch.Tensor) -> torch.Tensor:
        """The target's final norm of its last layer's residual: h_t, what its LM head reads."""
        with torch.no_grad():
            return self.target.model.norm(residual[None].to(self.target.dtype))[0].float()

    def begin(self, session: DraftSession) -> None:
        self.chain_only = session.chain_only
        pricing = session.pricing
        if self.total is None and self.pass_ms is None:
            self.pass_ms = pricing.live(self.max_total + 1)
        # a seeded sampled request (`Pricing.reproducible`): tree sizes from stored numbers alone
        # (the pass table unscaled, head calls at their stored time)
        self.repro = pricing.reproducible
        self.costs = pricing.passes(self.max_total + 1) if self.repro and self.pass_ms is not None else None
        self._step_ms = self._estimate = 0.0
        self.sampling, self.gen = session.sampling, session.generator
        self.h = self._h(session.layers[self.feature_layers[0]][-1])
        self.y1 = session.context[-1]
        self._last_tokens = torch.zeros(0, dtype=torch.long)

    def accepted(self, feedback: Feedback) -> None:
        self._follow(feedback)

    def catch_up(self, tokens: list[int], feedback: Feedback | None = None) -> None:
        """Tokens another drafter (or a plain step) committed: the heads read the target's last
        hidden state of the pass that committed them."""
        if feedback is None or self.feature_layers[0] not in feedback.layers:
            raise ValueError(
                f"{self.kind} follows committed tokens only with the target's last-layer features of "
                "their rows (the feedback of the pass that committed them)"
            )
        self._follow(feedback)

    def _follow(self, feedback: Feedback) -> None:
        self.h = self._h(feedback.layers[self.feature_layers[0]][feedback.accepted_rows[-1]])
        self.y1 = feedback.next_token

    def prepare(self) -> None:
        """The head's call as timed once per machine (what a seeded sampled request decides by)."""
        self.run.stored_call_ms(self.target)

    def cost_ms(self) -> float | None:
        return self.run.stored_call_ms(self.target) if self.repro else self.run.call_ms

    def offer(self, k: int, est: Estimates) -> Offer | None:
        """Under auto a chain by the position model; alone its own tree, priced by what its
        steps did."""
        k = min(k, self.heads.cfg.num_heads)
        if self.chain_only:
            return est.chain(self.name, "", k, self.cost_ms())
        return est.measured(self.name, k, self.cost_ms())

    # -- drafting -------------------------------------------------------------------------
    def _shape(self, k: int) -> list[tuple[int, ...]]:
        """This step's tree: rank paths of depth <= k, best first (a chain under auto)."""
        depth = min(k, self.heads.cfg.num_heads)
        if self.chain_only:
            return [(0,) * d for d in range(1, depth + 1)]
        paths, probs = greedy_tree(self.accuracy[:depth], self.max_total)
        if self.total is not None:
            return paths[: self.total]
        costs = self.costs if self.repro else self.pass_ms
        best_m, expected = 0, 1.0
        best = expected / costs.target(1)
        for m, p in enumerate(probs, start=1):
            expected += p
            rate = expected / (costs.target(1 + m) + self._step_ms)
            if rate > best:
                best, best_m = rate, m
        self._sizes.append(best_m)
        self.info["tree_tokens_mean"] = round(sum(self._sizes) / len(self._sizes), 2)
        return paths[:best_m]

    def propose(self, k: int) -> Draft:
        t0, calls = time.perf_counter(), self.forwards
        draft = self._propose(k)
        ms = (time.perf_counter() - t0) * 1e3
        if self.repro:
            ms = self._estimate = (self.forwards - calls) * self.run.stored_call_ms(self.target)
        if draft.tokens.numel():
            self._step_ms = ms if not self._step_ms else 0.8 * self._step_ms + 0.2 * ms
        return draft

    def _children(self, logits: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor | None]:
        """n children (draft ids) from one row of draft logits [N]: the top n (greedy) or n
        draws without replacement in draw order (sampling: Gumbel top-k), with the q they
        were drawn from (over draft ids)."""
        if self.sampling.greedy:
            return logits.topk(n).indices.tolist(), None
        q = sampling_probs(logits[None].float(), self.sampling)[0]
        m = min(n, int((q > 0).sum()))
        u = torch.rand(q.shape, generator=self.gen).clamp_min(1e-20)
        keys = torch.where(q > 0, q.log() - torch.log(-torch.log(u)), torch.full_like(q, -math.inf))
        return keys.topk(m).indices.tolist(), q

    def _propose(self, k: int) -> Draft:
        if k < 1:
            return Draft.empty()
        shape = self._shape(k)
        if not shape:
            self._last_tokens = torch.zeros(0, dtype=torch.long)
            return Draft.empty()
        index = {p: n for n, p in enumerate(shape)}
        n_children: dict[tuple[int, ...], int] = {}
        for p in shape:
            n_children[p[:-1]] = max(n_children.get(p[:-1], 0), p[-1] + 1)
        depth = max(len(p) for p in shape)
        token: dict[tuple[int, ...], int] = {}  # path -> draft id
        qrow: dict[tuple[int, ...], torch.Tensor] = {}  # path -> q it was drawn from (sampling)
        run = self.run
        t0 = time.perf_counter()
        if self.heads.cfg.kind == "medusa":
            # every head reads h_t alone: all depths' candidates from one call
            z = torch.cat([run.block(d, self.h[None], None) for d in range(depth)])  # [depth, H]
            logits = run.logits(z)  # [depth, N]
            self.forwards += 1
            for parent in sorted((p for p in n_children), key=len):  # parents before children
                if parent and parent not in index:
                    continue
                kids, q = self._children(logits[len(parent)], n_children[parent])
                for j, t in enumerate(kids):
                    token[parent + (j,)] = t
                    if q is not None:
                        qrow[parent + (j,)] = q
        else:
            # Hydra: head d reads the state of the node's parent and the node's own token
            states: dict[tuple[int, ...], torch.Tensor] = {}
            frontier = [()]
            for d in range(depth):
                parents = [p for p in frontier if p in n_children]
                if not parents:
                    break
                z_prev = torch.stack([self.h if not p else states[p[:-1]] for p in parents])
                y = torch.tensor([self.y1 if not p else int(self.heads.draft_ids[token[p]]) for p in parents])
                z = run.block(d, z_prev, y)  # [R, H]
                logits = run.logits(z)
                self.forwards += 1
                frontier = []
                for r, p in enumerate(parents):
                    states[p] = z[r]
                    kids, q = self._children(logits[r], n_children[p])
                    for j, t in enumerate(kids):
                        token[p + (j,)] = t
                        if q is not None:
                            qrow[p + (j,)] = q
                        frontier.append(p + (j,))
        run.timed(t0)
        # fewer draws than the shape asked for (a q with few non-zero entries): keep what exists
        kept = [p for p in shape if p in token and all(p[:i] in token for i in range(1, len(p)))]
        tokens = self.heads.draft_ids[torch.tensor([token[p] for p in kept], dtype=torch.long)]
        self._last_tokens = tokens
        position = {p: n for n, p in enumerate(kept)}
        parents_idx = [position[p[:-1]] if len(p) > 1 else -1 for p in kept]
        probs = None
        if not self.sampling.greedy:
            probs = torch.zeros(len(kept), self.heads.cfg.target_vocab_size)
            probs[:, self.heads.draft_ids] = torch.stack([qrow[p] for p in kept])
        chain = self.chain_only or all(len(p) == n + 1 for n, p in enumerate(kept))
        return Draft(tokens, probs, None if chain else parents_idx)


@register(
    "medusa",
    needs="target",
    options=OPTIONS,
    head="medusa",
    help="Medusa heads on the target's last hidden state (trained with `specdec train medusa`), sparse trees",
)
class MedusaDrafter(_HeadsDrafter):
    kind = "medusa"


@register(
    "hydra",
    needs="target",
    options=OPTIONS,
    head="hydra",
    help="Hydra heads: Medusa heads that read the tokens guessed before them (`specdec train hydra`)",
)
class HydraDrafter(_HeadsDrafter):
    kind = "hydra"
