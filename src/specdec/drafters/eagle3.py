"""EAGLE-3 drafting: a one-layer head over the target's own features, dynamic token trees.

Each proposal (see `specdec.networks.eagle3` for the head itself):

1. the head catches up on the committed positions whose target features arrived since the
   last proposal (the prompt's at `begin`, then the accepted rows of each verification pass):
   row p reads (token p+1, fc(features_p)) and writes the head's KV cache at p; the last row
   gives the first draft distribution;
2. EAGLE-2's dynamic tree: the `topk` most probable children of the root, then at each depth
   the `topk` best frontier nodes by cumulative draft log-probability are expanded in one
   head call (each reads its token and its parent's head output, attending to the committed
   rows and its own ancestors), `topk` children each; after `depth` levels the `total` best
   nodes by cumulative log-probability (an ancestor-closed set) go to the target as one tree.
   Greedy decoding verifies it with `tree_greedy_verify`. Unless `total` is given, the cost
   model picks it each step: a node's draft path probability exp(score) estimates its chance
   of acceptance (EAGLE-2's observation), scaled by a running calibration (tokens accepted /
   tokens predicted so far), so the best M nodes are expected to yield 1 + c * sum exp(score)
   tokens for a target pass over 1 + M rows (timed once per target: `specdec.costs`) plus the
   drafting time; M maximises their ratio. Cheap rows buy bigger trees. The depth (at most
   k) is the cost model's too: each level costs a head call (timed), and a level is drafted
   only where its best case — a child as likely as each node it expands — would beat the
   candidates at hand; where rows are dear the tree stays one level deep. (Sampled trees
   too: the decision reads only nodes drawn before, so each node's children, when drawn,
   are still a whole without-replacement sample from its q.)
3. Sampling (T > 0), exactly: children are *drawn* from the head's distribution q (the
   sampling settings applied to the draft logits) without replacement (Gumbel top-k, which
   draws in order), `sample_children` per expanded node, the `sample_frontier` best frontier
   nodes expanded per depth, no pruning after the draws; the target verifies with recursive
   rejection sampling over each node's children (`verify.tree_rejection_sample`). Which nodes
   get children depends only on draws made before those children, so each node's children are
   a fresh without-replacement sample from its own q, as the rule requires.

4. Under `--drafter auto` (`chain_only`): a chain of exactly the k auto chose, the most likely
   child (greedy) or one drawn child (sampling) per depth, verified like any chain; the head
   follows the tokens other drafters and plain steps commit (`catch_up`) from the target's
   features of their rows.

The head's linear layers run through specdec's q4k kernel (quantized once when the drafter
is built) where the native kernels exist, else in float32.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.transformer import Transformer
from ..networks.eagle3 import Eagle3Head
from ..offers import Estimates, Offer
from ..sampling import probs as sampling_probs
from . import heads
from .base import Draft, DraftSession, Feedback, Option, Switchable, register
from .heads import HeadRunner


class _Runner(HeadRunner):
    """The EAGLE-3 head's stages on the kernels, and its calibration (shared by every drafter of
    this head and target, as the runner is)."""

    kind = "eagle3"

    def __init__(self, head: Eagle3Head, target: Transformer) -> None:
        super().__init__(target, {name: (w, None) for name, w in head.weights().items()})
        self.head = head
        self.accepted_sum, self.predicted_sum = 1.0, 1.0  # calibration of exp(score) as acceptance (greedy)

    def weights(self) -> Iterable[torch.Tensor]:
        return self.head.weights().values()

    def probe(self) -> None:
        c = self.head.cfg
        row = torch.zeros(1, c.hidden_size)
        kv = torch.zeros(c.num_key_value_heads, 1, c.head_dim)
        one = torch.zeros(1, dtype=torch.long)
        self.step(row, row, one, kv, kv.clone(), one, torch.ones(1, 1, dtype=torch.bool))

    @property
    def calibration(self) -> float:
        """Tokens accepted per token the path probabilities predicted (greedy steps so far)."""
        return self.accepted_sum / self.predicted_sum

    def linears(self, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """The head's `Linears` on the kernels (layers sharing an input in one call)."""
        if not self.kernels:
            return self.head.linears(names, x)
        kernels = tuple(self.kernels[n] for n in names)
        return type(kernels[0]).group(kernels, x)

    @torch.no_grad()  # drafting: the head's own weights (where no kernels run) build no graph
    def project(self, feats: torch.Tensor) -> torch.Tensor:
        return self.head.project(feats.float(), self.linears)

    @torch.no_grad()
    def step(
        self,
        emb: torch.Tensor,  # [R, H] token embeddings
        g: torch.Tensor,  # [R, H] the residual input (projected features or a parent's output)
        positions: torch.Tensor,  # [R]
        k_cache: torch.Tensor,  # [nkv, S, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [R] cache slots the rows' keys/values go to
        mask: torch.Tensor,  # [R, S_used] bool: which slots each row attends to (its own included)
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # next g [R, H], draft logits [R, N] (R = 1 with last_only)
        """Write every row's keys and values to the head's cache; the output and draft logits
        of every row, or with `last_only` of the last row alone (catching up on committed
        positions needs only their keys and values: attention, MLP and LM head for one row
        instead of all, a tenth of the head's work per row)."""
        q, k, v = self.head.qkv(emb, g, positions, self.linears)  # [R, nh|nkv, D]
        k_cache[:, slots] = k.transpose(0, 1)
        v_cache[:, slots] = v.transpose(0, 1)
        if last_only:
            q, g, mask = q[-1:], g[-1:], mask[-1:]
        S = mask.shape[1]
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k_cache[None, :, :S],
            v_cache[None, :, :S],
            attn_mask=mask[None, None],
            enable_gqa=True,
        )[0].transpose(0, 1)  # [R, nh, D]
        h, logits = self.head.finish(g, attn, linears=self.linears)
        return h, logits  # type: ignore[return-value]


