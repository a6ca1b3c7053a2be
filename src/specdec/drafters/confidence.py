"""How deep a draft model drafts, from its own confidence (DISCO, Mamou et al. 2024; SpecDec++,
Huang et al. 2024; Hugging Face's `assistant_confidence_threshold`).

A draft token the draft gave probability c is accepted by the target (given its predecessors were)
with a chance a(c), learned from verified steps per bin of c (`Calibration`, prior a(c) = c). After
j drafts whose chances are a_1..a_j, the step is expected to commit E_j = 1 + P_1 + ... + P_j tokens
(P_i = a_1 ... a_i: all of the first i accepted) in C_j = j * draft_ms + pass(1 + j) ms. One more
draft adds P_j * a_next tokens (a_next: `Calibration.next_after`) for draft_ms and one more row of
the target's pass (`keep_drafting`): the draft goes on while that raises the step's tokens per
millisecond. The pass table (`specdec.costs.pass_costs`) prices the rows, so where a few rows cost
what one does the draft runs deeper for the same confidence.

Exactness: whether a draft position exists depends only on the draft's own probabilities of
the tokens before it — on the committed prefix when verification reaches that position —
never on the target or on verification's draws; each position is verified by the same exact
rule, so greedy output and the sampled distribution are those of plain decoding (tested).
"""

from __future__ import annotations

from typing import Any

from ..offers import StepRecord
from .base import Option

BINS = 10
PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior a(c) = c in each bin
PRIOR_MEAN = 0.6  # the prior of `Calibration.mean` (offers.PRIOR_ALPHA)
MEMORY = 4000.0  # verified positions a calibration weighs at most (older ones fade by halving)

CONFIDENCE_OPTION = Option(
    "confidence",
    "the draft stops where its own confidence says one more token would not pay "
    "(priced by the target's pass table; exact either way; 0 = always k)",
    "--draft-confidence",
)
TREE_OPTION = Option(
    "tree",
    "the draft grows a token tree where it is torn between tokens, by the same pricing "
    "(verified by the exact tree rules; 0 = a chain)",
    "--draft-tree",
)


class Calibration:
    """a(c): the chance that a draft token of draft probability c is accepted, given the
    tokens before it were; per bin of c, counts of verified draft positions, shrunk to a(c) = c."""

    def __init__(self) -> None:
        self.proposed = [0.0] * BINS
        self.accepted = [0.0] * BINS
        # what the steps of the draft that keeps this calibration committed and cost (kept with
        # it across greedy requests: `offers.StepRecord`)
        self.steps = StepRecord()

    @staticmethod
    def _bin(c: float) -> int:
        return min(max(int(c * BINS), 0), BINS - 1)

    def __call__(self, c: float) -> float:
        b = self._bin(c)
        return (self.accepted[b] + PRIOR_WEIGHT * c) / (self.proposed[b] + PRIOR_WEIGHT)

    def update(self, confidences: list[float], accepted: int) -> None:
        """A verified chain: its drafts' probabilities, the first `accepted` kept. Positions
        past the first rejection were never judged and teach nothing."""
        for i, c in enumerate(confidences[: accepted + 1]):
            b = self._bin(c)
            self.proposed[b] += 1.0
            self.accepted[b] += 1.0 if i < accepted else 0.0
        if sum(self.proposed) > MEMORY:
            self.proposed = [p / 2 for p in self.proposed]
            self.accepted = [a / 2 for a in self.accepted]

    def mean(self) -> float:
        """The chance that a draft is accepted whatever its probability (shrunk to PRIOR_MEAN)."""
        return (sum(self.accepted) + PRIOR_WEIGHT * PRIOR_MEAN) / (sum(self.proposed) + PRIOR_WEIGHT)

    def next_after(self, c: float) -> float:
        """The chance that the next draft is accepted, before it is drafted, after one of
        probability c: halfway between this one's and any draft's. The draft's confidence runs
        in streaks (a sure phrase, then a fork), but one unsure token does not make the next
        one unsure, and stopping on it alone left a chain one token long where the next four
        were accepted (measured on the bundled suite's open-text prompts)."""
        return 0.5 * (self(c) + self.mean())

    def table(self) -> list[float | None]:
        """Each bin's measured acceptance (None: never observed): what a report shows."""
        return [round(a / p, 3) if p else None for a, p in zip(self.accepted, self.proposed, strict=True)]


class Depth:
    """One proposal's running account: the chance that all its drafts so far are accepted and
    the tokens it is expected to commit."""

    def __init__(self) -> None:
        self.j = 0  # drafts so far
        self.all_kept = 1.0  # P_j
        self.expected = 1.0  # E_j (the target's own token included)

    def add(self, a: float) -> None:
        self.j += 1
        self.all_kept *= a
        self.expected += self.all_kept


def keep_drafting(depth: Depth, a_next: float, draft_ms: float, costs: Any) -> bool:
    """Whether one more draft raises the step's expected tokens per millisecond (see the module
    doc). `costs`: the target's pass table (`rows(n)`: ms of a pass over n rows)."""
    j = depth.j
    now = j * draft_ms + costs.rows(1 + j)
    more = (j + 1) * draft_ms + costs.rows(2 + j)
    return (depth.expected + depth.all_kept * a_next) * now > depth.expected * more
