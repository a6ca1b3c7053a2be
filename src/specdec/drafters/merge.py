"""Trees merged for one pass: a chain and a deterministic tree as one trie (auto's merge of a
chosen chain with suffix decoding's tree), and the feedback each source gets back."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Feedback


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
    """How many of the accepted path's first nodes are `nodes`' first (a chain's accepted part)."""
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
