"""Each step's draft length (`adaptive_k`) and drafter (`--drafter auto`) from what the request
has shown so far.

The expected-tokens cost model, online, per sequence. After every step the controller knows,
discounted by `gamma` per new observation so that a change of topic within a request is
followed:

* alpha_j, the chance that a proposal reaching position j has its token j accepted (which
  implies 1..j-1 were): accepted-at-j / proposed-at-j, with a weak prior;
* the drafter's cost per drafted token (its measured time per step / the k it was asked for);
* the target's pass time per row count on this machine (`specdec.costs.pass_costs`), scaled
  online by how the engine's measured passes compare with it (`Costs.observe`: load, a
  longer context).

A step with k drafts is expected to commit E(k) = 1 + alpha_1 + ... + alpha_k tokens in
k * draft_ms + pass(1 + k) ms; plain decoding commits 1 in pass(1). `MethodChooser` picks the
drafter and k with the most tokens per millisecond — a plain step (no drafting) whenever none
beats plain decoding by `margin` (3%: the estimates are noisy, and a step that drafts in vain
costs more than a plain step that could have drafted). Acceptance is kept per drafter *and
situation* (prompt lookup's is the length of the n-gram it matched: a 3-token match is
accepted far more often than a 1-token one); a drafter's cost starts from its own estimate (a
draft model: its one-row pass time here); what a drafter must do before it can propose (a draft
model feeding the tokens it missed) is charged to that step, spread over the tokens still to
generate. After `probe_after` plain steps in a row it drafts one token with the drafter that
drafted least recently, so the estimates can recover; each probe doubles the wait, up to 64.
`KController` is the same over one drafter (`adaptive_k`, the default), and `--drafter auto`
(`specdec.drafters.auto`) runs it over several. `StepGuard` is the on/off version for
drafters that size their own proposals (token trees, extra rows).

Exactness: the choice depends only on steps already verified, never on the step's own draws,
and each step is verified by the same exact rule whatever its k; greedy output and the sampled
distribution are those of plain decoding (tested, with switching, and with a wrong rule as a
negative control).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from .costs import Costs, expected_tokens
from .runtime import per_model

PRIOR_WEIGHT = 1.0  # pseudo-proposals behind the prior alpha_j = PRIOR_ALPHA ** j
PRIOR_ALPHA = 0.6
MEMORY_PRIOR_WEIGHT = 4.0  # the most pseudo-proposals earlier requests' estimate weighs (`Acceptance.as_prior`)
MAX_PROBE_WAIT = 64
# a self-sized drafter's steps vary a lot (a sure phrase runs eight deep, a fork stops at one):
# its record follows them over ~5 steps, not ~3
REALIZED_WEIGHT = 0.2
MEMORY_STEP_WEIGHT = 0.05  # a step's weight in the record kept across requests (`StepRecord`): ~20 steps
KEEP_MEASURED = 1.10  # how much better another drafter's estimate must be to take a self-sized one's step
PROBE_SWITCH_SHARE = 0.10  # a probe may cost catching up at most this share of the rest of the request

Outlook = tuple[Hashable, int, float]  # (situation, most tokens it could propose now, switch ms)


class Acceptance:
    """alpha_j, the discounted chance that a proposal reaching draft position j has its token
    j accepted, for j = 1..k_max, with a weak prior (`prior`: what earlier requests measured
    for these positions, see `acceptance_memory`)."""

    def __init__(
        self, k_max: int, gamma: float, prior: list[float] | None = None, weight: list[float] | None = None
    ) -> None:
        self.gamma = gamma
        self.prior = prior or []
        # pseudo-proposals behind each position's prior (PRIOR_WEIGHT where not given)
        self.weight = weight or []
        self.proposed = [0.0] * k_max  # discounted proposals that reached position j+1
        self.accepted = [0.0] * k_max  # ...whose token j+1 was accepted

    def alpha(self) -> list[float]:
        """Each position's estimate shrinks to a prior: earlier requests' estimate where there
        is one, else a geometric one — PRIOR_ALPHA at position 1, then the previous position's
        estimate times alpha_1 (the model of Leviathan et al.), so a position that was never
        proposed is predicted from those that were: copies accepted 95% of the time at
        positions 1-2 make positions 3-4 worth trying."""
        out: list[float] = []
        for j, (a, p) in enumerate(zip(self.accepted, self.proposed, strict=True)):
            prior = self.prior[j] if j < len(self.prior) else out[-1] * out[0] if out else PRIOR_ALPHA
            w = self.weight[j] if j < len(self.weight) else PRIOR_WEIGHT
            out.append((a + w * prior) / (p + w))
        return out

    def as_prior(self) -> tuple[list[float], list[float]]:
        """(alpha_j, weight_j): this estimate as the prior of a new request's (`acceptance_memory`).
        Each position weighs what it measured, up to MEMORY_PRIOR_WEIGHT proposals and never
        less than PRIOR_WEIGHT: with one pseudo-proposal behind a prior that many earlier
        proposals measured, a request's first lucky draft swung a weak situation's estimate
        far enough for suffix decoding's tree to take steps from the draft model that then
        committed nothing (docs/results.md, 2026-12-05 third entry)."""
        return self.alpha(), [min(MEMORY_PRIOR_WEIGHT, max(PRIOR_WEIGHT, p)) for p in self.proposed]

    def expected(self, k: int) -> float:
        """Expected tokens committed by a step with k drafts (the target's own token included)."""
        return 1.0 + sum(self.alpha()[:k])

    def update(self, proposed: int, accepted: int) -> None:
        # forget only where there is new evidence: a position k no longer reaches keeps its
        # estimate (decaying it would drag it to the prior and keep k short for no reason)
        for j in range(min(proposed, len(self.proposed))):
            self.proposed[j] = self.gamma * self.proposed[j] + 1.0
            self.accepted[j] = self.gamma * self.accepted[j] + (1.0 if j < accepted else 0.0)


class StepRecord:
    """What a self-sized drafter's steps committed and cost (EMAs of tokens and ms per step)
    over the earlier greedy requests with the same target and drafter (kept where the drafter
    keeps what it learns across requests: a draft model's confidence calibration). A request's
    record (`MethodChooser.realized`) starts from it: started from the position model's guess
    instead, a few unlucky one-token steps early in a request ranked a draft model that beat
    plain decoding over whole requests below plain for the rest of the request (open text).
    Exact as the rest: it holds verified steps only."""

    def __init__(self) -> None:
        self.step: tuple[float, float] | None = None  # (tokens, ms) per step

    def update(self, tokens: float, ms: float) -> None:
        old = self.step or (tokens, ms)
        self.step = (_ema(old[0], tokens, MEMORY_STEP_WEIGHT), _ema(old[1], ms, MEMORY_STEP_WEIGHT))


MEMORY_GAMMA = 0.99  # discount per new observation in the memory kept across requests (~100 proposals)
ACCEPTANCE = per_model(memory=True)  # per target: (drafter, situation) -> acceptance over greedy requests


def acceptance_memory(target: Any, greedy: bool) -> dict[tuple[str, Hashable], Acceptance] | None:
    """What the greedy requests decoded so far in this process with `target` measured, per
    drafter and situation: the prior of the next request's estimates. Without it every request
    starts from the geometric prior (alpha_1 = 0.6), and where a situation is worse — a
    one-token n-gram match is accepted ~20% of the time — it pays for a few failed drafts to
    learn that again. Exact as before: what the memory holds comes from verified steps only.
    None for sampled requests: a seeded request must give the same answer every time, and the
    draft lengths it chooses decide which random numbers its verification draws."""
    return ACCEPTANCE.of(target, dict) if greedy else None


class _Prober:
    """After `wait` plain steps in a row, one probe; each probe that finds nothing doubles the
    wait (up to MAX_PROBE_WAIT), a step chosen on its merits resets it."""

    def __init__(self, probe_after: int) -> None:
        self.first = self.wait = probe_after
        self.plain_run = 0

    def plain(self) -> bool:
        """A step where nothing pays: True if it should probe instead."""
        self.plain_run += 1
        if self.plain_run > self.wait:
            self.plain_run = 0
            self.wait = min(MAX_PROBE_WAIT, 2 * self.wait)
            return True
        return False

    def drafted(self) -> None:
        self.plain_run = 0
        self.wait = self.first


def outlook_of(drafter: Any, k: int) -> Outlook | None:
    """What `drafter` could propose now within k tokens, as the chooser takes it: (situation,
    most tokens, switch ms); None when it has nothing to propose."""
    o = drafter.outlook(k) if k > 0 else None
    return (o[0], min(o[1], k), drafter.switch_ms()) if o is not None and o[1] > 0 else None


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


class KController:
    """`adaptive_k` for one chain drafter: `MethodChooser` over that drafter alone (its
    situations, cost estimate and catch-up cost included). `choose` returns the step's k (0: a
    plain step)."""

    def __init__(self, drafter: Any, k_max: int, costs: Costs, **kw: Any) -> None:
        self.drafter, self.name = drafter, drafter.name or "drafter"
        self.chooser = MethodChooser(
            [self.name],
            k_max,
            costs,
            draft_ms={self.name: drafter.cost_ms()},
            self_sized=frozenset([self.name] if drafter.sizes_itself else []),
            priors=lambda m, situation: drafter.prior_alpha(situation),
            steps=lambda m: drafter.step_record(),
            **kw,
        )
        self._situation: Hashable = None

    def choose(self, k: int, remaining: int | None = None, others: tuple[float, float] = (0, 0.0)) -> int:
        """This step's k, at most `k` (call once per step); `others`: see `MethodChooser.choose`."""
        o = outlook_of(self.drafter, k)
        outlook = {self.name: o} if o is not None else {}
        method, chosen = self.chooser.choose(outlook, remaining, others)
        self._situation = outlook[method][0] if method in outlook else None
        return chosen

    def update(self, asked: int, proposed: int, accepted: int, draft_ms: float, rows: int = 1) -> None:
        """A verified step: asked for `asked` drafts, got `proposed`, `accepted` of them kept."""
        self.chooser.update(self.name, self._situation, asked, proposed, accepted, draft_ms, rows)

    def report(self) -> dict[str, Any]:
        rep = self.chooser.report()
        alpha = rep["alpha_by_position"]  # per situation ("drafter[situation]"), or one list
        return {
            "k_chosen": {k: n for (_, k), n in sorted(self.chooser.chosen.items(), key=lambda t: t[0][1])},
            "alpha_by_position": alpha.get(self.name, []) if set(alpha) <= {self.name} else alpha,
            "draft_ms_per_token": rep["draft_ms_per_token"][self.name],
            "pass_scale": rep["pass_scale"],
        }


class MethodChooser:
    """Chooses each step's drafter and k for one sequence among several drafters (see the
    module doc). A drafter is offered each step with its *outlook*: the situation its proposal
    would come from and how many tokens it could propose now (absent: nothing to propose)."""

    def __init__(
        self,
        methods: list[str],
        k_max: int,
        costs: Costs,
        gamma: float = 0.9,
        probe_after: int = 4,
        margin: float = 1.03,
        draft_ms: Mapping[str, float | None] | None = None,
        memory: dict[tuple[str, Hashable], Acceptance] | None = None,
        remembered: frozenset[str] = frozenset(),
        reproducible: bool = False,
        self_sized: frozenset[str] = frozenset(),
        priors: Callable[[str, Hashable], float | None] | None = None,
        steps: Callable[[str], StepRecord | None] | None = None,
    ) -> None:
        if not methods or k_max < 1 or not 0 < gamma <= 1 or margin < 1:
            raise ValueError("give at least one method; k_max must be >= 1, gamma in (0, 1] and margin >= 1")
        self.methods, self.k_max, self.costs, self.gamma, self.margin = list(methods), k_max, costs, gamma, margin
        # `reproducible` (a seeded sampled request): no timing enters the choices — the stored
        # pass-time table unscaled, each drafter's own cost estimate never updated — so the draft
        # lengths, and with them the random numbers verification draws, are the same every time
        self.reproducible = reproducible
        if reproducible:
            self.costs = costs.unscaled()
        self.acceptance: dict[tuple[str, Hashable], Acceptance] = {}
        # earlier requests' acceptance (`acceptance_memory`), for the `remembered` methods: those
        # whose acceptance depends on the target and the text alone (not on a draft model or
        # head that another request may not share)
        self.memory = memory if memory is not None else {}
        # a drafter's own prior for a situation no request has measured (`Switchable.prior_alpha`)
        self.priors = priors
        self.remembered = remembered
        # per drafted token (EMA of the measured cost), starting from the drafter's own estimate
        # where it has one (a draft model: its one-row pass time on this machine)
        self.draft_ms: dict[str, float | None] = {m: (draft_ms or {}).get(m) for m in methods}
        if reproducible:
            self.draft_ms = {m: v or 0.0 for m, v in self.draft_ms.items()}
        # ...an estimate stored at another moment of the machine (a draft model's step timed once
        # per machine) moves with it as the pass table does (`Costs.scale`: both are passes over
        # weights on the same cores) until this request measures the drafter itself
        self._stored = {m for m, v in self.draft_ms.items() if v}
        # drafters that stop short of k themselves (`Switchable.sizes_itself`): the chooser decides
        # whether they draft, and hands them the deepest k it allows; once they have drafted,
        # they are ranked by what their steps actually committed and cost (`realized`: EMAs of
        # tokens and ms per step), since their depth is not the k the position model prices.
        # Each is tried once early in a request where nothing else is chosen on its merits.
        self.self_sized = self_sized
        self.realized: dict[str, tuple[float, float]] = {}
        # ...starting from earlier requests' record where the drafter keeps one (`StepRecord`;
        # asked once, at the method's first ranking: a drafter's stores are set at its `begin`)
        self._steps = steps
        self._records: dict[str, StepRecord | None] = {}
        self.rates_now: dict[str, float] = {}  # the last `choose`'s expected tokens/ms per drafter
        self._tried: set[str] = set()
        self.prober = _Prober(probe_after)
        self.chosen: Counter[tuple[str, int]] = Counter()  # ("plain", 0) for plain steps
        self.switches = 0  # drafting steps whose drafter differs from the previous drafting step's
        self._last_method = "plain"
        self._step = 0
        self._last_drafted: dict[str, int] = {}  # method -> the last step it drafted

    def _acc(self, method: str, situation: Hashable) -> Acceptance:
        key = (method, situation)
        if key not in self.acceptance:
            known = self.memory.get(key) if method in self.remembered else None
            prior, weight = known.as_prior() if known is not None else (None, None)
            if prior is None and self.priors is not None and (first := self.priors(method, situation)) is not None:
                prior = [first]
            self.acceptance[key] = Acceptance(self.k_max, self.gamma, prior, weight)
        return self.acceptance[key]

    def rate(
        self,
        method: str,
        situation: Hashable,
        k: int,
        switch_ms: float = 0.0,
        remaining: int | None = None,
        others: tuple[float, float] = (0, 0.0),
    ) -> float:
        """Expected tokens per millisecond of a step with k drafts of `method` (k = 0: plain).
        `switch_ms`: what the drafter must do first to catch up (a draft model feeding the
        tokens it missed), spread over the steps that the `remaining` tokens take. `others`:
        (rows, expected tokens) the rest of the batch brings to the same pass — the rate is then
        the whole pass's, so a sequence's extra rows are priced at what they add to it."""
        rows, tokens = others
        if k == 0:
            return (tokens + 1.0) / self.costs.rows(rows + 1)
        expected = self._acc(method, situation).expected(k)
        setup = switch_ms * expected / max(remaining, 1) if switch_ms and remaining is not None else 0.0
        return (tokens + expected) / (self.draft_cost(method) * k + self.costs.rows(rows + 1 + k) + setup)

    def draft_cost(self, method: str) -> float:
        """Expected ms per drafted token of `method` now."""
        ms = self.draft_ms[method] or 0.0
        return ms * self.costs.scale if method in self._stored else ms

    def _record(self, method: str) -> StepRecord | None:
        """Earlier requests' record of `method`'s steps (None: it keeps none; see `StepRecord`).
        Fetched once, when this request's record of the method starts from it."""
        if method not in self._records:
            is_sized = method in self.self_sized and self._steps is not None and not self.reproducible
            record = self._steps(method) if is_sized else None  # type: ignore[misc]
            self._records[method] = record
            if record is not None and record.step is not None:
                self.realized.setdefault(method, record.step)
        return self._records[method]

    def ranked(
        self, outlook: Mapping[str, Outlook], remaining: int | None = None, others: tuple[float, float] = (0, 0.0)
    ) -> list[tuple[float, str, int]]:
        """(expected tokens/ms, method, k) of every method's best k, best first."""
        out = []
        for m in self.methods:
            if m not in outlook:
                continue
            self._record(m)  # (a request's record starts from earlier requests')
            situation, most, switch_ms = outlook[m]
            ks = range(1, min(self.k_max, most) + 1)
            if ks and m in self.realized and others[0] == 0:
                tokens, ms = self.realized[m]
                setup = switch_ms * tokens / max(remaining, 1) if switch_ms and remaining is not None else 0.0
                out.append((tokens / (ms + setup), m, ks[-1]))
            elif ks:
                rate = {k: self.rate(m, situation, k, switch_ms, remaining, others) for k in ks}
                k = max(ks, key=lambda k: (rate[k], -k))
                out.append((rate[k], m, k))
        return sorted(out, key=lambda t: (-t[0], self.methods.index(t[1])))

    def choose(
        self, outlook: Mapping[str, Outlook], remaining: int | None = None, others: tuple[float, float] = (0, 0.0)
    ) -> tuple[str, int]:
        """This step's (method, k); ("plain", 0) for a plain step. Call once per step.
        `outlook`: per drafter that could propose now, (situation, most tokens, switch ms);
        `remaining`: tokens left to generate (None: unknown); `others`: (rows, expected tokens)
        the other sequences of a batch bring to this pass (a server's continuous batch: where
        the pass is compute-bound, a row costs its full share and k shrinks)."""
        choice, probe = ("plain", 0), False
        unmeasured = [m for m in self.methods if m in outlook and outlook[m][1] > 0 and self.draft_ms[m] is None]
        ranked = self.ranked(outlook, remaining, others)
        self.rates_now = {m: r for r, m, _ in ranked}
        plain_ms = self.costs.target(1)

        def cheap(m: str) -> bool:
            """Catching `m` up costs at most a small share of what the rest of the request takes."""
            return outlook[m][2] <= PROBE_SWITCH_SHARE * plain_ms * max(remaining or 0, 1)

        if unmeasured:  # a drafter's cost is not known yet: draft once with it to measure it
            m = unmeasured[0]
            choice = (m, min(self.k_max, outlook[m][1]))
        elif ranked and ranked[0][0] > self.margin * self.rate("plain", None, 0, others=others):
            choice = (ranked[0][1], ranked[0][2])
            # a self-sized drafter ranked by what its steps did keeps the step unless another's
            # estimate (from its position model, on priors where it has few steps) beats it
            # clearly: each switch also costs the draft a catch-up
            kept = [(r, m, k) for r, m, k in ranked if m in self.realized and r * KEEP_MEASURED >= ranked[0][0]]
            if kept and choice[0] not in self.self_sized:
                choice = (kept[0][1], kept[0][2])
            self.prober.drafted()
        elif ranked and self.prober.plain():
            # probe with one token the drafter that drafted least recently (each gets its turn),
            # unless catching it up would cost more than a small share of what the rest of the
            # request takes anyway
            affordable = [m for _, m, _ in ranked if cheap(m)]
            if affordable:
                choice = (min(affordable, key=lambda m: self._last_drafted.get(m, -1)), 1)
                probe = True
        if choice[0] == "plain":  # nothing pays on its merits: try a self-sized drafter not yet tried
            untried = [m for _, m, _ in ranked if m in self.self_sized and m not in self._tried and cheap(m)]
            if untried:
                choice = (untried[0], 1)
        if choice[0] in self.self_sized and not probe:  # (a probe stays one token)
            choice = (choice[0], min(self.k_max, outlook[choice[0]][1]))
        if choice[0] in self.self_sized:
            self._tried.add(choice[0])
        self.chosen[choice] += 1
        self._step += 1
        if choice[0] != "plain":
            self._last_drafted[choice[0]] = self._step
            self.switches += self._last_method not in ("plain", choice[0])
            self._last_method = choice[0]
        return choice

    def update(
        self,
        method: str,
        situation: Hashable,
        asked: int,
        proposed: int,
        accepted: int,
        draft_ms: float,
        rows: int | None = None,
    ) -> None:
        """A verified step of `method`: asked for `asked` drafts, got `proposed` in a row (`rows`
        rows in the pass: a tree's nodes and the last committed token; None: 1 + proposed),
        `accepted` kept."""
        if asked > 0 and not self.reproducible:
            if method in self._stored:  # (the estimate as this moment reads it, then measurements)
                self.draft_ms[method] = self.draft_cost(method)
                self._stored.discard(method)
            # (per token drafted: a drafter that sizes itself drafts fewer than it is asked for)
            per = max(proposed, 1) if method in self.self_sized else asked
            self.draft_ms[method] = _ema(self.draft_ms[method], draft_ms / per)
        if proposed > 0 and method in self.self_sized:
            # what the step committed, and cost: its drafting (the stored estimate where the
            # clock must not decide) and the target's pass over its rows, from the table
            spent = self.draft_cost(method) * proposed if self.reproducible else draft_ms
            pass_ms = self.costs.rows(rows if rows is not None else 1 + proposed)
            step = (accepted + 1.0, spent + pass_ms)
            # the first step starts from what the position model predicted for it (one unlucky
            # first draft must not rank a drafter below plain for the rest of the request)
            old = self.realized.get(method) or (
                self._acc(method, situation).expected(proposed),
                self.draft_cost(method) * proposed + pass_ms,
            )
            self.realized[method] = (_ema(old[0], step[0], REALIZED_WEIGHT), _ema(old[1], step[1], REALIZED_WEIGHT))
            if (record := self._record(method)) is not None:
                record.update(*step)
        if proposed > 0:
            self._acc(method, situation).update(proposed, accepted)
            if method in self.remembered:
                key = (method, situation)
                if key not in self.memory:
                    self.memory[key] = Acceptance(self.k_max, MEMORY_GAMMA)
                self.memory[key].update(proposed, accepted)

    def report(self) -> dict[str, Any]:
        steps: dict[str, dict[str, int]] = {}
        for (m, k), n in sorted(self.chosen.items(), key=lambda t: (t[0][0], t[0][1])):
            steps.setdefault(m, {})[f"k={k}" if m != "plain" else "steps"] = n
        return {
            "methods": self.methods,
            "steps": steps,
            "switches": self.switches,
            # per drafter[situation], the positions that were ever proposed
            "alpha_by_position": {
                f"{m}[{s}]" if s != "" else m: [
                    round(a, 3) for a, p in zip(acc.alpha(), acc.proposed, strict=True) if p > 0
                ]
                for (m, s), acc in sorted(self.acceptance.items(), key=lambda t: str(t[0]))
            },
            "draft_ms_per_token": {m: None if v is None else round(v, 3) for m, v in self.draft_ms.items()},
            "pass_scale": round(self.costs.scale, 3),
        }


class StepGuard:
    """Never slower, for drafters that size their own proposals (token trees, extra rows,
    self-speculation): each step either drafts as the drafter chooses or is a plain step.
    Drafted steps' tokens per millisecond — committed tokens over the drafter's measured time
    plus the target's pass time for the rows it brought (`costs`) — discounted by `gamma` per
    drafted step, against plain decoding's one token per one-row pass. Plain steps wherever
    drafting is not measured to keep up with plain decoding, with one drafted probe after 4, 8,
    ... 64 plain steps so the estimate can recover."""

    def __init__(
        self,
        k: int,
        costs: Costs,
        gamma: float = 0.9,
        probe_after: int = 4,
        estimate: Callable[[int], float] | None = None,
    ) -> None:
        if k < 1 or not 0 < gamma <= 1:
            raise ValueError("k must be >= 1 and gamma in (0, 1]")
        self.k, self.costs, self.gamma = k, costs, gamma
        # `estimate` (a seeded sampled request, `costs.reproducible`): a step's drafting time
        # from stored numbers (`Switchable.estimated_ms` of the tokens proposed) instead of the
        # measured one, against the stored pass table unscaled: no clock enters the choices
        self.estimate = estimate
        if estimate is not None:
            self.costs = costs.unscaled()
        self.tokens = 0.0  # discounted tokens committed by drafted steps
        self.ms = 0.0  # ...and their discounted cost
        self.prober = _Prober(probe_after)
        self.drafted_steps = self.plain_steps = 0

    def drafting_pays(self) -> bool:
        return self.ms == 0.0 or self.tokens / self.ms >= 1.0 / self.costs.target(1)

    def choose(self) -> int:
        """This step's k: the drafter's own, or 0 for a plain step."""
        if self.drafting_pays():
            self.prober.drafted()
            k = self.k
        else:
            k = self.k if self.prober.plain() else 0
        if k:
            self.drafted_steps += 1
        else:
            self.plain_steps += 1
        return k

    def update(self, asked: int, proposed: int, accepted: int, draft_ms: float, rows: int = 1) -> None:
        """A verified step that asked for drafts: `accepted` drafts kept (plus the target's own
        token), `rows` rows scored by the target pass."""
        if asked == 0:
            return
        if self.estimate is not None:
            draft_ms = self.estimate(proposed)
        self.tokens = self.gamma * self.tokens + accepted + 1
        self.ms = self.gamma * self.ms + draft_ms + self.costs.target(rows)

    def report(self) -> dict[str, Any]:
        return {
            "drafted_steps": self.drafted_steps,
            "plain_steps": self.plain_steps,
            "drafted_tokens_per_ms": round(self.tokens / self.ms, 4) if self.ms else None,
            "plain_tokens_per_ms": round(1.0 / self.costs.target(1), 4),
            "pass_scale": round(self.costs.scale, 3),
        }


def batch_drafting_pays(costs: Costs, batch: int, k: float, alpha: float, draft_ms_per_token: float = 0.0) -> bool:
    """Several sequences decoding in one target pass (a server's continuous batch): does
    drafting `k` tokens each, accepted at rate `alpha` each, commit more tokens per ms than a
    plain step for all of them? A plain step commits `batch` tokens in a pass over `batch`
    rows; a drafting step batch * E(alpha, k) (E = 1 + alpha + ... + alpha^k) in a pass over
    batch * (1 + k) rows plus the drafting. One row costs about as much as a few (the pass
    is memory-bound), so drafting pays for a small batch; a large batch already fills the pass
    with rows, and each drafted row then costs its full compute. With one sequence its own
    controller decides (True here)."""
    if batch <= 1 or k <= 0:
        return True
    alpha = min(max(alpha, 0.0), 1.0)
    expected = expected_tokens(alpha, int(round(k)))
    plain = batch / costs.rows(batch)
    drafting = batch * expected / (costs.rows(int(round(batch * (1 + k)))) + batch * k * draft_ms_per_token)
    return drafting > plain
