"""The drafter protocol and registry.

A drafter's whole life (as in llama.cpp's common/speculative.h): `begin` with the committed
tokens, `propose` k tokens, be told how many were `accepted` (plus the target's own next
token) so it can roll its own state back. Each drafter lives in its own module and
registers itself by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..config import SamplingParams


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, K] proposed token ids (K may be 0)
    probs: torch.Tensor | None  # [B, K, V] q the tokens were drawn from; None: deterministic (point mass)


@dataclass
class DraftSession:
    """What every drafter is told at `begin`."""

    context: torch.Tensor  # [B, T] all committed tokens (prompt + first generated token)
    capacity: int  # the most tokens the sequence (plus drafts) can reach
    sampling: SamplingParams
    generator: torch.Generator  # the drafter's own, seeded


@runtime_checkable
class Drafter(Protocol):
    name: str
    forwards: int  # model forward calls made so far (0 for model-free drafters)

    def begin(self, session: DraftSession) -> None: ...

    def propose(self, k: int) -> Draft: ...

    def accepted(self, num_accepted: int, next_token: int) -> None:
        """The first `num_accepted` tokens of the last proposal were kept, then `next_token`."""
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
