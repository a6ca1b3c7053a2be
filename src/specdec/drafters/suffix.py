"""Suffix decoding (Oliaro et al., NeurIPS 2025, "SuffixDecoding"; Arctic Inference's and
vLLM's `suffix` proposers): draft a token tree from what followed earlier occurrences of the
text's longest matching suffix, in this request's prompt and output and in the outputs of
earlier requests (a shared store, bounded, oldest request evicted first). No model: a step
costs a few dictionary lookups.

Each step:
1. *Match.* Every earlier place where the last two tokens (else the last one) occurred is a
   candidate; its match length m is how far back the text agrees there (at most `max_match`).
2. *Tree.* For the candidates with m >= t (t: each of the few longest match lengths found),
   the continuations after them are merged into a trie; a node's count is how many candidates
   pass through it, its share the product of count / parent's count down from the root
   (SuffixDecoding's path probability). A node's chance of acceptance is its share times the
   measured chance that a proposal after a match of this length reaches its depth (tracked
   per match-length bucket like prompt lookup's situations, with the memory of earlier greedy
   requests as prior: `offers.Acceptance`). Nodes are taken best first by that chance,
   none with a share below `min_prob`, at most factor x t of them (SuffixDecoding's cap: a
   long match earns a long speculation) and at most `max_nodes`.
3. *Size.* Among the prefixes of that order, the one with the most expected tokens per
   millisecond under the target's measured pass time per row count (`costs.pass_costs`):
   1 + (the sum of the nodes' chances) tokens for a pass over nodes + 1 rows, where it beats a
   plain step by `margin`; else a plain step. The best t wins.

Exact: the drafts are point masses, verified as a tree by `verify.tree_greedy_verify` (greedy:
the target's argmax path) or `verify.tree_point_mass_sample` (sampling: the target's law), and
what is proposed depends only on committed tokens.

The shared store (`SuffixStore`) is part of the pool's memory (`memory.Memory`): a server keeps one
pool per API key (a response's speed must not reveal what another client generated), a
process one pool for all its sequences (the sequences of one `generate_batch` share it). A
seeded sampled request does not read it (its answer must not depend on what ran before), but
adds to it like every request.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..memory import Memory
from ..offers import Acceptance, Estimates, Offer, remember, unsent
from .base import Draft, DraftSession, Feedback, Option, ScoredTree, TreeMember, register

DEFAULT_STORE_TOKENS = 1 << 18  # tokens the shared store keeps per pool by default (~25 MB)
CANDIDATES = 64  # most recent occurrences examined per index (local and shared)
TREE_CANDIDATES = 32  # longest-matching candidates merged into one tree
THRESHOLDS = 3  # distinct match lengths tried as t per step
GAMMA = 0.9  # discount of a request's own acceptance per proposal, as auto's chooser has it
MIN_TABLE_ROWS = 32  # the pass table's rows it reads at least (a table the target has anyway)
_NONE = array("l")  # (no occurrence; never appended to)


class _Doc:
    """One token sequence with the positions after each of its bigrams and unigrams."""

    __slots__ = ("tokens", "bigrams", "unigrams")

    def __init__(self) -> None:
        self.tokens = array("l")
        self.bigrams: dict[tuple[int, int], array] = {}
        self.unigrams: dict[int, array] = {}

    def extend(self, new: Sequence[int]) -> None:
        toks = self.tokens
        for t in new:
            toks.append(t)
            end = len(toks)  # the position right after the n-gram that ends at t
            self.unigrams.setdefault(t, array("l")).append(end)
            if end >= 2:
                self.bigrams.setdefault((toks[end - 2], t), array("l")).append(end)

    def positions(self, tail: Sequence[int]) -> list[tuple[array, int]]:
        """Positions right after earlier occurrences of `tail`'s last two tokens (a match of at
        least 2), then of its last token (1)."""
        out = []
        if len(tail) >= 2:
            out.append((self.bigrams.get((tail[-2], tail[-1]), _NONE), 2))
        return [*out, (self.unigrams.get(tail[-1], _NONE), 1)]


@dataclass
class _Candidate:
    match: int  # how many tokens before `pos` agree with the text's end
    tokens: array  # the sequence it is in
    pos: int  # where its continuation starts


def _candidates(doc: _Doc, tail: Sequence[int], max_match: int) -> list[_Candidate]:
    """The most recent occurrences of `tail`'s end in `doc` that something follows (`doc` may
    be the text itself, whose last occurrence is its end), with their match lengths: those of
    the last two tokens, else of the last one."""
    toks, out, n = doc.tokens, [], len(tail)
    for positions, least in doc.positions(tail):
        for pos in reversed(positions[-CANDIDATES - 1 :]):
            if pos >= len(toks):
                continue
            m = least
            while m < max_match and m < pos and m < n and toks[pos - 1 - m] == tail[n - 1 - m]:
                m += 1
            out.append(_Candidate(m, toks, pos))
            if len(out) == CANDIDATES:
                break
        if out:
            return out
    return out


class SuffixStore:
    """Earlier requests' outputs, searchable like the request's own text; at most `max_tokens`
    tokens, the least recently added request evicted first."""

    def __init__(self, max_tokens: int = DEFAULT_STORE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.docs: OrderedDict[int, _Doc] = OrderedDict()
        self.tokens = 0
        self._next = 0

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) < 2 or self.max_tokens <= 0:
            return
        tokens = list(tokens)[-self.max_tokens :]
        doc = _Doc()
        doc.extend(tokens)
        self.docs[self._next] = doc
        self._next += 1
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            _, old = self.docs.popitem(last=False)
            self.tokens -= len(old.tokens)

    def candidates(self, tail: Sequence[int], max_match: int) -> list[_Candidate]:
        out: list[_Candidate] = []
        for doc in reversed(self.docs.values()):  # the most recent requests first
            out.extend(_candidates(doc, tail, max_match))
            if len(out) >= CANDIDATES:
                break
        return out

    def bytes(self) -> int:
        """Memory the store holds (its arrays and dictionaries), approximately."""
        import sys

        total = 0
        for doc in self.docs.values():
            total += sys.getsizeof(doc.tokens) + sys.getsizeof(doc.bigrams) + sys.getsizeof(doc.unigrams)
            total += sum(sys.getsizeof(v) for v in doc.bigrams.values()) + 64 * len(doc.bigrams)
            total += sum(sys.getsizeof(v) for v in doc.unigrams.values()) + 32 * len(doc.unigrams)
        return total


STORE = "suffix-store"  # its part of the pool's memory (`memory.Memory.part`)


def shared_store(memory: Memory, max_tokens: int) -> SuffixStore:
    """The pool's store of earlier outputs (made on first use; its bound follows the latest
    request's `max_tokens`)."""
    store = memory.part(STORE, lambda: SuffixStore(max_tokens))
    store.max_tokens = max_tokens
    return store


