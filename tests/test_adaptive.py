"""The chooser (`specdec.adaptive`): offers priced from hand-set estimates, the one rule that
picks among them (best rate, margin over plain, hysteresis, probes), the step log and its
replay; the engine's schedule over one drafter (`adaptive_k`), exact with k switching every
step — greedy identity, and the sampled law (chi-square) with a wrong rule as the negative
control."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from conftest import EXACT_MODES
from helpers import ALPHA, PASS, PROMPTS, Forced, chi2_pvalue, no_timing

import specdec
from specdec.adaptive import MAX_PROBE_WAIT, PROBE_SHARE, Chooser, Schedule, replay
from specdec.config import GenerationConfig, SamplingParams
from specdec.costs import PASS_TABLES, Costs
from specdec.drafters import AutoDrafter, DraftModelDrafter
from specdec.engine import Engine
from specdec.offers import MEMORY_PRIOR_WEIGHT, PLAIN, Acceptance, Estimates, Offer, StepRecord, unsent


def _learn(est: Estimates, offer: Offer, steps: int, proposed: int, accepted: int, draft_ms: float, rows=None):
    for _ in range(steps):
        est.learn(offer, proposed, accepted, draft_ms, rows)


def _pick(est: Estimates, chooser: Chooser, offers: list[Offer | None], remaining=None) -> tuple[str, int]:
    o = chooser.choose([o for o in offers if o is not None], est.plain(), remaining)
    return o.member, o.k


def test_cheap_accurate_chains_are_offered_long():
    est = Estimates(PASS, 4)
    offer = est.chain("x", "", 4, 0.4)
    _learn(est, offer, 20, 4, 4, draft_ms=4 * 0.4)  # prompt lookup on a copy: ~free, all accepted
    assert est.chain("x", "", 4, 0.4).k == 4
    assert est.chain("x", "", 2, 0.4).k == 2  # never more than the member can propose
    assert est.chain("x", "", 0, 0.4) is None  # nothing to propose


def test_expensive_or_wrong_drafts_turn_drafting_off_and_probe():
    est, ch = Estimates(PASS, 4), Chooser()
    offer = est.chain("x", "", 4, 19.0)
    for _ in range(10):  # a draft model at 19 ms a token whose first draft is accepted half of the time
        _learn(est, offer, 1, 4, 0, draft_ms=4 * 19.0)
        _learn(est, offer, 1, 4, 1, draft_ms=4 * 19.0)
    picks = [_pick(est, ch, [est.chain("x", "", 4, 19.0)]) for _ in range(40)]
    # plain steps, with a probe (the offer as offered: one token, the best it has) after 4, then 8, 16 ...
    assert picks[:5] == [(PLAIN, 0)] * 4 + [("x", 1)] and picks[5:14] == [(PLAIN, 0)] * 8 + [("x", 1)]
    assert ch.wait <= MAX_PROBE_WAIT
    rep = ch.report()
    assert rep["steps"][PLAIN]["steps"] == sum(p == (PLAIN, 0) for p in picks)
    assert [s["why"] for s in ch.log[:5]] == ["plain"] * 4 + ["probe"]


def test_the_estimates_follow_a_change_of_topic():
    est, ch = Estimates(PASS, 4), Chooser()
    offer = est.chain("x", "", 4, 1.0)
    _learn(est, offer, 30, 4, 4, draft_ms=4.0)
    assert _pick(est, ch, [est.chain("x", "", 4, 1.0)]) == ("x", 4)
    _learn(est, offer, 30, 4, 0, draft_ms=4.0)  # the drafts stop being accepted
    assert _pick(est, ch, [est.chain("x", "", 4, 1.0)]) == (PLAIN, 0)
    _learn(est, offer, 30, 2, 2, draft_ms=2.0)  # and recover
    assert _pick(est, ch, [est.chain("x", "", 4, 1.0)])[1] >= 2


def test_a_step_without_a_proposal_is_no_evidence():
    est = Estimates(PASS, 3)
    offer = est.chain("x", "", 3, 0.1)
    _learn(est, offer, 5, 3, 3, draft_ms=0.3)
    before = est.alpha("x", "")
    est.learn(offer, 0, 0, 0.1)  # prompt lookup found no match
    assert est.alpha("x", "") == before


def test_a_known_cost_is_priced_before_any_step():
    """A draft model's stored one-row pass time: at 19 ms a token with the prior acceptance,
    drafting is predicted to lose to plain decoding before it ever drafts."""
    est = Estimates(PASS, 4)
    assert est.chain("x", "", 4, 19.0).rate < est.plain().rate
    assert _pick(est, Chooser(), [est.chain("x", "", 4, 19.0)]) == (PLAIN, 0)


def test_a_stored_draft_cost_moves_with_the_machine():
    """A draft step timed at a slow moment (the stored table's) is read at the machine's speed
    of now (the pass table's online scale) until the request measures it."""
    costs = dataclasses.replace(PASS)
    est = Estimates(costs, 4)
    before = est.draft_cost("x", 8.0)
    costs.observe(1, 0.5 * costs.target(1), weight=1.0)  # the machine now runs twice as fast
    assert before == 8.0 and est.draft_cost("x", 8.0) == pytest.approx(4.0)
    est.learn(Offer("x", 2, 2.0, 40.0, draft_ms=4.0), 2, 2, draft_ms=2 * 6.0)  # measured: the measurements lead
    assert est.draft_cost("x", 8.0) == pytest.approx(0.7 * 4.0 + 0.3 * 6.0)
    costs.observe(1, 4 * costs.target(1), weight=1.0)
    assert est.draft_cost("x", 8.0) == pytest.approx(0.7 * 4.0 + 0.3 * 6.0)


def test_one_slow_drafting_step_moves_the_cost_by_at_most_a_doubling():
    """A first call's allocation or a moment of load (a 379 ms draft step where 50 is usual) is
    not the member's cost: it counts as twice the estimate at most."""
    est = Estimates(PASS, 8)
    offer = est.measured("x", 8, 10.0)
    est.learn(offer, 4, 4, draft_ms=400.0, rows=5)
    assert est.draft_cost("x", 10.0) == pytest.approx(0.7 * 10.0 + 0.3 * 20.0)
    assert est.records["x"].step[1] < 2 * 10.0 * 4 + PASS.rows(5) + 1


def test_the_best_rate_wins_plain_below_the_margin():
    est, ch = Estimates(PASS, 4), Chooser()
    a, b = Offer("a", 2, 2.0, 40.0), Offer("b", 4, 3.0, 50.0)
    assert ch.choose([a, b], est.plain()).member == "b"
    worse = Offer("c", 1, 1.02, 30.0)  # 2% better than plain: not enough
    assert Chooser().choose([worse], est.plain()).member == PLAIN


def test_the_incumbent_keeps_the_step_within_the_hysteresis():
    """Another member takes the step from the one that drafted last only if it beats it by 10%:
    each switch costs a catch-up, and estimates a few percent apart are the same estimate."""
    est, ch = Estimates(PASS, 4), Chooser()
    assert ch.choose([Offer("a", 4, 3.0, 50.0)], est.plain()).member == "a"
    near = [Offer("a", 4, 3.0, 50.0), Offer("b", 4, 3.2, 50.0)]  # b 6.7% better
    assert ch.choose(near, est.plain()).member == "a"
    far = [Offer("a", 4, 3.0, 50.0), Offer("b", 4, 3.5, 50.0)]  # b 16.7% better
    assert ch.choose(far, est.plain()).member == "b" and ch.switches == 1


def test_plain_steps_probe_each_member_in_turn():
    est, ch = Estimates(PASS, 4), Chooser()
    slow = [Offer("a", 1, 1.0, 60.0), Offer("b", 1, 1.1, 60.0)]
    picks = [ch.choose(slow, est.plain(), 100).member for _ in range(14)]
    # probes after 4, then 8 plain steps; the member that drafted least recently first
    assert picks[:5] == [PLAIN] * 4 + ["a"] and picks[5:14] == [PLAIN] * 8 + ["b"]


def test_no_probe_where_catching_up_costs_too_much():
    est = Estimates(PASS, 4)
    far = [Offer("d", 1, 1.0, 60.0, catch_up_ms=5000.0)]  # 500 tokens behind, 40 tokens to go
    ch = Chooser()
    assert {ch.choose(far, est.plain(), 40).member for _ in range(20)} == {PLAIN}
    near = [Offer("d", 1, 1.0, 60.0, catch_up_ms=5.0)]
    assert "d" in {ch.choose(near, est.plain(), 40).member for _ in range(40)}


def test_a_probe_in_a_batch_is_priced_at_the_tokens_the_whole_batch_waits_for():
    """A catch-up stalls the pass every sequence of the batch waits for: a probe may spend
    PROBE_SHARE of the sequence's remaining tokens, priced at the batch's plain rate. A 100 ms
    catch-up with 40 tokens to go: alone (one token per 30 ms, 3.3 tokens) it is probed; beside
    seven sequences (8 tokens per 72 ms, 11 tokens) never."""
    probe = [Offer("d", 1, 1.0, 60.0, catch_up_ms=100.0)]
    alone, ch = Estimates(PASS, 4), Chooser()
    assert "d" in {ch.choose(probe, alone.plain(), 40).member for _ in range(20)}
    batch, ch = Estimates(PASS, 4), Chooser()
    batch.step(40, (7, 7.0))
    assert batch.plain().rate * 100.0 > PROBE_SHARE * 40
    assert {ch.choose(probe, batch.plain(), 40).member for _ in range(20)} == {PLAIN}


def test_acceptance_is_kept_per_situation():
    est = Estimates(PASS, 4)
    _learn(est, est.chain("pl", 1, 2, 0.1), 30, 2, 0, draft_ms=0.1)  # one-token matches: never accepted
    _learn(est, est.chain("pl", 3, 4, 0.1), 30, 4, 4, draft_ms=0.1)  # three-token matches: always
    assert est.chain("pl", 1, 2, 0.1).rate < est.plain().rate
    assert est.chain("pl", 3, 4, 0.1).k == 4


def test_earlier_requests_acceptance_is_the_next_ones_prior():
    """One-token matches never accepted in a request: the next request with the same memory
    prices them below plain, where a fresh one (prior alpha_1 = 0.6) drafts them; a member not
    remembered (a draft model) starts from the prior either way."""
    memory: dict = {}
    first = Estimates(PASS, 4, memory, remembered={"pl"})
    _learn(first, first.chain("pl", 1, 2, 0.1), 30, 2, 0, draft_ms=0.2)
    _learn(first, first.chain("dm", "", 2, 15.0), 30, 2, 0, draft_ms=30.0)
    assert set(memory) == {("pl", 1)}
    assert Estimates(PASS, 4, memory, remembered={"pl"}).chain("pl", 1, 2, 0.1).rate < PASS.rows(1) ** -1
    assert Estimates(PASS, 4).chain("pl", 1, 2, 0.1).rate > 1.03 / PASS.rows(1)
    assert Estimates(PASS, 4, memory, remembered={"pl"}).alpha("pl", 3)[0] == pytest.approx(0.6)


def test_a_prior_from_many_earlier_proposals_outweighs_one_new_one():
    memory = Acceptance(4, 0.99)
    for n in range(100):
        memory.update(1, 1 if n % 4 == 0 else 0)
    request = Acceptance(4, 0.9, *memory.as_prior())
    request.update(1, 1)
    a = memory.alpha()[0]
    assert request.alpha()[0] == pytest.approx((1 + MEMORY_PRIOR_WEIGHT * a) / (1 + MEMORY_PRIOR_WEIGHT))
    assert request.alpha()[0] < 0.45
    once = Acceptance(4, 0.99)
    once.update(1, 0)
    assert once.as_prior()[1][0] == 1.0


def test_in_a_batch_a_chains_k_is_priced_at_what_its_rows_add_to_the_pass():
    """Alone, a draft accepted half of the time pays (1.5 tokens for 36 ms against 1 for 30).
    Beside 20 rows that commit 20 tokens the pass is on its linear part: one more row costs 6 ms
    for 0.5 more tokens, less than the batch's own 21 tokens per 150 ms — a plain step."""
    est = Estimates(PASS, 8)
    for i in range(40):
        est.learn(Offer("x", 1, 1.5, 36.0), 1, i % 2, 0.0)
    assert est.chain("x", "", 4, 0.0).rate > est.plain().rate
    est.step(None, (20, 20.0))
    assert est.chain("x", "", 4, 0.0).rate < est.plain().rate
    assert est.plain().tokens == 21.0 and est.plain().ms == PASS.rows(21)


# -- members that size their own proposals (a draft model by confidence, a tree drafter) ------
def test_a_self_sized_member_is_offered_at_the_deepest_k_and_priced_by_what_its_steps_did():
    est = Estimates(PASS, 8)
    # unmeasured, its first probe goes as deep as the position model says pays, not to the budget
    first = est.measured("x", 8, 6.0, prior=0.85)
    assert first.k == est.chain("x", "", 8, 6.0, prior=0.85).k and 1 < first.k < 8
    est.learn(first, 3, 3, 18.0, rows=4)
    assert est.measured("x", 8, 6.0).k == 8 and est.measured("x", 5, 6.0).k == 5  # measured: the deepest
    for _ in range(10):  # it stopped at 3 drafts, all kept: 4 tokens for 3 * 6 + pass(4) ms
        est.learn(est.measured("x", 8, 6.0), 3, 3, 18.0, rows=4)
    tokens, drafted, rows = est.records["x"].step
    assert [tokens, drafted, rows] == pytest.approx([4.0, 3.0, 4.0], rel=0.12)
    assert est.measured("x", 8, 6.0).ms == pytest.approx(18.0 + PASS.rows(4), rel=0.12)
    assert est.draft_cost("x", 6.0) == pytest.approx(6.0)  # per token it drafted, not per k asked
    assert _pick(est, Chooser(), [est.measured("x", 8, 6.0)]) == ("x", 8)
    for _ in range(30):  # now it drafts 4 in vain every step: 1 token for 24 + pass(5) ms
        est.learn(est.measured("x", 8, 6.0), 4, 0, 24.0, rows=5)
    assert _pick(est, Chooser(), [est.measured("x", 8, 6.0)]) == (PLAIN, 0)


def test_in_a_batch_a_self_sized_members_record_is_priced_on_the_batchs_pass():
    """What its steps did (4 tokens for 3 drafts over 4 rows) beside the rest of a batch (6 rows
    committing 6 tokens): 10 tokens for 3 drafts and one pass over 10 rows."""
    est = Estimates(PASS, 8)
    first = est.measured("x", 8, 6.0, prior=0.85)
    for _ in range(40):
        est.learn(first, 3, 3, 18.0, rows=4)
    tokens, drafted, rows = est.records["x"].step
    est.step(None, (6, 6.0))
    offer = est.measured("x", 8, 6.0)
    assert offer.k == 8 and offer.tokens == pytest.approx(6.0 + tokens)
    assert offer.ms == pytest.approx(6.0 * drafted + PASS.rows(round(6 + rows)))


def test_one_unlucky_first_draft_does_not_rank_a_self_sized_member_below_plain():
    flat = Costs({r: 30.0 for r in range(1, 10)})
    est = Estimates(flat, 8)
    est.learn(est.measured("x", 8, 6.0), 1, 0, 6.0, rows=2)
    assert _pick(est, Chooser(), [est.measured("x", 8, 6.0)]) == ("x", 8)
    for _ in range(5):
        est.learn(est.measured("x", 8, 6.0), 1, 0, 6.0, rows=2)
    assert _pick(est, Chooser(), [est.measured("x", 8, 6.0)]) == (PLAIN, 0)


def test_earlier_requests_record_is_where_a_request_starts():
    """`StepRecord`: a request prices a self-sized member by what its steps did in earlier
    requests until its own steps say otherwise; each verified step also moves that record. The
    record keeps what a step did (tokens, drafts, rows), priced by the machine now: a record
    kept while the machine was loaded does not keep the member out once it is not."""
    flat = Costs({r: 30.0 for r in range(1, 10)})
    record = StepRecord()
    record.step = (2.5, 2.0, 3.0)  # earlier requests: 2.5 tokens per step of 2 drafts and 3 rows
    est = Estimates(flat, 8)
    first = est.measured("x", 8, 6.0, kept=record)
    assert first.tokens == 2.5 and first.ms == 2 * 6.0 + 30.0  # priced now: 2 drafts at 6 ms, one pass
    for _ in range(6):  # six drafts rejected outright: 1 token for 6 + 30 ms each
        est.learn(est.measured("x", 8, 6.0, kept=record), 1, 0, 6.0, rows=2)
    assert _pick(est, Chooser(), [est.measured("x", 8, 6.0, kept=record)]) == ("x", 8)
    assert record.step[0] < 2.5 and record.step[1] < 2.0  # the record heard of them
    # a draft timed at 10x its cost while the machine was loaded: the next request prices it by
    # its cost now (the record holds no ms), and it still beats plain decoding
    loaded = Estimates(flat, 8)
    loaded.learn(loaded.measured("x", 8, 6.0, kept=record), 2, 1, 120.0, rows=3)
    calm = Estimates(flat, 8)
    assert _pick(calm, Chooser(), [calm.measured("x", 8, 6.0, kept=record)]) == ("x", 8)
    # a seeded sampled request (`reproducible`) never reads it: no clock may enter its choices
    repro = Estimates(flat, 8, reproducible=True)
    assert repro.measured("x", 8, 6.0, kept=record).tokens != 2.5


# -- the step log and its replay ---------------------------------------------------------------
def test_a_recorded_log_replays_to_the_same_picks_and_a_changed_rule_shows_its_differences():
    rng = random.Random(0)
    est, ch = Estimates(PASS, 4), Chooser()
    for _ in range(60):
        offers = [Offer(m, rng.randint(1, 4), 1 + 2 * rng.random(), 30 + 30 * rng.random()) for m in "abc"]
        pick = ch.choose(rng.sample(offers, rng.randint(0, 3)), est.plain(), 50)
        ch.committed(1 + pick.k // 2, 1.0, 30.0)
    log = ch.report()["log"]
    assert {s["why"] for s in log} >= {"best", "plain"}
    assert replay(log) == []  # the same rule: the same picks, step by step
    diff = replay(log, Chooser(margin=1.5))
    # a stricter margin: plain steps instead, each priced below what the log's pick expected
    instead = [d for d in diff if d["new"][0] == PLAIN]
    assert instead and all(d["rate_ratio"] < 1 for d in instead)
    members = ch.report()["members"]
    assert sum(m["steps"] for m in members.values()) == 60 and sum(m["share"] for m in members.values()) == 1.0


# -- the schedule in the engine: exactness with k switching --------------------------------------
class _Switching:
    """`chooser=`: the schedule's k, a seeded random one in 0..k_max every step (0: a plain
    step; the drafter's offer at that k where it has one); `picks`: the k of every step."""

    def __init__(self, seed: int, k_max: int) -> None:
        self.rng, self.k_max, self.picks = random.Random(seed), k_max, []

    def pick(self, offers, plain):
        k = self.rng.randint(0, self.k_max)
        pick = dataclasses.replace(offers[0], k=k) if offers and k else plain
        self.picks.append(pick.k)
        return pick

    def __call__(self, margin: float) -> Chooser:
        return Forced(self.pick, margin)


@pytest.mark.parametrize("dtype", EXACT_MODES)
def test_greedy_identity_with_k_switching_every_step(tiny, dtype):
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    choose = _Switching(0, 4)
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
        for method in ("draft", "prompt-lookup", "lookahead"):
            kw = {"assistant_model": draft} if method == "draft" else {"drafter": method}
            out = specdec.generate(
                target, prompt, k=4, adaptive_k=True, max_new_tokens=24, ignore_eos=True, chooser=choose, **kw
            )
            assert out.token_ids == plain.token_ids, (prompt, method)
    assert {0, 1, 4} <= set(choose.picks)


def test_the_real_schedule_is_exact_and_reports(tiny):
    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])
    plain = specdec.generate(target, PROMPTS[0], max_new_tokens=30, ignore_eos=True)
    for name, kw in (("draft-model", {"assistant_model": draft}), ("lookahead", {"drafter": "lookahead"})):
        out = specdec.generate(target, PROMPTS[0], k=4, adaptive_k=True, max_new_tokens=30, ignore_eos=True, **kw)
        assert out.token_ids == plain.token_ids
        rep = out.metrics.drafter_info["schedule"]
        # one logged choice per step with budget for a draft (the last step, one token left, has none)
        assert out.metrics.target_forwards - 1 <= len(rep["log"]) <= out.metrics.target_forwards
        assert sum(m["steps"] for m in rep["members"].values()) == len(rep["log"])
        assert all(s["pick"][0] in (PLAIN, name) for s in rep["log"])
        assert all(s["committed"] >= 1 for s in rep["log"][:-1])  # (the finishing step may stop early)
    fixed = specdec.generate(
        target, PROMPTS[0], assistant_model=draft, k=4, max_new_tokens=30, ignore_eos=True, adaptive_k=False
    )
    assert "schedule" not in fixed.metrics.drafter_info


def test_a_member_that_prices_nothing_itself_is_offered_by_its_steps():
    """A drafter outside auto's members (lookahead: a tree and window rows) is priced by what
    its steps did: slow drafting turns it off, with probes, and good steps bring it back."""
    sched = Schedule("t", None, Estimates(PASS, 4))

    def step(good: bool) -> int:
        k = sched.choose(4)
        # good: 4 of 4 kept over 5 rows; bad: none kept over 7 rows (a tree and a window)
        sched.update(4 if k else 0, 4 if k and good else 0, 1.0 if k else 0.0, rows=5 if good else 7)
        return k

    # no evidence yet: the position model's guess drafts, as deep as it says pays (a bounded probe)
    assert step(False) == Estimates(PASS, 4).chain("t", "", 4, 0.0).k > 0
    bad = [step(False) for _ in range(40)]
    assert bad.count(0) > 30 and bad.count(4) >= 2  # off, with probes
    good = [step(True) for _ in range(200)]
    assert good[-10:] == [4] * 10  # a probe found it good again


@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)], ids=["T1", "T0.7-topk"]
)
@pytest.mark.slow
def test_sampling_law_with_k_switching(small_vocab, exact_joint, sample_joint, monkeypatch, sampling):
    target, draft = small_vocab
    no_timing(monkeypatch)
    choose = _Switching(1, 2)
    counts = sample_joint(
        target, lambda: DraftModelDrafter(draft), sampling, runs=3000, adaptive_k=True, chooser=choose
    )
    assert {0, 1, 2} <= set(choose.picks)
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) > ALPHA


