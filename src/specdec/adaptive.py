"""Each step's draft length from what the request has shown so far (`adaptive_k`).

The expected-tokens cost model, online, per sequence. After every step the controller knows,
discounted by `gamma` per new observation so that a change of topic within a request is
followed:

* alpha_j, the chance that a proposal reaching position j has its token j accepted (which
  implies 1..j-1 were): accepted-at-j / proposed-at-j, with a weak prior;
* the drafter's cost per drafted token (its measured time per step / the k it was asked for);
* the target's pass time per row count on this machine (`specdec.costs.pass_costs`).

A step with k drafts is expected to commit E(k) = 1 + alpha_1 + ... + alpha_k tokens in
k * draft_ms + pass(1 + k) ms; plain decoding commits 1 in pass(1). The controller picks the k
in 0..k_max with the most tokens per millisecond — 0 (a plain step, no drafting) whenever no
k beats plain decoding by `margin` (3%: the estimates are noisy, and a step that drafts in
vain costs more than a plain step that could have drafted). After `probe_after` plain steps in a row it drafts one token (k = 1)
so the estimates can recover; each probe that finds nothing doubles the wait, up to 64.

Exactness: the choice depends only on steps already verified, never on the step's own draws,
and each step is verified by the same exact rule whatever its k; greedy output and the sampled
distribution are those of plain decoding (tested, with switching, and with a wrong rule as a
negative control).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .costs import Costs

PRIOR_WEIGHT = 1.0  # pseudo-proposals behind the prior alpha_j = PRIOR_ALPHA ** j
PRIOR_ALPHA = 0.6
MAX_PROBE_WAIT = 64


class KController:
    """Chooses each step's k for one sequence (see the module doc)."""

    def __init__(self, k_max: int, costs: Costs, gamma: float = 0.9, probe_after: int = 4,
                 margin: float = 1.03) -> None:  # fmt: skip
        if k_max < 1 or not 0 < gamma <= 1 or margin < 1:
            raise ValueError("k_max must be >= 1, gamma in (0, 1] and margin >= 1")
        self.k_max, self.costs, self.gamma, self.margin = k_max, costs, gamma, margin
        self.proposed = [0.0] * k_max  # discounted proposals that reached position j+1
        self.accepted = [0.0] * k_max  # ...whose token j+1 was accepted
        self.draft_ms: float | None = None  # per drafted token (EMA); None until measured
        self.first_probe_wait = probe_after
        self.wait = probe_after
        self.plain_run = 0
        self.chosen: Counter[int] = Counter()

    def alpha(self) -> list[float]:
        return [(a + PRIOR_WEIGHT * PRIOR_ALPHA ** (j + 1)) / (p + PRIOR_WEIGHT)
                for j, (a, p) in enumerate(zip(self.accepted, self.proposed, strict=True))]  # fmt: skip

    def rate(self, k: int) -> float:
        """Expected tokens per millisecond of a step with k drafts."""
        expected = 1.0 + sum(self.alpha()[:k])
        return expected / ((self.draft_ms or 0.0) * k + self.costs.target(1 + k))

    def best(self) -> int:
        """The k with the most expected tokens per millisecond; 0 (plain decoding) unless a
        k beats it by the margin."""
        rates = [self.rate(k) for k in range(self.k_max + 1)]
        k = max(range(1, self.k_max + 1), key=lambda k: (rates[k], -k))
        return k if rates[k] > self.margin * rates[0] else 0

    def choose(self) -> int:
        """This step's k (call once per step)."""
        if self.draft_ms is None:
            k = self.k_max  # the drafter's cost is not measured yet: draft once to measure it
        else:
            k = self.best()
            if k == 0:
                self.plain_run += 1
                if self.plain_run > self.wait:  # probe: one drafted token refreshes the estimates
                    self.plain_run = 0
                    self.wait = min(MAX_PROBE_WAIT, 2 * self.wait)
                    k = 1
            else:
                self.plain_run = 0
                self.wait = self.first_probe_wait
        self.chosen[k] += 1
        return k

    def update(self, asked: int, proposed: int, accepted: int, draft_ms: float) -> None:
        """A verified step: asked for `asked` drafts, got `proposed`, `accepted` of them kept."""
        if asked > 0:
            per_token = draft_ms / asked
            self.draft_ms = per_token if self.draft_ms is None else 0.7 * self.draft_ms + 0.3 * per_token
        if proposed == 0:
            return  # nothing proposed (e.g. no match for prompt lookup): no evidence about acceptance
        # forget only where there is new evidence: a position k no longer reaches keeps its
        # estimate (decaying it would drag it to the prior and keep k short for no reason)
        for j in range(min(proposed, self.k_max)):
            self.proposed[j] = self.gamma * self.proposed[j] + 1.0
            self.accepted[j] = self.gamma * self.accepted[j] + (1.0 if j < accepted else 0.0)

    def report(self) -> dict[str, Any]:
        return {"k_chosen": dict(sorted(self.chosen.items())), "alpha_by_position": [round(a, 3) for a in self.alpha()],
                "draft_ms_per_token": None if self.draft_ms is None else round(self.draft_ms, 3)}  # fmt: skip