def build_tree(
    cands: Sequence[_Candidate], depth: int, cap: int, min_prob: float, alpha: Sequence[float]
) -> ScoredTree:
    """The continuations of `cands` merged into a trie, taken best first (see the module doc):
    at most `cap` nodes, none deeper than `depth` or with a count share below `min_prob`. A
    node's chance is its share (the product of count / parent's count down from the root)
    times `alpha[d - 1]`, the measured chance that a proposal reaching depth d has its first d
    tokens accepted."""
    # trie over the continuations: node -> {token: child}, counts; node 0 is the root
    children: list[dict[int, int]] = [{}]
    counts = [len(cands)]
    token_of = [-1]
    for c in cands:
        node, toks = 0, c.tokens
        for pos in range(c.pos, min(c.pos + depth, len(toks))):
            t = toks[pos]
            nxt = children[node].get(t)
            if nxt is None:
                nxt = children[node][t] = len(counts)
                children.append({})
                counts.append(0)
                token_of.append(t)
            counts[nxt] += 1
            node = nxt
    out = ScoredTree([], [], [])
    # (-chance, trie node, share, depth, parent's index in out); ties: the trie's order, first seen first
    heap: list[tuple[float, int, float, int, int]] = []

    def push(node: int, share: float, d: int, parent: int) -> None:
        if d >= len(alpha):
            return
        for child in children[node].values():
            sh = share * counts[child] / counts[node]
            if sh >= min_prob:
                heapq.heappush(heap, (-sh * alpha[d], child, sh, d + 1, parent))

    push(0, 1.0, 0, -1)
    while heap and len(out.tokens) < cap:
        neg, node, share, d, parent = heapq.heappop(heap)
        out.tokens.append(token_of[node])
        out.parents.append(parent)
        out.probs.append(-neg)
        push(node, share, d, len(out.tokens) - 1)
    return out