@pytest.mark.slow
def test_wrong_rule_fails_with_k_switching(small_vocab, exact_joint, sample_joint, monkeypatch, wrong_rule):
    """Negative control: the same test with a rule that recovers from p after a rejection."""
    wrong_rule("rejection")
    target, draft = small_vocab
    no_timing(monkeypatch)
    sampling = SamplingParams(temperature=1.0)
    counts = sample_joint(
        target, lambda: DraftModelDrafter(draft), sampling, runs=3000, adaptive_k=True, chooser=_Switching(1, 2)
    )
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) <= ALPHA


def test_pass_costs_follow_the_measured_passes(tiny, monkeypatch):
    """The engine's measured decode passes scale the cost table online (load, longer context)."""
    from specdec import costs

    c = Costs({1: 10.0, 2: 12.0, 4: 20.0})
    for _ in range(60):
        c.observe(2, 24.0)  # everything runs twice as slow as tabled now
    assert c.scale == pytest.approx(2.0, rel=0.01) and c.target(4) == pytest.approx(40.0, rel=0.01)
    c.observe(99, 1.0)  # outside the table: ignored
    assert c.scale == pytest.approx(2.0, rel=0.01)
    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])
    table = Costs({r: 1e3 for r in range(1, 10)})  # a table far slower than this tiny model runs
    monkeypatch.setattr(costs, "pass_costs", lambda t, max_rows: table)
    monkeypatch.setitem(PASS_TABLES, target.model, table)  # (what the engine's passes update)
    out = specdec.generate(target, PROMPTS[0], assistant_model=draft, k=4, max_new_tokens=20, ignore_eos=True)
    assert table.scale < 0.5 and out.metrics.drafter_info["schedule"]["pass_scale"] == round(table.scale, 3)


