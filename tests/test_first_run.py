"""A first run as fast as the second: what is timed once per machine (the pass table, the
draft's step) is timed at `specdec models install` or before either side of a comparison,
never inside a measured run; a comparison's repeats alternate plain and speculative (ABBA)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import specdec
from specdec import api, costs
from specdec.engine import Engine

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]


def _events(monkeypatch, target, draft, tmp_path):
    """A log of 'timed' (a once-per-machine measurement kept in the cache), 'start' (a run's
    clock starts: the engine takes its sequence) and 'end' (the run is over), on models that
    have measured nothing yet."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.delitem(costs.PASS_TABLES, target.model, raising=False)
    monkeypatch.delitem(costs.DRAFT_STEPS, target.model, raising=False)
    monkeypatch.delitem(costs.PASS_TABLES, draft.model, raising=False)
    monkeypatch.delitem(costs.DRAFT_STEPS, draft.model, raising=False)
    events: list[str] = []
    store, run, add = costs.store_measurement, api.run_request, Engine.add
    monkeypatch.setattr(costs, "store_measurement", lambda *a: events.append("timed") or store(*a))
    monkeypatch.setattr(Engine, "add", lambda *a, **kw: events.append("start") or add(*a, **kw))

    def ended(*a, **kw):
        out = run(*a, **kw)
        events.append("end")
        return out

    monkeypatch.setattr(api, "run_request", ended)
    return events


def _timed_inside_a_run(events: list[str]) -> bool:
    live = 0
    for e in events:
        live += {"start": 1, "end": -1}.get(e, 0)
        if e == "timed" and live:
            return True
    return False


def test_compare_times_the_machine_before_either_side(tiny, monkeypatch, tmp_path):
    target, draft = tiny("llama"), tiny("llama", "close")
    events = _events(monkeypatch, target, draft, tmp_path)
    cmp = specdec.compare(target, PROMPT, assistant_model=draft, max_new_tokens=8, repeats=3)
    assert events.count("start") == events.count("end") == 6 and "timed" in events
    assert not _timed_inside_a_run(events)
    assert len(cmp.pairs) == 3 and cmp.identical is True
    lo, hi = cmp.band
    assert lo <= cmp.speedup <= hi and sorted(cmp.speedups)[1] == pytest.approx(cmp.speedup)


def test_without_prepare_the_first_run_times_the_machine(tiny, monkeypatch, tmp_path):
    """Negative control: with `prepare` doing nothing, the measurement lands inside a timed run."""
    target, draft = tiny("llama"), tiny("llama", "close")
    events = _events(monkeypatch, target, draft, tmp_path)
    monkeypatch.setattr(api, "prepare", lambda *a, **kw: None)
    specdec.compare(target, PROMPT, assistant_model=draft, max_new_tokens=8)
    assert _timed_inside_a_run(events)


def test_repeats_alternate_the_order(tiny, monkeypatch):
    target = tiny("llama")
    order: list[str] = []
    run = api.run_request
    monkeypatch.setattr(
        api,
        "run_request",
        lambda t, req, *a, **kw: order.append("spec" if req.drafter else "plain") or run(t, req, *a, **kw),
    )
    cmp = specdec.compare(target, PROMPT, drafter="prompt-lookup", max_new_tokens=6, repeats=4, temperature=1.0, seed=3)
    assert order == ["plain", "spec", "spec", "plain"] * 2
    # sampled: every run of a side draws from the one seed (the same tokens every repeat)
    assert len({tuple(f.token_ids) for f, _ in cmp.pairs}) == len({tuple(p.token_ids) for _, p in cmp.pairs}) == 1
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        specdec.compare(target, PROMPT, drafter="prompt-lookup", repeats=0)


def test_a_wider_stored_table_serves_a_narrower_request(tiny, monkeypatch, tmp_path):
    """`models install` times the widest table once; a later process asking for fewer rows
    reads it instead of timing again."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    model = tiny("llama").model
    calls: list[int] = []
    real = costs._time_rows
    monkeypatch.setattr(costs, "_time_rows", lambda *a, **kw: calls.append(max(a[1])) or real(*a, **kw))
    monkeypatch.delitem(costs.PASS_TABLES, model, raising=False)
    wide = costs.pass_costs(model, 20)
    costs.PASS_TABLES.pop(model, None)  # "a new process"
    narrow = costs.pass_costs(model, 9)
    assert calls == [20] and narrow.target_ms == pytest.approx(wide.target_ms, abs=1e-3)
    costs.PASS_TABLES.pop(model, None)
    costs.pass_costs(model, 40)  # control: a wider range than stored is timed
    assert calls == [20, 40]


def test_a_measurement_needed_at_once_is_taken_once_and_no_kept_one_is_lost(monkeypatch, tmp_path):
    """Processes that need the same measurement at once (here threads: each lock is an open file
    of its own): one measures, the others wait and read what it kept; stores of other keys at
    the same time are all kept (each rewrites the whole table)."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    taken: list[int] = []

    def measure() -> dict[str, float]:
        taken.append(1)
        time.sleep(0.3)
        return {"1": 5.0}

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: costs.measured("t.json", "m", lambda e: e is not None, measure), range(4)))
        list(pool.map(lambda i: costs.store_measurement("t.json", f"k{i}", i), range(24)))
    assert len(taken) == 1 and got == [{"1": 5.0}] * 4
    assert set(json.loads((tmp_path / "t.json").read_text())) == {"m", *(f"k{i}" for i in range(24))}


def test_a_repeat_drafts_from_no_earlier_repeat(tiny, monkeypatch):
    """Each repeat of a comparison begins its drafter on a memory of its own: no earlier
    repeat's output in suffix decoding's store, no acceptance learned; the pools are dropped
    after. (Two generate calls in one process share the process's pool: the spy sees that.)"""
    from specdec.drafters.suffix import STORE, SuffixDrafter
    from specdec.memory import pools_of

    target = tiny("llama")
    seen: list[tuple[str, int, int]] = []  # (pool, earlier outputs in its store, acceptance entries)
    begin = SuffixDrafter.begin

    def spy(self, session):
        store = session.memory.get(STORE)
        seen.append((session.pool, len(store.docs) if store else 0, len(session.memory.acceptance)))
        return begin(self, session)

    monkeypatch.setattr(SuffixDrafter, "begin", spy)
    specdec.compare(target, PROMPT, drafter="suffix", max_new_tokens=12, repeats=3, ignore_eos=True)
    assert len({pool for pool, _, _ in seen}) == 3 and all(n == 0 and a == 0 for _, n, a in seen)
    assert not [p for p in pools_of(target.model).pools if p.startswith("compare-")]
    seen.clear()
    for _ in range(2):
        specdec.generate(target, PROMPT, drafter="suffix", max_new_tokens=12, ignore_eos=True)
    assert [n for _, n, _ in seen] == [0, 1]
