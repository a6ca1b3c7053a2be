"""Predict a method's speedup from measured costs and measured acceptance, and pick k.

The expected-tokens argument of Leviathan et al. (2022): a step that offers k drafted
tokens yields 1 + sum_i P(the first i drafts are all accepted) tokens and costs the
drafting plus one target pass over the offered rows. With measured per-position
acceptance (how often position i was accepted, over all steps) and measured pass times per
row count, the predicted speedup for k is

    S(k) = (1 + sum_{i<k} A_i) * t(1) / (D(k) + t(1 + sum_{i<k} P_i))

where A_i = steps whose position i was accepted / steps, P_i = steps that offered a token at
position i / steps, t(r) the target's time for a pass over r rows (interpolated) and D(k)
the drafting time: what the runs measured per drafted token (`draft_ms_per_token`: a draft
model's steps and catching up, heads' calls, auto's drafters as it chose them), else a draft
model's stored one-token step. Beyond the measured positions the curve is
extended geometrically with the last measured ratio A_i / A_{i-1} (i.i.d. acceptance: the
formula E = (1 - a^(k+1)) / (1 - a)). Extra rows a drafter adds (lookahead's window) are
taken from the measured rows per pass.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ..costs import PRICED_K, Costs
from ..drafters.base import needs_draft_model


@dataclass
class Acceptance:
    """Pooled over a set of runs: per-position counts, steps and rows per pass."""

    steps: int
    accepted: list[int]  # accepted_per_position summed
    proposed: list[int]  # proposed_per_position summed
    extra_rows: float = 0.0  # rows per pass beyond 1 + drafted tokens (tree branches, lookahead window)
    draft_ms: float | None = None  # measured drafting time per proposed token (None: not recorded)

    @classmethod
    def pool(cls, records: list[dict[str, Any]]) -> Acceptance:
        steps = sum(r["steps"] for r in records)
        depth = max((len(r["proposed_per_position"]) for r in records), default=0)
        acc = [
            sum(r["accepted_per_position"][i] for r in records if i < len(r["accepted_per_position"]))
            for i in range(depth)
        ]
        prop = [
            sum(r["proposed_per_position"][i] for r in records if i < len(r["proposed_per_position"]))
            for i in range(depth)
        ]
        rows = sum(r["scored_rows"] for r in records) / steps if steps else 1.0
        extra = max(0.0, rows - 1 - sum(prop) / steps) if steps else 0.0
        timed = [r for r in records if r.get("draft_ms_per_token") is not None and r["proposed"]]
        draft = (
            sum(r["draft_ms_per_token"] * r["proposed"] for r in timed) / sum(r["proposed"] for r in timed)
            if timed
            else None
        )
        return cls(steps, acc, prop, extra, draft)

    def per_step(self, k: int) -> tuple[list[float], list[float]]:
        """(A_i, P_i) for i < k, extended past the measured positions."""
        if not self.steps:
            return [0.0] * k, [0.0] * k
        A = [a / self.steps for a in self.accepted]
        P = [p / self.steps for p in self.proposed]
        while len(A) < k:
            if len(A) >= 2 and A[-2] > 0:
                ratio = A[-1] / A[-2]
            else:
                ratio = A[-1] if A else 0.0
            A.append(A[-1] * ratio if A else 0.0)
            P.append(P[-1] if P else 0.0)
        return A[:k], P[:k]


def predict(method: str, k: int, acc: Acceptance, costs: Costs) -> float:
    """Predicted speedup over plain decoding for drafts of up to k tokens."""
    A, P = acc.per_step(k)
    tokens = 1 + sum(A)
    rows = 1 + sum(P) + acc.extra_rows
    per_token = acc.draft_ms if acc.draft_ms is not None else costs.draft_ms if needs_draft_model(method) else None
    draft = (per_token or 0.0) * sum(P)
    return tokens * costs.target(1) / (draft + costs.target(rows))


@dataclass
class Recommendation:
    method: str
    temperature: float
    category: str
    measured_k: int
    measured_speedup: float | None
    predicted_speedup: float  # at the measured k
    best_k: int
    best_predicted: float
    by_k: dict[int, float] = field(default_factory=dict)


def recommend(
    method: str, temperature: float, category: str, records: list[dict[str, Any]], costs: Costs, k_used: int
) -> Recommendation:
    acc = Acceptance.pool(records)
    by_k = {k: predict(method, k, acc, costs) for k in range(1, PRICED_K + 1)}
    best = max(by_k, key=lambda k: by_k[k])
    speeds = [r["speedup"] for r in records if r.get("speedup") is not None]
    return Recommendation(
        method,
        temperature,
        category,
        k_used,
        statistics.median(speeds) if speeds else None,
        predict(method, k_used, acc, costs),
        best,
        by_k[best],
        by_k,
    )