@register(
    "eagle3",
    help="EAGLE-3 head over the target's features (trained with `specdec train eagle3`), dynamic token trees",
    needs="target",
    head="eagle3",
    auto_head=True,
    options=(
        Option("head", "directory of a trained EAGLE-3 head (default: the one shipped for the target)", type=str),
        Option("topk", "greedy trees: children per expanded node, nodes expanded per depth", flag="--tree-topk"),
        Option(
            "total",
            "greedy trees: draft tokens sent to the target per step (unset: the cost model's choice)",
            flag="--tree-tokens",
        ),
        Option("sample_children", "sampling: children drawn per expanded node", flag="--tree-children"),
        Option("sample_frontier", "sampling: nodes expanded per depth", flag="--tree-frontier"),
    ),
)
class Eagle3Drafter(Switchable):
    """`k` (the generation config's) is the tree depth."""

    def __init__(
        self,
        target: Transformer,
        head: str | Path | Eagle3Head | None = None,
        topk: int = 8,
        total: int | None = None,
        sample_children: int = 2,
        sample_frontier: int = 2,
        max_total: int = 31,
    ) -> None:
        super().__init__()
        self.chain_only = False  # this sequence's `DraftSession.chain_only` (set at begin)
        self.head, self.run = heads.load("eagle3", target, head, Eagle3Head.load, _Runner)
        if min(topk, total or 1, sample_children, sample_frontier, max_total) < 1:
            raise ValueError("topk, total, sample_children and sample_frontier must be at least 1")
        self.target = target
        self.topk, self.total = topk, total
        self.sample_children, self.sample_frontier = sample_children, sample_frontier
        self.feature_layers = tuple(self.head.cfg.feature_layers)
        self.max_total = total or max_total
        self.scratch_rows = max(self.max_total, sample_children + 64 * sample_frontier * sample_children)
        self.repro, self.pass_ms, self._estimate, self._calls0 = False, None, 0.0, 0
        c = self.head.cfg
        self.info = {"head": c.target, "draft_vocab": c.draft_vocab_size, "topk": topk, "total": total or "cost model"}

    # -- lifecycle ------------------------------------------------------------------------
    def begin(self, session: DraftSession) -> None:
        c = self.head.cfg
        self.chain_only = session.chain_only
        pricing = session.pricing
        if self.total is None and self.run.pass_ms is None:
            self.run.pass_ms = pricing.live(self.max_total + 1)
        # a seeded sampled request (`Pricing.reproducible`): tree sizes from stored numbers alone —
        # the pass table unscaled, head calls at their stored time, no calibration from other requests
        self.repro = pricing.reproducible
        self.pass_ms = pricing.passes(self.max_total + 1) if self.repro and self.run.pass_ms is not None else None
        self._calls0 = self.forwards
        self._estimate = 0.0
        self._step_ms = 0.0
        self._predicted = 0.0
        self._skip = self._backoff = 0
        self._sizes: list[int] = []
        self.ctx = list(session.context)
        self.sampling = session.sampling
        self.gen = session.generator
        self.feats = [torch.cat([session.layers[i] for i in c.feature_layers], -1).float()]  # [T, 3H] pieces
        self.n_feat = self.feats[0].shape[0]
        self.n_done = 0  # committed positions already in the head's cache
        cap = session.capacity + self.scratch_rows + 2
        self.k_cache = torch.zeros(c.num_key_value_heads, cap, c.head_dim)
        self.v_cache = torch.zeros_like(self.k_cache)

    def accepted(self, feedback: Feedback) -> None:
        if self.sampling.greedy and not self.chain_only:  # (the calibration is of the trees it sizes)
            self.run.accepted_sum += len(feedback.path)
            self.run.predicted_sum += self._predicted
        self._follow([int(self._last_tokens[j]) for j in feedback.path] + [feedback.next_token], feedback)

    def catch_up(self, tokens: list[int], feedback: Feedback | None = None) -> None:
        """Tokens another drafter proposed (or a plain step) committed: the head reads the
        target's features of their rows at its next proposal, as it does after its own."""
        if feedback is None or any(i not in feedback.layers for i in self.head.cfg.feature_layers):
            raise ValueError(
                "eagle3 follows committed tokens only with the target's features of their rows "
                "(the feedback of the pass that committed them)"
            )
        if len(feedback.accepted_rows) != len(tokens):
            raise ValueError(
                f"{len(tokens)} tokens committed, but the pass accepted {len(feedback.accepted_rows)} rows"
            )
        self._follow(tokens, feedback)

    def _follow(self, committed: list[int], feedback: Feedback) -> None:
        """Append the committed rows' target features and the committed tokens."""
        self._predicted = 0.0  # (a step without a proposal predicts nothing)
        rows = feedback.accepted_rows
        f = torch.cat([feedback.layers[i][rows] for i in self.head.cfg.feature_layers], -1).float()
        self.feats.append(f)
        self.n_feat += f.shape[0]
        self.ctx += committed

    def prepare(self) -> None:
        """The head's call as timed once per machine (what a seeded sampled request decides by)."""
        self.run.stored_call_ms(self.target)

    def cost_ms(self) -> float | None:
        """Per drafted token of a chain: about one head call (None until one is timed)."""
        return self.run.stored_call_ms(self.target) if self.repro else self.run.call_ms

    def offer(self, k: int, est: Estimates) -> Offer | None:
        """Under auto a chain by the position model; alone its own tree, priced by what its
        steps did."""
        if self.chain_only:
            return est.chain(self.name, "", k, self.cost_ms())
        return est.measured(self.name, k, self.cost_ms())

    def end(self, final: Feedback | None = None) -> None:
        self.k_cache = self.v_cache = torch.zeros(0)
        self.feats = []

    # -- drafting -------------------------------------------------------------------------
    def _catch_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over committed positions n_done .. n_feat-1; returns the last row's
        output g [H] and draft logits [N]."""
        feats = torch.cat(self.feats) if len(self.feats) > 1 else self.feats[0]
        self.feats = [feats]
        lo, hi = self.n_done, self.n_feat
        pos = torch.arange(lo, hi)
        toks = torch.tensor(self.ctx[lo + 1 : hi + 1])
        g_in = self.run.project(feats[lo:hi])
        mask = torch.ones(hi - lo, hi, dtype=torch.bool).tril(lo)
        g, logits = self.run.step(
            self.head.embed(toks), g_in, pos, self.k_cache, self.v_cache, pos, mask, last_only=True
        )
        self.forwards += 1
        self.n_done = hi
        return g[-1], logits[-1]  # type: ignore[index]

    def _q(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [R, N] -> the sampling distribution over draft ids [R, N]."""
        return sampling_probs(logits, self.sampling)

    def _spent_ms(self) -> float:
        """This proposal's time so far: measured, or its head calls at their stored time."""
        if self.repro:
            return (self.forwards - self._calls0) * self.run.stored_call_ms(self.target)
        return (time.perf_counter() - self._t0) * 1e3

    def propose(self, k: int) -> Draft:
        self._t0, self._calls0 = time.perf_counter(), self.forwards
        draft = self._propose(k)
        ms = self._spent_ms()
        self._estimate = ms if self.repro else 0.0  # (its head calls at their stored time)
        self._step_ms = ms if not self._step_ms else 0.8 * self._step_ms + 0.2 * ms
        return draft

    def _best(self, probs: list[float], draft_ms: float) -> tuple[int, float]:
        """Under the cost model: how many of the candidates (their path probabilities, best
        first) to send, and the expected tokens per ms of that step; 0 (a plain step, without
        drafting cost) where no tree is expected to pay for its rows and `draft_ms`."""
        costs, c = (self.pass_ms, 1.0) if self.repro else (self.run.pass_ms, self.run.calibration)
        best_m, expected = 0, 1.0
        best = expected / costs.target(1)
        for m, p in enumerate(probs[: self.max_total], start=1):
            expected += c * p
            rate = expected / (costs.target(1 + m) + draft_ms)
            if rate > best:
                best, best_m = rate, m
        return best_m, best

    def _tree_size(self, scores: list[float]) -> int:
        """How many of the candidates (best first, `scores` their cumulative log-probabilities)
        to send: the most expected tokens per unit of time under the cost model."""
        if self.total is not None:
            return min(self.total, len(scores))
        best_m = self._best([math.exp(sc) for sc in scores], self._step_ms)[0]
        self._sizes.append(best_m)
        self.info["tree_tokens_mean"] = round(sum(self._sizes) / len(self._sizes), 2)
        self.info["calibration"] = round(self.run.calibration, 3)
        return best_m

    def _deeper_pays(self, scores: list[float], expand: list[float]) -> bool:
        """Is another depth worth a head call? Its nodes are at most as likely as their parents
        (`expand`, the scores of the nodes it would expand), so the best step it can give is
        today's candidates plus one child per expanded node as likely as its parent, drafted in
        the time spent so far plus one more call; expand only if that beats the best step
        from the candidates at hand. Fixed trees (`total`) keep the depth asked for."""
        call_ms = self.run.stored_call_ms(self.target) if self.repro else self.run.call_ms
        if self.total is not None or call_ms is None:  # (a call not timed yet: time one)
            return True
        spent = self._spent_ms()
        now = sorted((math.exp(sc) for sc in scores), reverse=True)
        then = sorted([*now, *(math.exp(sc) for sc in expand)], reverse=True)
        return self._best(then, spent + call_ms)[1] > self._best(now, spent)[1]

    def _propose(self, k: int) -> Draft:
        self._predicted = 0.0
        if k < 1:
            return Draft.empty()
        chain = self.chain_only  # exactly k tokens, the most likely (greedy) or drawn (sampling) one per depth
        if self._skip > 0 and not chain:  # the cost model found no tree worth its rows lately: plain steps
            self._skip -= 1
            self._last_tokens = torch.zeros(0, dtype=torch.long)
            return Draft.empty()
        g_root, logits_root = self._catch_up()
        greedy = self.sampling.greedy
        P = self.n_feat - 1  # position of the root row (the last with target features); depth d sits at P + d
        base = self.n_feat  # first scratch slot
        # nodes: token (draft id), parent, depth, score, slot (when expanded), g (when expanded)
        tok: list[int] = []
        par: list[int] = []
        depth: list[int] = []
        score: list[float] = []
        qrows: list[torch.Tensor] = []  # sampling: q of each node's parent (over draft ids)

        def add(parent: int, token: int, logp: float, q: torch.Tensor | None) -> int:
            tok.append(token)
            par.append(parent)
            depth.append(1 if parent < 0 else depth[parent] + 1)
            score.append((score[parent] if parent >= 0 else 0.0) + logp)
            if q is not None:
                qrows.append(q)
            return len(tok) - 1

        def children(parents: list[int], logits: torch.Tensor, n: int) -> list[int]:
            """`n` children of each parent from its row of draft logits [R, N], best first
            (greedy: the top n, all rows in one call) or in draw order (sampling)."""
            if greedy:
                val, idx = torch.log_softmax(logits.float(), -1).topk(n, -1)  # [R, n]
                return [
                    add(p, i, v, None)
                    for p, vs, ids in zip(parents, val.tolist(), idx.tolist(), strict=True)
                    for v, i in zip(vs, ids, strict=True)
                ]
            new = []
            for p, row in zip(parents, logits, strict=True):
                q = self._q(row[None])[0]
                m = min(n, int((q > 0).sum()))
                u = torch.rand(q.shape, generator=self.gen).clamp_min(1e-20)
                keys = torch.where(q > 0, q.log() - torch.log(-torch.log(u)), torch.full_like(q, -math.inf))
                idx = keys.topk(m).indices  # Gumbel top-k: m draws without replacement, in draw order
                new += [add(p, i, v, q) for v, i in zip(q[idx].log().tolist(), idx.tolist(), strict=True)]
            return new

        width = 1 if chain else self.topk if greedy else self.sample_children
        frontier = children([-1], logits_root[None], width)
        g_of: dict[int, torch.Tensor] = {-1: g_root}
        slot_of: dict[int, int] = {}
        for _depth in range(2, k + 1):
            n_expand = 1 if chain else self.topk if greedy else self.sample_frontier
            expand = sorted(frontier, key=lambda j: -score[j])[:n_expand]
            if not expand or not (chain or self._deeper_pays(score, [score[j] for j in expand])):
                break
            R = len(expand)
            slots = torch.arange(base + len(slot_of), base + len(slot_of) + R)
            for j, s in zip(expand, slots.tolist(), strict=True):
                slot_of[j] = s
            S = int(slots[-1]) + 1
            mask = torch.zeros(R, S, dtype=torch.bool)
            mask[:, :base] = True
            for r, j in enumerate(expand):
                a = j
                while a >= 0:  # the node and its ancestors (all expanded, so all have slots)
                    mask[r, slot_of[a]] = True
                    a = par[a]
            emb = self.head.embed(self.head.draft_ids[torch.tensor([tok[j] for j in expand])])
            g_in = torch.stack([g_of[par[j]] for j in expand])
            pos = torch.tensor([P + depth[j] for j in expand])
            t_call = time.perf_counter()
            g, logits = self.run.step(emb, g_in, pos, self.k_cache, self.v_cache, slots, mask)
            self.run.timed(t_call)
            self.forwards += 1
            for r, j in enumerate(expand):
                g_of[j] = g[r]
            frontier = children(expand, logits, width)  # type: ignore[arg-type]
            if not greedy:
                continue
            # EAGLE-2: keep the topk best new candidates as the next frontier
            frontier = sorted(frontier, key=lambda j: -score[j])[: self.topk]
        keep = list(range(len(tok)))
        if greedy and not chain:
            # the best by cumulative log-probability; a child never beats its parent, and ties go
            # to the shallower node, so the set holds every kept node's ancestors
            keep = sorted(keep, key=lambda j: (-score[j], depth[j]))
            keep = keep[: self._tree_size([score[j] for j in keep])]
        self._predicted = sum(math.exp(score[j]) for j in keep)
        # parents before children; siblings best first (greedy) or in draw order (sampling: the
        # without-replacement order the rejection rule walks them in)
        keep = sorted(keep, key=(lambda j: (depth[j], -score[j])) if greedy else (lambda j: (depth[j], j)))
        new_index = {j: n for n, j in enumerate(keep)}
        if not keep:  # back off: skip drafting for 1, 2, 4 ... 16 steps, then look again
            self._backoff = min(16, 2 * self._backoff) if self._backoff else 1
            self._skip = self._backoff
            self._last_tokens = torch.zeros(0, dtype=torch.long)
            return Draft.empty()
        self._backoff = 0
        tokens = self.head.draft_ids[torch.tensor([tok[j] for j in keep], dtype=torch.long)]
        parents = [new_index[par[j]] if par[j] >= 0 else -1 for j in keep]
        self._last_tokens = tokens
        q_full = None
        if not greedy:
            V = self.head.cfg.target_vocab_size
            q_full = torch.zeros(len(keep), V)
            q_full[:, self.head.draft_ids] = torch.stack([qrows[j] for j in keep])
        return Draft(tokens, q_full, None if chain else parents)
