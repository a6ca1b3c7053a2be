"""An offer and its price: what one member would do on this step and what that is worth.

An `Offer` is a chain of k tokens or a tree, the tokens it expects the step to commit (the
target's own included) and the ms it expects the step to cost (drafting, the target's pass over
its rows, a share of catching up); its rate is tokens per ms. `Estimates` prices the offers of
one sequence: the position model (`Acceptance`, alpha_j per member and situation), a
self-sizing member's record (`StepRecord`), draft costs, the pass table and the pool's memory.
Which offer a step takes is `specdec.adaptive`'s rule.

Exact: every estimate is built from verified steps only (and from proposals that did not go,
counted as their verification would have counted them: `unsent`); a seeded sampled request
(`reproducible`) prices from stored numbers only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from .costs import Costs

PRIOR_WEIGHT = 1.0  # pseudo-proposals behind the prior alpha_j = PRIOR_ALPHA ** j
PRIOR_ALPHA = 0.6
# alpha_1 of a model (a draft, a head) that neither this request nor earlier ones on this machine
# have measured: what it plausibly reaches (a same-family draft's is 0.8-0.95), not a pessimistic
# guess. Explored at that price, it is tried in a request's first steps where it would pay at
# it; one pseudo-proposal behind it, its first verified steps replace it.
EXPLORE_ALPHA = 0.85
MEMORY_PRIOR_WEIGHT = 4.0  # the most pseudo-proposals earlier requests' estimate weighs (`Acceptance.as_prior`)
MEMORY_GAMMA = 0.99  # discount per new observation in the memory kept across requests (~100 proposals)
GAMMA = 0.9  # discount per new observation within a request (a change of topic is followed)
# a member's record follows its steps over ~5 steps (a sure phrase runs eight deep, a fork stops at one)
RECORD_WEIGHT = 0.2
OUTLIER = 2.0  # a step's drafting counts at most this many times the member's estimate
MEMORY_STEP_WEIGHT = 0.05  # a step's weight in the record kept across requests (`StepRecord`): ~20 steps
PLAIN = "plain"


@dataclass(frozen=True)
class Offer:
    """One member's best proposal on this step, priced before it is made."""

    member: str  # PLAIN for a plain step
    k: int  # a chain's tokens, or the deepest a proposal may go (a tree; a member that stops short itself)
    tokens: float  # expected tokens the step commits (the target's own included)
    ms: float  # expected ms of the step: drafting, the target's pass, a share of catching up
    situation: Hashable = ""  # where the acceptance it was priced by comes from
    tree: Any = None  # a tree member's tree (`drafters.base.ScoredTree`) that goes out with it
    merged: int = 0  # nodes of the tree member's tree that go out beside this chain (auto's merge)
    catch_up_ms: float = 0.0  # what catching up first costs (all of it; `ms` carries a share)
    draft_ms: float = 0.0  # its draft cost per token as priced (what a reproducible step counts)
    most: int = 0  # the longest chain it could have offered (`k` is the best of them)
    # a model-free chain's tokens, known before drafting: what a step that did not send it would
    # have kept of it is learned from too (`unsent`)
    chain: tuple[int, ...] = ()

    @property
    def rate(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else float("inf")

    def row(self) -> list[Any]:
        """The offer as the step log keeps it: [member, k, tokens, ms, merged nodes, catch-up ms]."""
        return [self.member, self.k, round(self.tokens, 3), round(self.ms, 3), self.merged, round(self.catch_up_ms, 3)]


class Acceptance:
    """alpha_j, the discounted chance that a proposal reaching draft position j has its token
    j accepted, for j = 1..k_max, with a weak prior (`prior`: what earlier requests measured
    for these positions)."""

    def __init__(
        self, k_max: int, gamma: float, prior: list[float] | None = None, weight: list[float] | None = None
    ) -> None:
        self.gamma = gamma
        self.prior = prior or []
        self.weight = weight or []  # pseudo-proposals behind each position's prior (PRIOR_WEIGHT where not given)
        self.proposed = [0.0] * k_max  # discounted proposals that reached position j+1
        self.accepted = [0.0] * k_max  # ...whose token j+1 was accepted

    def alpha(self) -> list[float]:
        """Each position's estimate shrinks to a prior: earlier requests' estimate where there
        is one, else a geometric one — PRIOR_ALPHA at position 1, then the previous position's
        estimate times alpha_1 (the model of Leviathan et al.), so a position that was never
        proposed is predicted from those that were."""
        out: list[float] = []
        for j, (a, p) in enumerate(zip(self.accepted, self.proposed, strict=True)):
            prior = self.prior[j] if j < len(self.prior) else out[-1] * out[0] if out else PRIOR_ALPHA
            w = self.weight[j] if j < len(self.weight) else PRIOR_WEIGHT
            out.append((a + w * prior) / (p + w))
        return out

    def as_prior(self) -> tuple[list[float], list[float]]:
        """(alpha_j, weight_j): this estimate as the prior of a new request's. Each position
        weighs what it measured, up to MEMORY_PRIOR_WEIGHT proposals and never less than
        PRIOR_WEIGHT: with one pseudo-proposal behind a prior that many proposals measured, a
        request's first lucky draft swung a weak situation's estimate far enough to take steps
        that then committed nothing (docs/results.md, 2026-12-05 third entry)."""
        return self.alpha(), [min(MEMORY_PRIOR_WEIGHT, max(PRIOR_WEIGHT, p)) for p in self.proposed]

    def update(self, proposed: int, accepted: int) -> None:
        # forget only where there is new evidence: a position k no longer reaches keeps its
        # estimate (decaying it would drag it to the prior and keep k short for no reason)
        for j in range(min(proposed, len(self.proposed))):
            self.proposed[j] = self.gamma * self.proposed[j] + 1.0
            self.accepted[j] = self.gamma * self.accepted[j] + (1.0 if j < accepted else 0.0)


class StepRecord:
    """What a member's steps committed and spent: EMAs of tokens, drafted tokens and pass rows per
    step, with `weight` per new step. Kept across greedy requests by a member that keeps what it
    learns (a draft model, with its confidence calibration); a request's record starts from it —
    started from the position model's guess instead, a few unlucky one-token steps early in a
    request ranked a draft model that beat plain decoding over whole requests below plain for the
    rest of the request. It keeps what a step does, not what it cost at the time: priced by the
    machine now (`Estimates.measured`), a record from a moment of load does not keep the member
    out of later requests. Exact as the rest: it holds verified steps only."""

    def __init__(self, weight: float = MEMORY_STEP_WEIGHT) -> None:
        self.weight = weight
        self.step: tuple[float, float, float] | None = None  # (tokens, drafted, rows) per step

    def update(self, tokens: float, drafted: float, rows: float) -> None:
        new = (tokens, drafted, rows)
        w, old = self.weight, self.step or new
        self.step = tuple((1 - w) * a + w * b for a, b in zip(old, new, strict=True))  # type: ignore[assignment]


class Estimates:
    """What one sequence's offers are priced by (see the module doc). `memory`: earlier greedy
    requests' acceptance per (member, situation) (`memory.Memory.acceptance`), read as priors
    and added to — without it every request pays a few failed drafts to learn again that a
    one-token n-gram match is accepted ~20% of the time; None: a fresh start, as a sampled
    request has (a seeded request must give the same answer every time, and its draft lengths
    decide which random numbers its verification draws). `remembered`: the members whose
    acceptance it keeps (those whose proposals depend on the target and the text alone, not on
    a draft model or head another request may not share)."""

    def __init__(
        self,
        costs: Costs,
        k_max: int,
        memory: dict[tuple[str, Hashable], Acceptance] | None = None,
        remembered: Iterable[str] = (),
        reproducible: bool = False,
        history: dict[tuple[str, str], list[list[float]]] | None = None,
    ) -> None:
        self.costs = costs.unscaled() if reproducible else costs
        self.k_max, self.reproducible = k_max, reproducible
        self.memory = memory if memory is not None else {}
        self.remembered = frozenset(remembered)
        # what earlier requests on this machine measured, per (member, str(situation)):
        # [proposed, accepted] per position (`costs.Pricing.past`), the prior where this pool's
        # memory has none
        self.history = history or {}
        self.acceptance: dict[tuple[str, Hashable], Acceptance] = {}
        self.draft_ms: dict[str, float] = {}  # measured ms per drafted token (EMA)
        self.records: dict[str, StepRecord] = {}  # members that size their own proposals: this request's
        self.kept: dict[str, StepRecord] = {}  # ...and the records they keep across requests
        self.remaining: int | None = None  # tokens still to generate (None: unknown)
        self.others: tuple[float, float] = (0, 0.0)  # (rows, tokens) the rest of a batch brings to the pass

    def step(self, remaining: int | None = None, others: tuple[float, float] = (0, 0.0)) -> None:
        """A new step: what is left to generate, and what the rest of the batch brings to the
        same pass (the rates are then the whole pass's, so a sequence's rows are priced at what
        they add to it: where the pass is compute-bound, k shrinks)."""
        self.remaining, self.others = remaining, others

    def plain(self) -> Offer:
        rows, tokens = self.others
        return Offer(PLAIN, 0, tokens + 1.0, self.costs.rows(int(rows) + 1))

    def alpha(self, member: str, situation: Hashable, prior: float | None = None) -> list[float]:
        return self._acc(member, situation, prior).alpha()

    def _acc(self, member: str, situation: Hashable, prior: float | None = None) -> Acceptance:
        key = (member, situation)
        if key not in self.acceptance:
            known = self.memory.get(key) if member in self.remembered else None
            if known is None and (member, str(situation)) in self.history:
                known = Acceptance(self.k_max, GAMMA, [prior] if prior is not None else None)
                known.proposed, known.accepted = (
                    [*c[: self.k_max], *[0.0] * (self.k_max - len(c))] for c in self.history[member, str(situation)]
                )
            first, weight = known.as_prior() if known is not None else ([prior] if prior is not None else None, None)
            self.acceptance[key] = Acceptance(self.k_max, GAMMA, first, weight)
        return self.acceptance[key]

    def counts(self, members: Iterable[str]) -> dict[str, dict[str, list[list[float]]]]:
        """This request's verified counts of `members`, {member: {str(situation): [proposed,
        accepted]}}, the positions it reached: what it adds to the history (`costs.Pricing.keep`)."""
        out: dict[str, dict[str, list[list[float]]]] = {}
        wanted = set(members)
        for (member, situation), acc in self.acceptance.items():
            n = max((j + 1 for j, p in enumerate(acc.proposed) if p > 0), default=0)
            if member in wanted and n:
                out.setdefault(member, {})[str(situation)] = [acc.proposed[:n], acc.accepted[:n]]
        return out

    def draft_cost(self, member: str, stored: float | None) -> float:
        """ms per drafted token of `member` now: measured in this request, else its stored
        estimate (timed at another moment of the machine: it moves with the pass table's scale,
        both being passes over weights on the same cores)."""
        if member in self.draft_ms:
            return self.draft_ms[member]
        return (stored or 0.0) * self.costs.scale

    def _setup(self, catch_up_ms: float, tokens: float) -> float:
        """The share of a catch-up one step carries: spread over the steps the rest of the
        request takes at this step's tokens."""
        if not catch_up_ms or self.remaining is None:
            return 0.0
        return catch_up_ms * tokens / max(self.remaining, 1)

    def chain(
        self,
        member: str,
        situation: Hashable,
        most: int,
        draft_ms: float | None,
        catch_up_ms: float = 0.0,
        prior: float | None = None,
    ) -> Offer | None:
        """A chain member's offer: its best k of at most `most` tokens by the position model
        (None: nothing to propose). `prior`: the member's own alpha_1 for a situation no request
        has measured."""
        if most <= 0:
            return None
        alpha, cost = self.alpha(member, situation, prior), self.draft_cost(member, draft_ms)
        rows, tokens = self.others
        best: Offer | None = None
        expected = tokens + 1.0
        for k in range(1, min(self.k_max, most) + 1):
            expected += alpha[k - 1]
            ms = cost * k + self.costs.rows(int(rows) + 1 + k) + self._setup(catch_up_ms, expected - tokens)
            offer = Offer(
                member, k, expected, ms, situation, catch_up_ms=catch_up_ms, draft_ms=cost, most=min(self.k_max, most)
            )
            if best is None or offer.rate > best.rate:
                best = offer
        return best

    def measured(
        self,
        member: str,
        k: int,
        draft_ms: float | None,
        catch_up_ms: float = 0.0,
        kept: StepRecord | None = None,
        prior: float | None = None,
    ) -> Offer | None:
        """The offer of a member that sizes its own proposals, handed the deepest k: what its
        steps committed and cost (its record, starting from `kept`, earlier requests' record;
        for a reproducible request only this request's). Before it has one, the position
        model's guess, at the guess's own k: a first probe goes no deeper than the position
        model says pays (its price is bounded). In a batch, priced on the batch's pass."""
        if k <= 0:
            return None
        if member not in self.records:
            self.records[member] = StepRecord(RECORD_WEIGHT)
            if kept is not None and not self.reproducible:
                self.kept[member] = kept
                self.records[member].step = kept.step
        step = self.records[member].step
        guess = self.chain(member, "", k, draft_ms, catch_up_ms, prior)
        if guess is None or step is None:
            return guess
        tokens, drafted, rows = step
        others_rows, others_tokens = self.others  # (a batch's pass: the record's rows beside the rest)
        ms = self.draft_cost(member, draft_ms) * drafted + self.costs.rows(max(1, round(others_rows + rows)))
        return replace(guess, k=k, tokens=others_tokens + tokens, ms=ms + self._setup(catch_up_ms, tokens))

    def learn(
        self,
        offer: Offer,
        proposed: int,
        accepted: int,
        draft_ms: float,
        rows: int | None = None,
    ) -> None:
        """A verified step of `offer`'s member: `proposed` tokens in a row (a tree: its depth;
        `rows`: the rows of the pass, None: 1 + proposed), `accepted` of them kept, `draft_ms`
        its measured drafting."""
        member, sized = offer.member, offer.member in self.records
        if offer.tree is not None or proposed <= 0:
            return  # (a tree member learns from its trees itself; a step without drafts shows nothing)
        per = proposed if sized else max(offer.k, 1)  # (a sized member drafts fewer than k)
        if self.reproducible:
            spent = offer.draft_ms * per
        elif member not in self.draft_ms and not offer.draft_ms:  # nothing known before: taken whole
            spent = draft_ms
            self.draft_ms[member] = spent / per
        else:
            # one step's drafting moves the estimate by at most a doubling: a first call's
            # allocation or a moment of load is not the member's cost
            old = self.draft_ms.get(member, offer.draft_ms)  # (as priced: the stored estimate, scaled)
            spent = min(draft_ms, OUTLIER * old * per) if old > 0 else draft_ms
            self.draft_ms[member] = 0.7 * old + 0.3 * spent / per
        if sized:
            step = (accepted + 1.0, float(proposed), float(rows if rows is not None else 1 + proposed))
            record = self.records[member]
            if record.step is None:  # (one unlucky first step must not rank it below plain for the request)
                guess = self.chain(member, offer.situation, proposed, offer.draft_ms)
                record.step = (guess.tokens, float(guess.k), 1.0 + guess.k) if guess is not None else step
            record.update(*step)
            if member in self.kept:
                self.kept[member].update(*step)
        self.observe(offer, proposed, accepted)

    def observe(self, offer: Offer, proposed: int, accepted: int) -> None:
        """The position model of `offer`'s member and situation hears of a proposal's outcome
        (a verified one, or an unsent chain's, `unsent`)."""
        if proposed <= 0:
            return
        self._acc(offer.member, offer.situation).update(proposed, accepted)
        if offer.member in self.remembered:
            remember(self.memory, (offer.member, offer.situation), self.k_max, proposed, accepted)


def remember(
    memory: dict[tuple[str, Hashable], Acceptance], key: tuple[str, Hashable], k_max: int, proposed: int, accepted: int
) -> None:
    """A proposal's outcome into the pool's memory of acceptance (discounted over ~100)."""
    memory.setdefault(key, Acceptance(k_max, MEMORY_GAMMA)).update(proposed, accepted)


def unsent(tokens: list[int], parents: list[int] | None, committed: list[int]) -> tuple[int, int]:
    """(proposed, accepted) as a verification would have reported them for a deterministic
    proposal that was not sent (`tokens`, a chain, or a tree by `parents`), given the tokens the
    step committed: the longest path of it they follow. Exact to learn from: a greedy target
    commits the same tokens whatever was drafted, and a sampled one draws each from its own
    distribution, the chance a point-mass draft of it is accepted. Where the path runs to the
    end of what was committed, what follows is unknown: counted as proposed that far."""
    node, depth, matched = -1, {-1: 0}, 0
    for j, (t, p) in enumerate(
        zip(tokens, parents if parents is not None else range(-1, len(tokens) - 1), strict=True)
    ):
        depth[j] = depth[p] + 1
        if p == node and matched < len(committed) and t == committed[matched]:
            node, matched = j, matched + 1
    deepest = max(depth.values())
    return (matched, matched) if matched == len(committed) and matched < deepest else (deepest, matched)
