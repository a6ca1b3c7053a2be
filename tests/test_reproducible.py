"""A seeded sampled request answers the same bit for bit every time, with every drafter: no
clock enters its choices (`costs.reproducible`). Each drafter runs the request twice under
clocks that disagree wildly (one makes drafting look free, the other ruinous) and with the
state other requests leave behind moved in between (the shared pass table's scale, EAGLE-3's
calibration); the negative control runs the same with the clock-free mode switched off and
must give different answers."""

from __future__ import annotations

import itertools
import time

import pytest
from helpers import PROMPTS, random_head, random_heads

import specdec
from specdec import costs
from specdec.adaptive import Schedule
from specdec.costs import PASS_TABLES, Costs
from specdec.drafters import (
    AutoDrafter,
    DraftModelDrafter,
    Eagle3Drafter,
    HydraDrafter,
    LookaheadDrafter,
    MedusaDrafter,
)
from specdec.offers import Estimates

SEED, TOKENS = 1234, 40


def _drafters(target, draft):
    """Factories of each drafter; the heads made once, so that their runners' state (measured
    call times, EAGLE-3's calibration) carries from one request to the next as in a server."""
    eagle, medusa, hydra = (
        random_head(target, seed=4),
        random_heads(target, "medusa", seed=5),
        random_heads(target, "hydra", seed=6),
    )
    return {
        "eagle3": lambda: Eagle3Drafter(target, head=eagle),
        "medusa": lambda: MedusaDrafter(target, head=medusa),
        "hydra": lambda: HydraDrafter(target, head=hydra),
        "lookahead": lambda: LookaheadDrafter(window=4, ngram=3, guesses=3),
        "draft-model": lambda: DraftModelDrafter(draft),
        "auto": lambda: AutoDrafter(target, draft, head=eagle),
    }


def _clock(step_s: float):
    """A perf_counter that advances `step_s` seconds per call: every timed interval looks like
    a multiple of it."""
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


def _run(target, drafter, monkeypatch, step_s: float) -> list[int]:
    monkeypatch.setattr(time, "perf_counter", _clock(step_s))
    out = specdec.generate(
        target, PROMPTS[1], drafter=drafter, k=4, max_new_tokens=TOKENS, ignore_eos=True, temperature=1.0, seed=SEED
    )
    monkeypatch.undo()
    return out.token_ids


def _disturb(target, drafter) -> None:
    """What other requests leave behind: a slow moment in the shared pass table, and greedy
    trees that accepted far more than EAGLE-3 predicted."""
    table = PASS_TABLES.get(target)
    if table is not None:
        table.observe(1, 50 * table.target(1), weight=1.0)
    run = getattr(drafter, "run", None)
    if run is not None and hasattr(run, "accepted_sum"):
        run.accepted_sum += 100.0


@pytest.mark.parametrize("name", ["eagle3", "medusa", "hydra", "lookahead", "draft-model", "auto"])
def test_seeded_sampled_requests_reproduce_whatever_the_clock(tiny, monkeypatch, name):
    target, draft = tiny("llama"), tiny("llama", "close").model
    make = _drafters(target.model, draft)[name]
    d = make()
    first = _run(target, d, monkeypatch, step_s=1e-5)  # drafting looks free
    _disturb(target.model, d)
    second = _run(target, make(), monkeypatch, step_s=10.0)  # ...and ruinous
    assert first == second and len(first) == TOKENS


@pytest.mark.parametrize("name", ["eagle3", "medusa", "hydra"])
def test_negative_control_with_the_clock_in_the_choices_answers_differ(tiny, monkeypatch, name):
    """The same runs with the clock-free mode off: the clocks change the draft lengths, and
    with them the random numbers verification draws."""
    target, draft = tiny("llama"), tiny("llama", "close").model
    make = _drafters(target.model, draft)[name]
    monkeypatch.setattr(costs, "reproducible", lambda sampling: False)
    fast = _run(target, make(), monkeypatch, step_s=1e-5)  # (_run undoes the patch)
    monkeypatch.setattr(costs, "reproducible", lambda sampling: False)
    slow = _run(target, make(), monkeypatch, step_s=10.0)
    assert fast != slow


@pytest.mark.parametrize("clock_free", [True, False])
def test_the_schedule_of_a_seeded_sampled_request_counts_no_measured_time(clock_free):
    """The schedule that lookahead and the trained heads run under (offers from what their steps
    did), fed the same verified steps at two measured drafting times: clock-free (a
    reproducible request's estimates), the same choices; with the clock (the negative control),
    a slow moment turns drafting off."""
    table = Costs({r: 10.0 + r for r in range(1, 10)})

    def choices(draft_ms: float, scale: float) -> list[int]:
        t = Costs(dict(table.target_ms))
        g = Schedule("t", None, Estimates(t, 4, reproducible=clock_free))
        out = []
        for _ in range(12):
            k = g.choose(4)
            out.append(k)
            t.observe(1, scale * t.target(1), weight=1.0)
            g.update(k, 2 if k else 0, draft_ms if k else 0.0, rows=k + 1)
        return out

    same = choices(draft_ms=1.0, scale=1.0) == choices(draft_ms=80.0, scale=3.0)
    assert same == clock_free
