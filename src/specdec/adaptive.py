"""Each step's drafter and k: every member offers its best proposal, one chooser takes the best.

`Chooser.choose` is the whole rule over the step's offers (`specdec.offers`: a proposal, the
tokens it expects to commit, the ms it expects to cost): the best rate in tokens per ms, unless
the incumbent (the member that drafted last) is within HYSTERESIS of it; a plain step where that
does not beat plain decoding by MARGIN; after a run of plain steps, a probe. The engine's
`adaptive_k` is the same chooser over one drafter (`Schedule`); `--drafter auto` runs it over
several. The twelve things a reader needs to explain a pick are listed in docs/design.md; every
step's offers, pick and result are logged (`info[REPORT]`), and `replay` judges a change to the
rule on logs.

Exact: a choice depends only on steps already verified, and every step is verified by the same
exact rule whatever its k (tested with random switching and a wrong rule as negative control).
A seeded sampled request (`reproducible`) decides from stored numbers only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from .offers import PLAIN, Estimates, Offer

# the one key of a drafter's info (`Drafter.info`) that holds its chooser's report (`Chooser.report`:
# steps, the per-member table, the step log), whoever chose: auto over its members, or the
# schedule over one drafter (`adaptive_k`)
REPORT = "schedule"
MARGIN = 1.03  # how much better than plain decoding an offer must be (a vain draft costs more than a plain step)
HYSTERESIS = 1.10  # how much better than the incumbent's another offer must be to take the step
PROBE_AFTER = 4  # plain steps in a row before the first probe
MAX_PROBE_WAIT = 64
# a probe's catch-up may cost at most this share of the tokens the sequence still has to make,
# priced at the tokens the pass (a batch's: every sequence waits for it) makes per ms meanwhile
PROBE_SHARE = 0.10


def steps_text(steps: dict[str, dict[str, int]]) -> str:
    """A report's steps per member and k (`Chooser.report`) as one line."""
    return "; ".join(f"{name} " + ", ".join(f"{k} {n}" for k, n in ks.items()) for name, ks in steps.items())


class Chooser:
    """The rule of the module doc over the offers of one sequence's steps, with the log of
    every step: its offers, its pick, and what the pass committed (`committed`)."""

    def __init__(self, margin: float = MARGIN, probe_after: int = PROBE_AFTER) -> None:
        if margin < 1 or probe_after < 1:
            raise ValueError("the chooser's margin must be >= 1 and probe_after >= 1")
        self.margin, self.first_wait = margin, probe_after
        self.wait, self.plain_run = probe_after, 0
        self.incumbent: str | None = None  # the member that drafted the last drafted step
        self.drafted: dict[str, int] = {}  # member -> the last step it drafted
        self.log: list[dict[str, Any]] = []
        self.switches = 0  # drafted steps whose member differs from the previous drafted step's

    def choose(self, offers: list[Offer], plain: Offer, remaining: int | None = None) -> Offer:
        """This step's offer (`plain` for a plain step); `remaining`: tokens left to generate
        (None: unknown). Call once per step."""
        best = max(offers, key=lambda o: o.rate, default=None)  # (ties: the first listed)
        incumbent = next((o for o in offers if o.member == self.incumbent), None)
        if best is not None and incumbent is not None and incumbent.rate * HYSTERESIS >= best.rate:
            best = incumbent
        pick, why = plain, "plain"
        if best is not None and best.rate > self.margin * plain.rate:
            pick, why = best, "best"
            self.wait, self.plain_run = self.first_wait, 0
        else:
            self.plain_run += 1
            affordable = [o for o in offers if o.catch_up_ms * plain.rate <= PROBE_SHARE * max(remaining or 0, 1)]
            if affordable and self.plain_run > self.wait:
                pick, why = min(affordable, key=lambda o: self.drafted.get(o.member, -1)), "probe"
                self.wait, self.plain_run = min(MAX_PROBE_WAIT, 2 * self.wait), 0
        step = len(self.log)
        if pick.member != PLAIN:
            self.switches += self.incumbent not in (None, pick.member)
            self.incumbent = pick.member
            self.drafted[pick.member] = step
        self.log.append(
            {
                "offers": [o.row() for o in offers],
                "plain": plain.row(),
                "remaining": remaining,
                "pick": pick.row(),
                "why": why,
            }
        )
        return pick

    def committed(self, tokens: int, draft_ms: float, pass_ms: float | None) -> None:
        """What the last chosen step committed, and what its drafting and pass cost."""
        if self.log:
            self.log[-1].update(committed=tokens, draft_ms=round(draft_ms, 3))
            if pass_ms is not None:
                self.log[-1]["pass_ms"] = round(pass_ms, 3)

    def report(self) -> dict[str, Any]:
        """Steps per member and k, switches, the per-member table (`members`) and the log."""
        steps: dict[str, dict[str, int]] = {}
        chosen = Counter((s["pick"][0], s["pick"][1]) for s in self.log)
        for (m, k), n in sorted(chosen.items(), key=lambda t: (t[0][0], t[0][1])):
            steps.setdefault(m, {})[f"k={k}" if m != PLAIN else "steps"] = n
        return {"steps": steps, "switches": self.switches, "members": members(self.log), "log": self.log}