def test_an_unsent_proposal_is_scored_as_its_verification_would_have_been():
    """`unsent`: a chain or tree that did not go, against the tokens the step committed — the
    longest path it follows; where that path runs to the end of what was committed, only that
    far is known (counted as proposed that far)."""
    assert unsent([5, 6, 7], None, [5, 6, 9, 1]) == (3, 2)  # rejected at the third
    assert unsent([5, 6], None, [5, 6, 9]) == (2, 2)  # all kept, then the target's own token
    assert unsent([5, 6, 7, 8], None, [5, 6]) == (2, 2)  # the rest is unknown
    assert unsent([4, 6], None, [5, 6]) == (2, 0)
    # a tree: 5 -> (6 -> 7, 8), 9; the committed path 5 8 3 follows 5 then 8
    tokens, parents = [5, 9, 6, 8, 7], [-1, -1, 0, 0, 2]
    assert unsent(tokens, parents, [5, 8, 3]) == (3, 2)
    assert unsent(tokens, parents, [5, 6]) == (2, 2)
    est = Estimates(PASS, 4)
    offer = est.chain("pl", 3, 3, 0.0)
    before = est.alpha("pl", 3)[0]
    for _ in range(10):
        est.observe(offer, *unsent([5, 6, 7], None, [1, 2]))  # never followed
    assert est.alpha("pl", 3)[0] < before / 2