def situation(match: int) -> int:
    """The bucket of match lengths whose acceptance is tracked together (a longer match is a
    safer copy): 1, 2, 3, 4, 6, 9, 16 (each the bucket's least length)."""
    return max(b for b in (1, 2, 3, 4, 6, 9, 16) if b <= match)


@register(
    "suffix",
    default_k=16,
    help="suffix decoding: a token tree from what followed the longest matching suffix in the prompt, the output "
    "and earlier requests' outputs (no second model)",
    options=(
        Option("factor", "suffix: at most factor x match length draft tokens", "--suffix-factor"),
        Option(
            "min_prob",
            "suffix: leave out continuations that fewer than this share of the matches took",
            "--suffix-min-prob",
        ),
        Option(
            "max_nodes",
            "suffix: most draft tokens per step (the cost model chooses fewer where rows are dear)",
            "--suffix-max-nodes",
        ),
        Option(
            "max_tokens",
            "suffix: tokens of earlier outputs kept for drafting (per pool; 0: this request's text only)",
            "--suffix-max-tokens",
        ),
        Option(
            "total",
            "tree: draft tokens sent to the target per step (unset: the cost model's choice)",
            flag="--tree-tokens",
        ),
    ),
)
class SuffixDrafter(TreeMember):
    """See the module doc. `total`: send the best-first tree of up to this many nodes every
    step (None: the cost model sizes it; tests and `specdec certify` fix it)."""

    def __init__(
        self,
        factor: float = 4.0,
        min_prob: float = 0.1,
        max_nodes: int = 24,
        max_tokens: int = DEFAULT_STORE_TOKENS,
        max_match: int = 32,
        total: int | None = None,
        margin: float = 1.03,
    ) -> None:
        super().__init__()
        self.chain_only = False  # this sequence's `DraftSession.chain_only` (set at begin)
        if not factor > 0 or not 0 <= min_prob <= 1 or max_nodes < 1 or max_tokens < 0 or max_match < 2:
            raise ValueError(
                f"suffix needs factor > 0, 0 <= min_prob <= 1, max_nodes >= 1 and max_tokens >= 0 "
                f"(got factor={factor}, min_prob={min_prob}, max_nodes={max_nodes}, "
                f"max_tokens={max_tokens})"
            )
        if total is not None and total < 1:
            raise ValueError(f"suffix: --tree-tokens must be >= 1 (unset: sized by the cost model), got {total}")
        self.factor, self.min_prob, self.max_nodes = factor, min_prob, total or max_nodes
        self.max_tokens, self.max_match, self.total, self.margin = max_tokens, max_match, total, margin
        self.scratch_rows = self.max_nodes
        self._doc = _Doc()
        self._prompt_len = 0
        self._store: SuffixStore | None = None  # the pool's store (added to at the end)
        self._shared: SuffixStore | None = None  # the same, where this request reads it
        self._costs: Any = None
        self._memory: dict[tuple[str, Hashable], Acceptance] | None = None
        self._acceptance: dict[int, Acceptance] = {}
        self._proposal: list[int] = []
        self._situation = 0  # the match-length bucket of the last proposal
        self._depth = 0
        self._sizes: list[int] = []
        self._cached: tuple[int, list[_Candidate]] = (-1, [])
        self._planned: tuple[tuple[int, int], tuple[int, ScoredTree, float]] = (
            (-1, -1),
            (0, ScoredTree([], [], []), -1.0),
        )
        self._device = torch.device("cpu")

    def _rows(self) -> int:
        return max(MIN_TABLE_ROWS, self.max_nodes + 1)

    def begin(self, session: DraftSession) -> None:
        if session.target is None:
            raise ValueError("the suffix drafter needs the target model in its session (its pass table)")
        self.chain_only = session.chain_only
        self._device = session.generator.device
        self._doc = _Doc()
        self._doc.extend(session.context)
        self._prompt_len = len(session.context) - 1
        self._store = shared_store(session.memory, self.max_tokens) if self.max_tokens else None
        # (a seeded sampled request's drafts, hence its random numbers, must not depend on what
        # ran before it)
        self._shared = None if session.pricing.reproducible else self._store
        self._costs = session.pricing.passes(self._rows()) if self.total is None else None
        self._memory = session.memory.acceptance if session.sampling.greedy else None
        self._acceptance, self._proposal, self._sizes, self._cached = {}, [], [], (-1, [])
        self._planned = ((-1, -1), (0, ScoredTree([], [], []), -1.0))

    def prepare(self) -> None:
        """Nothing per process: the pass table is the target's (the server times it)."""

    def end(self, final: Feedback | None = None) -> None:
        if self._store is not None:
            self._store.add(self._doc.tokens[self._prompt_len :])
            if self._sizes:
                self.info = {
                    "suffix": {
                        "tree_tokens_mean": round(sum(self._sizes) / len(self._sizes), 2),
                        "store_tokens": self._store.tokens,
                    }
                }

    def _acc(self, sit: int) -> Acceptance:
        if sit not in self._acceptance:
            known = self._memory.get((self.name, sit)) if self._memory is not None else None
            self._acceptance[sit] = Acceptance(self.max_nodes, GAMMA, *(known.as_prior() if known is not None else ()))
        return self._acceptance[sit]

    def _best(self, tree: ScoredTree) -> tuple[int, float]:
        """(nodes to send, expected tokens per ms) for the best prefix of `tree`'s order."""
        if self.total is not None:
            return len(tree.tokens), float(len(tree.tokens))
        best_n, best = 0, self.margin / self._costs.target(1)
        expected = 1.0
        for n, p in enumerate(tree.probs, start=1):
            expected += p
            rate = expected / self._costs.target(n + 1)
            if rate > best:
                best_n, best = n, rate
        return best_n, best

    def _matches(self) -> list[_Candidate]:
        """This step's candidates, longest match first (kept until the text grows)."""
        toks = self._doc.tokens
        if self._cached[0] != len(toks):
            cands = _candidates(self._doc, toks, self.max_match)
            if self._shared is not None:
                cands += self._shared.candidates(toks, self.max_match)
            cands.sort(key=lambda c: -c.match)  # (stable: the most recent first among equals)
            self._cached = (len(toks), cands)
        return self._cached[1]

    def _chain(self, k: int) -> tuple[int, list[int]]:
        """(match-length bucket, the most likely continuation of up to k tokens) after the
        longest match: what it drafts as a chain (`chain_only`: auto sizes k itself)."""
        cands = self._matches()
        if not cands or k <= 0:
            return 0, []
        t = cands[0].match
        tree = build_tree([c for c in cands if c.match >= t][:TREE_CANDIDATES], k, k, self.min_prob, [1.0] * k)
        chain, node = [], -1
        for j, (tok, par) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
            if par == node:  # (best first: a node's first child listed is its most likely)
                chain.append(tok)
                node = j
        return situation(t), chain

    def tree(self, k: int) -> tuple[int, ScoredTree]:
        """(match-length bucket, the best-first tree of depth <= k after the longest match, each
        node with its chance of acceptance): what auto verifies beside another drafter's chain,
        sized by its own cost model. Nothing is proposed until `take`."""
        cands = self._matches()
        if not cands or k <= 0:
            return 0, ScoredTree([], [], [])
        return self._tree_at(cands, cands[0].match, k)

    def _tree_at(self, cands: list[_Candidate], t: int, k: int) -> tuple[int, ScoredTree]:
        """(bucket, the best-first tree of depth <= k) from the candidates matching >= t tokens."""
        sit = situation(t)
        # (a deeper position is never more likely to be reached than a shallower one)
        alpha = list(itertools.accumulate(self._acc(sit).alpha(), min))
        cap = min(self.max_nodes, max(1, math.floor(self.factor * t)))
        return sit, build_tree([c for c in cands if c.match >= t][:TREE_CANDIDATES], k, cap, self.min_prob, alpha)

    def take(self, sit: int, tree: ScoredTree, n: int) -> None:
        """The first n nodes of `tree` (from `tree`) went to the target as this drafter's
        proposal: its feedback follows with `accepted`, in the indices of `tree`."""
        self._situation, self._proposal = sit, tree.tokens[:n]
        self._depth = Draft(torch.zeros(n, dtype=torch.long), None, parents=tree.parents[:n]).depth() if n else 0
        if n:
            self._sizes.append(n)

    def offer(self, k: int, est: Estimates) -> Offer | None:
        """Its own tree (`sized_tree`), the deepest k; under auto as a chain (`chain_only`), a chain
        whose situation is the match-length bucket. Lookups are free."""
        if self.chain_only:
            sit, chain = self._chain(k)
            return est.chain(self.name, sit, len(chain), 0.0) if chain else None
        sit, tree, _ = self.sized_tree(k)
        if not tree.tokens:
            return None
        rows, tokens = est.others  # (priced on the batch's pass, as every offer)
        return Offer(
            self.name,
            k,
            tokens + 1.0 + sum(tree.probs),
            est.costs.rows(int(rows) + len(tree.tokens) + 1),
            sit,
            tree=tree,
        )

    def catch_up(self, tokens: list[int], feedback: Feedback | None = None) -> None:
        """Tokens committed without this drafter's tree; where it had planned one for this
        step (it offered it, and another member or a plain step took the step), what the tree
        would have kept of them is learned as if it had been verified (`unsent`)."""
        key, (sit, tree, _) = self._planned
        if key[0] == len(self._doc.tokens) and tree.tokens and tokens:
            self._learn(sit, *unsent(tree.tokens, tree.parents, tokens))
        self._doc.extend(tokens)
        self._proposal = []

    def propose(self, k: int) -> Draft:
        if self.chain_only:
            self._situation, chain = self._chain(k)
            self._proposal, self._depth = chain, len(chain)
            return Draft(torch.tensor(chain, dtype=torch.long, device=self._device))
        sit, chosen, _ = self.sized_tree(k)
        self._planned = ((-1, -1), self._planned[1])  # (a plan serves one proposal)
        self._situation = sit
        draft = Draft(torch.tensor(chosen.tokens, dtype=torch.long, device=self._device), None, parents=chosen.parents)
        self._proposal, self._depth = chosen.tokens, draft.depth()
        if chosen.tokens:
            self._sizes.append(len(chosen.tokens))
        return draft

    def sized_tree(self, k: int) -> tuple[int, ScoredTree, float]:
        """(match-length bucket, the tree it would send now — empty: a plain step —, its
        expected tokens per ms): the best over the few longest match lengths, each tree sized by
        the cost model (kept for the proposal that follows, `propose`)."""
        key = (len(self._doc.tokens), k)
        if self._planned[0] == key:
            return self._planned[1]
        cands = self._matches()
        best: tuple[int, ScoredTree, float] = (0, ScoredTree([], [], []), -1.0)
        if cands and k > 0:
            for t in sorted({c.match for c in cands}, reverse=True)[:THRESHOLDS]:
                sit, tree = self._tree_at(cands, t, k)
                n, rate = self._best(tree)
                if n and rate > best[2]:
                    best = (sit, ScoredTree(tree.tokens[:n], tree.parents[:n], tree.probs[:n]), rate)
        self._planned = (key, best)
        return best

    def accepted(self, feedback: Feedback) -> None:
        if self._proposal:
            self._learn(self._situation, self._depth, feedback.num_accepted)
        self._doc.extend([*(self._proposal[j] for j in feedback.path), feedback.next_token])
        self._proposal = []

    def _learn(self, sit: int, proposed: int, accepted: int) -> None:
        self._acc(sit).update(proposed, accepted)
        if self._memory is not None:
            remember(self._memory, (self.name, sit), self.max_nodes, proposed, accepted)