def members(log: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per member (and plain) from a step log: steps taken, tokens per pass, ms per step (its
    drafting and its pass, where measured) and its share of the time."""
    acc: dict[str, list[float]] = {}
    for s in log:
        a = acc.setdefault(s["pick"][0], [0, 0.0, 0.0])
        a[0] += 1
        a[1] += s.get("committed", 0)
        a[2] += s.get("draft_ms", 0.0) + s.get("pass_ms", 0.0)
    total = sum(a[2] for a in acc.values()) or 1.0
    return {
        m: {
            "steps": int(n),
            "tokens_per_pass": round(tokens / n, 2),
            "ms_per_step": round(ms / n, 2),
            "share": round(ms / total, 3),
        }
        for m, (n, tokens, ms) in sorted(acc.items())
    }


def replay(log: list[dict[str, Any]], chooser: Chooser | None = None) -> list[dict[str, Any]]:
    """Each logged step's offers through `chooser` (a fresh one by default): where its pick
    differs from the logged one, the step, both picks and the difference in expected tokens
    per ms (the new pick's rate over the logged pick's, both as the log priced them)."""
    chooser = chooser or Chooser()
    out = []
    for i, s in enumerate(log):
        offers = [_offer(row) for row in s["offers"]]
        p = s["pick"]
        new = chooser.choose(offers, _offer(s["plain"]), s["remaining"])
        if new.member != p[0] or new.k != p[1]:
            old_rate = p[2] / p[3] if p[3] else 0.0
            out.append({"step": i, "logged": p, "new": new.row(), "rate_ratio": round(new.rate / old_rate, 3)})
    return out


def _offer(row: list[Any]) -> Offer:
    m, k, tokens, ms, merged, catch_up_ms = row
    return Offer(m, k, tokens, ms, merged=merged, catch_up_ms=catch_up_ms)


class Schedule:
    """`GenerationConfig.adaptive_k`: the chooser over one drafter (auto over one member). The
    drafter's offer is its own (`offer`: a `Switchable`'s) or, for a drafter that prices
    nothing itself, what its steps did (`Estimates.measured`)."""

    def __init__(
        self,
        name: str,
        offer: Callable[[int, Estimates], Offer | None] | None,
        estimates: Estimates,
        chooser: Chooser | None = None,
    ) -> None:
        self.name, self.offer_of, self.est = name, offer, estimates
        self.chooser = chooser if chooser is not None else Chooser()
        self.offer: Offer | None = None

    def choose(self, k: int, remaining: int | None = None, others: tuple[float, float] = (0, 0.0)) -> int:
        """This step's k, at most `k` (0: a plain step). Call once per step."""
        self.est.step(remaining, others)
        o = self.offer_of(k, self.est) if self.offer_of is not None else self.est.measured(self.name, k, 0.0)
        self.offer = self.chooser.choose([o] if o is not None else [], self.est.plain(), remaining)
        return min(self.offer.k, k)

    def update(
        self, proposed: int, accepted: int, draft_ms: float, rows: int | None = None, pass_ms: float | None = None
    ) -> None:
        """The chosen step's pass: `proposed` tokens deep, `accepted` kept, over `rows` rows
        (nothing for a step this schedule did not choose: a batch's plain step)."""
        if self.offer is None:
            return
        if self.offer.member != PLAIN:
            self.est.learn(self.offer, proposed, accepted, draft_ms, rows)
        self.chooser.committed(accepted + 1, draft_ms, pass_ms)
        self.offer = None

    def report(self) -> dict[str, Any]:
        rep = self.chooser.report()
        rep["alpha_by_position"] = alpha_report(self.est)
        rep["pass_scale"] = round(self.est.costs.scale, 3)
        return rep


def alpha_report(est: Estimates) -> dict[str, list[float]]:
    """Per member[situation], alpha_j at the positions that were ever proposed."""
    return {
        f"{m}[{s}]" if s != "" else m: [round(a, 3) for a, p in zip(acc.alpha(), acc.proposed, strict=True) if p > 0]
        for (m, s), acc in sorted(est.acceptance.items(), key=lambda t: str(t[0]))
    }