# -- exploring what a request has not measured -------------------------------------------------
# a 2-core CPU where the 0.5B draft's step costs a third of the 1.5B target's one-row pass
ZEN = Costs({1: 45.0, 2: 46.0, 3: 47.0, 4: 48.0, 5: 50.0, 6: 52.0, 7: 54.0, 8: 56.0, 9: 58.0, 16: 72.0, 17: 74.0})


def test_an_unmeasured_draft_is_tried_first_where_the_request_repays_its_catch_up():
    """No request has measured the draft: it is offered at what it plausibly reaches
    (EXPLORE_ALPHA), its catch-up spread over the budget, at a bounded depth. After a 57-token
    prompt with 63 tokens to go it is the first step's pick; after a long prompt with 16 tokens to
    go (its catch-up 498 ms) it loses to plain decoding, which is right there."""
    from specdec.offers import EXPLORE_ALPHA

    coding = Estimates(ZEN, 16)
    coding.step(63)
    first = coding.measured("draft-model", 16, 15.0, 127.0, prior=EXPLORE_ALPHA)
    assert _pick(coding, Chooser(), [first], 63)[0] == "draft-model"
    assert first.k < 16 and first.rate > 1.3 * coding.plain().rate  # a probe as deep as it pays
    extraction = Estimates(ZEN, 16)
    extraction.step(16)
    offer = extraction.measured("draft-model", 16, 15.0, 498.0, prior=EXPLORE_ALPHA)
    assert _pick(extraction, Chooser(), [offer], 16) == (PLAIN, 0)
    # once measured, its offer is its measurement: a draft rejected outright goes off
    for _ in range(8):
        coding.learn(coding.measured("draft-model", 16, 15.0, prior=EXPLORE_ALPHA), 3, 0, 45.0, rows=4)
    assert _pick(coding, Chooser(), [coding.measured("draft-model", 16, 15.0, prior=EXPLORE_ALPHA)], 40) == (PLAIN, 0)


