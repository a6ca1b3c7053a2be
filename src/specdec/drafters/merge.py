"""A chain and a deterministic tree in one pass (auto's merge of a member's chain with suffix
decoding's tree): how much of the tree pays beside the chain (`tree_beside`), the trie they make
(`merge`, `merged_draft`) and the feedback each source gets back (`split`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..offers import Offer
from .base import Draft, Feedback, ScoredTree


def tree_beside(
    chain: Offer,
    chances: list[float],
    depth: list[int],
    reach: list[float],
    rows_ms: Callable[[int], float],
    shared: list[bool] | None = None,
) -> tuple[int, float, float]:
    """(nodes, expected tokens, ms) of the best prefix of a tree's best-first order (`chances`,
    `depth` per node) beside `chain`: each node adds its chance where the chain is predicted to
    miss at its depth (`reach`: the chain's alpha_1..k) and costs a row (`rows_ms`: the pass
    time per row count); a node the chain proposes already (`shared`: the same tokens from the
    root) adds neither."""
    rows = base = 1 + chain.k
    best = (0, chain.tokens, chain.ms)
    tokens = chain.tokens
    for j, (p, d) in enumerate(zip(chances, depth, strict=True), start=1):
        if shared is not None and shared[j - 1]:
            continue
        rows += 1
        tokens += p * (1.0 - (reach[d - 1] if d <= len(reach) else 0.0))
        ms = chain.ms - rows_ms(base) + rows_ms(rows)
        if tokens / ms > best[1] / best[2]:
            best = (j, tokens, ms)
    return best


def merged_draft(chain: Draft, tree: ScoredTree, n: int) -> tuple[Merged, Draft]:
    """The chain and the tree's first n nodes as one draft: a tree of point masses, with the
    chain's q on its nodes where the chain was drawn (the mixed rule, `verify.tree_mixed_sample`)."""
    merged = merge(chain.tokens.tolist(), chain.probs is not None, tree.tokens[:n], tree.parents[:n])
    draft = Draft(torch.tensor(merged.tokens, dtype=torch.long, device=chain.tokens.device), None, merged.parents)
    if chain.probs is not None:
        q = chain.probs.new_zeros(len(merged.tokens), chain.probs.shape[-1])
        q[merged.chain] = chain.probs
        draft.probs, draft.attempts = q, merged.attempts
    return merged, draft


def split(feedback: Feedback, m: Merged, committed: list[int]) -> tuple[tuple[Feedback, list[int]], ...]:
    """What a merged pass tells each source: (its own feedback, the committed tokens after it
    that it must catch up on), the chain's first, then the tree's."""
    n = along(feedback.path, m.chain)
    own = {j: o for o, j in enumerate(m.tree)}
    path_t = [own[j] for j in itertools.takewhile(lambda j: j in own, feedback.path)]
    t = len(path_t)
    return (
        (part(feedback, list(range(n)), m.chain[:n], committed[n]), committed[n + 1 :]),
        (part(feedback, path_t, [m.tree[o] for o in path_t], committed[t]), committed[t + 1 :]),
    )


def chain_part(final: Feedback, m: Merged) -> Feedback:
    """The finishing pass as the chain's source hears it (`end`)."""
    n = along(final.path, m.chain)
    return replace(part(final, list(range(n)), m.chain[:n], final.next_token), kept=min(n, final.kept or 0))


@dataclass
class Merged:
    """A chain and a tree merged as a trie (`merge`)."""

    tokens: list[int]  # [K] the trie's nodes, parents first
    parents: list[int]  # [K]
    chain: list[int]  # the chain's tokens' nodes, in order
    tree: list[int]  # the tree's nodes' nodes, in the tree's order
    attempts: list[tuple[int, bool]]  # each node's attempts in the order tried at its parent: the chain's first


def merge(chain: list[int], drawn: bool, tokens: list[int], parents: list[int]) -> Merged:
    """The trie of a chain (drawn from a draft model's q, or deterministic) and a deterministic
    tree (`tokens`, `parents`, parents first): a path both propose is one node. A node the chain
    drew and the tree fixes is tried twice (drawn, then fixed: the mixed rule may drop neither);
    one both fix, once."""
    out = Merged([], [], [], [], [])
    at: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tried: set[tuple[int, bool]] = set()

    def node(parent: int, token: int, sampled: bool) -> int:
        j = at.get((parent, token))
        if j is None:
            j = at[(parent, token)] = len(out.tokens)
            out.tokens.append(token)
            out.parents.append(parent)
        if (j, sampled) not in tried:
            tried.add((j, sampled))
            out.attempts.append((j, sampled))
        return j

    parent = -1
    for token in chain:
        parent = node(parent, token, drawn)
        out.chain.append(parent)
    for token, p in zip(tokens, parents, strict=True):
        out.tree.append(node(-1 if p < 0 else out.tree[p], token, False))
    return out


def depths(parents: list[int]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def on_chain(chain: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> list[bool]:
    """Which of a tree's nodes (parents first) a chain proposes already: the same tokens from
    the root."""
    on: list[bool] = []
    for token, p, d in zip(tokens, parents, depths, strict=True):
        on.append((p < 0 or on[p]) and d <= len(chain) and chain[d - 1] == token)
    return on


def along(path: list[int], nodes: list[int]) -> int:
    """How many first items of the two agree: of an accepted path, a chain's accepted part; of
    two token lists, the prefix they share (`cross`: the draft's cache rows that still stand)."""
    n = 0
    while n < min(len(path), len(nodes)) and path[n] == nodes[n]:
        n += 1
    return n


def part(feedback: Feedback, path: list[int], nodes: list[int], next_token: int) -> Feedback:
    """The feedback one source of a merged tree gets: its own accepted nodes (`path`, in its
    proposal's indices; `nodes`: theirs in the merged tree) and the token after them, with the
    target's rows on that path."""
    rows = [0] + [j + 1 for j in nodes]
    return Feedback(
        path,
        next_token,
        feedback.logits[rows],
        hidden=feedback.hidden[rows] if feedback.hidden is not None else None,
        layers={i: h[rows] for i, h in feedback.layers.items()},
    )
