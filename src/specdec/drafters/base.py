"""The drafter protocol and registry.

A drafter's whole life (as in llama.cpp's common/speculative.h): `begin` with the committed
tokens, `propose` k tokens, be told how many were `accepted` (plus the target's own next
token) so it can roll its own state back. Each drafter lives in its own module and
registers itself by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..config import SamplingParams


@dataclass
class ExtraRows:
    """Rows a drafter has the target score in the verification pass for its own use (the
    lookahead branch of lookahead decoding). They are never committed, and no draft node
    attends to them."""

    tokens: torch.Tensor  # [B, R]
    offsets: torch.Tensor  # [R] int64 position of each row relative to the last committed token (>= 1)
    mask: torch.Tensor  # [R, R] bool among the rows, lower-triangular; every row also sees the
    # committed context and the last committed token


@dataclass
class Draft:
    """What a drafter proposes for one verification pass.

    A chain (the default): `tokens` continue the last committed token one after another. A
    token tree: `parents[j]` is the index of node j's parent among the draft tokens (-1: the
    last committed token), parents before children, siblings with distinct tokens, best first.
    """

    tokens: torch.Tensor  # [B, K] proposed token ids (K may be 0)
    probs: torch.Tensor | None  # [B, K, V] q the tokens were drawn from; None: deterministic (point mass)
    parents: list[int] | None = None  # token tree (B = 1, point masses); None: a chain
    extra: ExtraRows | None = None  # scored in the same pass; logits go to the drafter's `scored_extra`
    # Self-speculation: the drafter already ran blocks [0, from_layer) of the target for the
    # last committed token and every draft token (writing their KV in the target's cache);
    # `hidden` is the residual entering block `from_layer`, and verification runs the rest.
    hidden: torch.Tensor | None = None  # [B, K+1, D]
    from_layer: int = 0

    def depths(self) -> list[int]:
        """Each draft node's depth (1: a child of the last committed token); checks that
        parents come before their children."""
        if self.parents is None:
            return list(range(1, int(self.tokens.shape[1]) + 1))
        depths: list[int] = []
        for j, p in enumerate(self.parents):
            if not -1 <= p < j:
                raise ValueError(f"tree node {j} has parent {p}; parents must come before their children (or be -1)")
            depths.append(1 + (depths[p] if p >= 0 else 0))
        return depths

    def depth(self) -> int:
        """Length of the longest root-to-leaf path (K for a chain)."""
        return max(self.depths(), default=0)


@dataclass
class DraftSession:
    """What every drafter is told at `begin`."""

    context: torch.Tensor  # [B, T] all committed tokens (prompt + first generated token)
    capacity: int  # the most tokens the sequence (plus drafts) can reach
    sampling: SamplingParams
    generator: torch.Generator  # the drafter's own, seeded
    target: Any = None  # the target Transformer (drafters that share its weights check it)
    target_cache: Any = None  # the target's KVCache (self-speculation writes its early blocks' KV there)


@runtime_checkable
class Drafter(Protocol):
    name: str
    forwards: int  # model forward calls made so far (0 for model-free drafters)

    def begin(self, session: DraftSession) -> None: ...

    def propose(self, k: int) -> Draft: ...

    def accepted(self, num_accepted: int, next_token: int) -> None:
        """The first `num_accepted` tokens of the last proposal were kept, then `next_token`.
        Tree drafters also get ``path=`` (a keyword): the accepted nodes' indices, root first.
        Drafters that return `Draft.extra` also implement ``scored_extra(logits [B, R, V])``,
        called after the verification pass and before `accepted`, and drafters whose passes
        hold more rows than k + 1 (trees, extra rows) set ``scratch_rows``: the most extra
        cache slots a pass needs."""
        ...


DRAFTERS: dict[str, Callable[..., Drafter]] = {}


def register(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if name in DRAFTERS:
            raise ValueError(f"drafter {name!r} registered twice")
        DRAFTERS[name] = cls
        cls.name = name
        return cls

    return deco


def point_mass(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q for a deterministic draft: one-hot rows. tokens [B, K] -> [B, K, V]."""
    return torch.nn.functional.one_hot(tokens, vocab_size).float()