def test_what_earlier_requests_measured_on_this_machine_is_a_new_requests_prior(tiny):
    """`Pricing.keep` adds a greedy request's counts to the history of its target, member scope
    and situation; `Pricing.past` gives them to the next request as the prior of a member it has
    not measured: a draft that was rejected is no longer explored, one that was accepted is.
    The history is bounded per position; a reproducible request neither reads nor adds to it."""
    from specdec.costs import HISTORY_CAP, Pricing
    from specdec.offers import EXPLORE_ALPHA

    target = tiny("llama").model
    pricing = Pricing(target, history={})
    for acc in ([0.0, 0.0], [1.0, 0.0]):  # two requests: the draft's first token kept once in ten
        pricing.keep("d|draft-model", {"": [[10.0, 5.0], [acc[0], acc[1]]]})
    past = pricing.past("d|draft-model")
    assert past[""][0][0] == pytest.approx(0.7 * 10 + 10) and past[""][1][0] == pytest.approx(1.0)
    est = Estimates(ZEN, 16, history={("draft-model", s): c for s, c in past.items()})
    assert est.alpha("draft-model", "", EXPLORE_ALPHA)[0] < 0.25
    assert _pick(est, Chooser(), [est.measured("draft-model", 16, 15.0, 0.0, prior=EXPLORE_ALPHA)], 63) == (PLAIN, 0)
    fresh = Estimates(ZEN, 16)  # the same draft on a machine without history is explored
    assert fresh.alpha("draft-model", "", EXPLORE_ALPHA)[0] == pytest.approx(EXPLORE_ALPHA)
    for _ in range(100):
        pricing.keep("d|draft-model", {"": [[10.0], [9.0]]})
    assert pricing.past("d|draft-model")[""][0][0] <= HISTORY_CAP
    repro = Pricing(target, reproducible=True, history=pricing.history)
    assert repro.past("d|draft-model") == {}
    repro.keep("other", {"": [[1.0], [1.0]]})
    assert len(pricing.history) == 1


