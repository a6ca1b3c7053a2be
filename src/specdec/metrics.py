"""Per-generation measurements."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Metrics:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose rows an earlier sequence had computed (not prefilled again)
    new_tokens: int = 0
    wall_time: float = 0.0  # seconds, prefill included
    prefill_time: float = 0.0  # target (and drafter) prefill
    target_forwards: int = 0  # decode/verify passes of the target, prefill excluded
    target_time: float = 0.0
    draft_forwards: int = 0
    draft_time: float = 0.0
    steps: int = 0  # speculative steps (one target verify pass each)
    proposed: int = 0  # draft tokens offered for verification
    accepted: int = 0  # draft tokens accepted
    step_tokens: int = 0  # tokens committed by speculative steps (accepted + 1 each)
    # rows the target scored in verification passes (last token, drafts, tree branches, extra rows)
    scored_rows: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafter_info: dict[str, Any] = field(default_factory=dict)  # what the drafter chose (e.g. early-exit's layer)
    k: int | None = None  # draft tokens per step asked for
    k_source: str | None = None  # "given", "tuned" (specdec bench --tune) or "default"
    exact: bool = True  # False: drafts were verified by a lossy rule (typical acceptance)
    # the decode/verify passes' times by the rows they scored (the whole batch's pass), ms
    pass_ms: dict[int, list[float]] = field(default_factory=dict)

    def record_pass(self, rows: int, ms: float) -> None:
        self.pass_ms.setdefault(rows, []).append(ms)

    @property
    def draft_ms_per_token(self) -> float | None:
        """What drafting cost per draft token proposed (catching up included), ms."""
        return 1e3 * self.draft_time / self.proposed if self.proposed else None

    @property
    def target_ms_by_rows(self) -> dict[int, dict[str, float]]:
        """Per row count of the target's passes: how many, and their median time (ms)."""
        return {r: {"passes": len(ms), "ms": round(statistics.median(ms), 3)} for r, ms in sorted(self.pass_ms.items())}

    def record_step(self, k: int, num_accepted: int) -> None:
        self.steps += 1
        self.proposed += k
        self.accepted += num_accepted
        self.step_tokens += num_accepted + 1
        grow = k - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(k):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    @property
    def acceptance_rate(self) -> float | None:
        """alpha: accepted draft tokens / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """tau: tokens committed per target verification pass (accepted drafts + the target's own)."""
        return self.step_tokens / self.steps if self.steps else None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decode = self.wall_time - self.prefill_time
        return self.new_tokens / decode if decode > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["pass_ms"]  # (as target_ms_by_rows)
        for name in (
            "acceptance_rate",
            "mean_accepted_tokens",
            "tokens_per_second",
            "decode_tokens_per_second",
            "draft_ms_per_token",
            "target_ms_by_rows",
        ):
            d[name] = getattr(self, name)
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timer(device: torch.device) -> Iterator[list[float]]:
    """Yields a one-element list that holds the elapsed seconds on exit (device-synchronised)."""
    _sync(device)
    box = [0.0]
    start = time.perf_counter()
    try:
        yield box
    finally:
        _sync(device)
        box[0] = time.perf_counter() - start
