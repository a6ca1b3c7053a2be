"""Token trees from a draft model, grown by confidence (EAGLE-2's dynamic trees, SpecInfer,
Sequoia), sized by the measured pass tables.

A proposal grows one tree per sequence over several draft passes. The first pass feeds the
committed tokens the draft lacks and gives the root's distribution q. Then, each pass:

* every node fed in the last pass gets children: its most likely tokens (greedy) or tokens
  drawn from its q without replacement (sampling: the Gumbel top-c trick), as many as pay
  (`_children`); a node's chance to be on the accepted path is its parent's times the
  calibrated acceptance of its own draft probability (`confidence.Calibration`);
* the leaves with the best chances (at most MAX_EXPAND) are fed in one draft pass, with a mask
  that lets each see only its ancestors among the tree's rows in the draft's cache (`grow`),
  if what their children are expected to add pays for the pass and their target rows.

"Pays": the step's expected tokens per millisecond rise — E = 1 + the sum of the nodes'
chances over C = the draft passes (the draft's own pass table prices a pass over several rows)
plus the target's pass over 1 + N rows (its table). The tree is verified by the exact tree
rules: `verify.tree_greedy_verify`, and at T > 0 `verify.tree_rejection_sample` (siblings drawn
from their parent's q without replacement, in the order listed).

Exactness at T > 0: how many children a node gets depends on its q's sorted probabilities and
the tree around it, never on the children's own draws, so each sibling list is a draw without
replacement of a length fixed beforehand; whether a node is fed (gets children) depends on
the node and its relatives' draws, which verification reaching that node has already
committed or rejected — as a chain that stops by confidence (tested: greedy identity, the
sampling law with a wrong rule that must fail, `specdec certify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.cache import KVCache
from ..model.transformer import Segment
from .base import Draft
from .confidence import Calibration

MAX_NODES = 24  # draft nodes a tree may bring to the target's pass
MAX_CHILDREN = 2  # children of one node (wider trees lost depth on math, measured)
MAX_EXPAND = 2  # nodes fed in one draft pass


@dataclass
class Node:
    token: int
    parent: int  # -1: the last committed token
    depth: int  # 1: a child of the last committed token
    chance: float  # the chance it is on the accepted path
    conf: float  # its draft probability (greedy: of its rank among its parent's top tokens)
    q: int  # index of its parent's distribution among the tree's (sampling)
    slot: int | None = None  # its row in the draft's cache, once fed


@dataclass
class TreeGrowth:
    """One sequence's tree as it grows over a proposal's draft passes."""

    depth_max: int
    calibration: Calibration
    target_ms: Any  # the target's pass table: rows(n)
    draft_pass_ms: Any  # callable: ms of a draft pass over n rows
    base_position: int  # position of the last committed token
    start: int  # the draft cache's length before the tree's rows
    greedy: bool
    generator: torch.Generator
    nodes: list[Node] = field(default_factory=list)
    dists: list[torch.Tensor] = field(default_factory=list)  # sampling: each fed node's q [V] (the root's first)
    fed: list[int] = field(default_factory=list)  # nodes with a row in the draft cache, in slot order
    expected: float = 1.0  # E: the target's own token plus every node's chance
    draft_ms: float = 0.0  # the draft passes so far, priced by the draft's table

    def cost(self) -> float:
        """ms of the step as it stands: its draft passes and the target's pass over the tree."""
        return self.draft_ms + self.target_ms.rows(1 + len(self.nodes))

    def add_pass(self, rows: int) -> None:
        self.draft_ms += self.draft_pass_ms(rows)

    def _pays(self, gain: float, extra_rows: int, before: float = 0.0) -> bool:
        """Whether `extra_rows` more nodes that add `gain` expected tokens raise the rate over
        that of one node fewer (which adds `before`)."""
        now = self.draft_ms + self.target_ms.rows(len(self.nodes) + extra_rows)
        more = self.draft_ms + self.target_ms.rows(1 + len(self.nodes) + extra_rows)
        return (self.expected + gain) * now > (self.expected + before) * more

    def children(self, parent: int, dist: torch.Tensor, ids: torch.Tensor | None, q_full: torch.Tensor | None) -> None:
        """Add `parent`'s children (-1: the root's) from its distribution: `dist` [M] over the
        draft's scored tokens (`ids` [M] their token ids; None: the whole vocabulary, in
        order); `q_full` [V] (sampling): the q they are drawn from."""
        chance = self.nodes[parent].chance if parent >= 0 else 1.0
        depth = self.nodes[parent].depth + 1 if parent >= 0 else 1
        if depth > self.depth_max:
            return
        top = torch.topk(dist, min(MAX_CHILDREN, dist.shape[0]))
        probs = top.values.tolist()
        count = 0  # from the sorted probabilities only (never from what is drawn)
        gain = 0.0
        for c in probs:
            if len(self.nodes) + count >= MAX_NODES or c <= 0.0:
                break
            before, gain = gain, gain + chance * self.calibration(c)
            if not self._pays(gain, count + 1, before):
                break
            count += 1
        if count == 0:
            return
        if self.greedy:
            picks = top.indices[:count].tolist()
            confs = probs[:count]
        else:
            assert q_full is not None
            self.dists.append(q_full)
            # Gumbel top-c: an ordered draw of `count` tokens without replacement from q
            u = torch.rand(q_full.shape[0], generator=self.generator, device=q_full.device).clamp_(1e-20, 1.0)
            keys = torch.log(q_full) - torch.log(-torch.log(u))
            picks = torch.topk(keys, count).indices.tolist()
            confs = [float(q_full[t]) for t in picks]
        for pick, conf in zip(picks, confs, strict=True):
            token = int(ids[pick]) if ids is not None else int(pick)
            a = self.calibration(conf)
            self.nodes.append(Node(token, parent, depth, chance * a, conf, len(self.dists) - 1))
            self.expected += chance * a

    def to_feed(self) -> list[int]:
        """The leaves to feed in the next draft pass (none: the tree is done)."""
        leaves = sorted(
            (
                j
                for j, n in enumerate(self.nodes)
                if n.slot is None and n.depth < self.depth_max and len(self.nodes) < MAX_NODES
            ),
            key=lambda j: -self.nodes[j].chance,
        )[:MAX_EXPAND]
        best, best_w, gain = 0.0, 0, 0.0
        now = self.cost()
        for w, j in enumerate(leaves, start=1):
            n = self.nodes[j]
            gain += n.chance * self.calibration.next_after(n.conf)  # its best child, predicted
            more = (
                now
                + self.draft_pass_ms(w)
                + self.target_ms.rows(1 + len(self.nodes) + w)
                - self.target_ms.rows(1 + len(self.nodes))
            )
            rate = (self.expected + gain) / more
            if rate > best:
                best, best_w = rate, w
        if best_w == 0 or best <= self.expected / now:
            return []
        return leaves[:best_w]

    def segment(self, feed: list[int], cache: KVCache, device: torch.device) -> Segment:
        """The rows of `feed` as one draft segment: each at its own position, seeing the
        committed context and its ancestors among the tree's rows (and itself)."""
        first = cache.length
        for i, j in enumerate(feed):
            self.nodes[j].slot = first + i
        rows = [self.nodes[j].slot for j in self.fed] + [self.nodes[j].slot for j in feed]
        col = {slot: c for c, slot in enumerate(rows)}
        mask = torch.zeros(len(feed), len(rows), dtype=torch.bool)
        for i, j in enumerate(feed):
            mask[i, col[self.nodes[j].slot]] = True  # type: ignore[index]
            p = self.nodes[j].parent
            while p >= 0:
                mask[i, col[self.nodes[p].slot]] = True  # type: ignore[index]
                p = self.nodes[p].parent
        self.fed += feed
        tokens = torch.tensor([self.nodes[j].token for j in feed], dtype=torch.long, device=device)
        positions = torch.tensor(
            [self.base_position + self.nodes[j].depth for j in feed], dtype=torch.long, device=device
        )
        return Segment(tokens, cache, positions, tree_mask=mask.to(device))

    def draft(self, vocab_size: int, device: torch.device) -> Draft:
        tokens = torch.tensor([n.token for n in self.nodes], dtype=torch.long, device=device)
        parents = [n.parent for n in self.nodes]
        if self.greedy or not self.nodes:
            return Draft(tokens, None, parents=parents)
        q = torch.stack([self.dists[n.q] for n in self.nodes])  # [N, V]
        return Draft(tokens, q[:, :vocab_size], parents=parents)

    def kept_slots(self, path: list[int]) -> list[int]:
        """The draft-cache rows of the accepted path's nodes that were fed (a prefix of it)."""
        out = []
        for j in path:
            if self.nodes[j].slot is None:
                break
            out.append(self.nodes[j].slot)
        return out  # type: ignore[return-value]

    def learn(self, path: list[int]) -> None:
        """Teach the calibration what the accepted path met: at the root and each accepted node,
        its children in the order they were tried, up to the one accepted (all of them where
        none was) — each a draft of its own probability, kept or not."""
        kids: dict[int, list[int]] = {}
        for j, n in enumerate(self.nodes):
            kids.setdefault(n.parent, []).append(j)
        at = -1
        for depth in range(len(path) + 1):
            kept = path[depth] if depth < len(path) else None
            for j in kids.get(at, []):
                self.calibration.update([self.nodes[j].conf], 1 if j == kept else 0)
                if j == kept:
                    break
            if kept is None:
                return
            at = kept