def test_auto_keeps_its_members_measurements_and_prices_a_batch_on_its_pass(tiny):
    """A greedy auto request leaves its members' counts in the history (the draft's under its
    own identity); a sampled one does not. In a batch every offer is priced on the batch's pass:
    the plain offer of a sequence there commits the others' tokens too."""
    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])
    history: dict = {}
    tables = lambda t, rows: PASS  # noqa: E731
    eng = Engine(target.model, target.tokenizer, pass_tables=tables, history=history)
    cfg = GenerationConfig(max_new_tokens=24, k=8, ignore_eos=True)
    ids = [target.tokenizer.encode(p) for p in PROMPTS[:2]]
    sids = [eng.add(i, cfg, SamplingParams(), AutoDrafter(target.model, draft.model)) for i in ids]
    while eng.has_work():
        eng.step()
    logs = [eng.result(s).metrics.drafter_info["schedule"]["log"] for s in sids]
    assert all(any(step["plain"][2] > 1.0 for step in log) for log in logs)  # (tokens of the whole pass)
    assert any("draft-model" in key for key in history) and any("prompt-lookup" in key for key in history)
    before = {k: str(v) for k, v in history.items()}
    eng.add(ids[0], cfg, SamplingParams(temperature=1.0, seed=3), AutoDrafter(target.model, draft.model))
    while eng.has_work():
        eng.step()
    assert {k: str(v) for k, v in history.items()} == before


def test_the_history_in_the_cache_is_kept_between_processes_and_bounded(tiny, tmp_path, monkeypatch):
    """The cache's acceptance table: what one Pricing keeps another reads (a later process), and
    it holds at most HISTORY_KEYS entries, the least recently changed dropped first."""
    from specdec import costs
    from specdec.costs import ACCEPTANCE_FILE, Pricing

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    target = tiny("llama").model
    Pricing(target).keep("s|prompt-lookup", {"1": [[4.0], [1.0]]})
    assert Pricing(target).past("s|prompt-lookup") == {"1": [[4.0], [1.0]]}
    for i in range(costs.HISTORY_KEYS + 5):
        costs.update_measurement(ACCEPTANCE_FILE, f"k{i}", lambda old: 1, limit=costs.HISTORY_KEYS)
    table = json.loads((tmp_path / ACCEPTANCE_FILE).read_text())
    assert len(table) == costs.HISTORY_KEYS and "k0" not in table and f"k{costs.HISTORY_KEYS + 4}" in table
