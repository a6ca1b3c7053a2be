"""Adaptive k (`GenerationConfig.adaptive_k`): the controller's choices from hand-set
estimates, and exactness with k switching every step — greedy identity, and the sampled law
(chi-square) with a wrong rule as the negative control."""

from __future__ import annotations

import random

import pytest
from conftest import EXACT_MODES
from helpers import ALPHA, PASS, PROMPTS, chi2_pvalue, no_timing

import specdec
from specdec.adaptive import MAX_PROBE_WAIT, KController
from specdec.config import SamplingParams
from specdec.costs import PASS_TABLES, Costs
from specdec.drafters import DraftModelDrafter, Switchable


class _Chain(Switchable):
    """What the controller asks of a chain drafter: it can always propose k, cost unknown."""

    name = "chain"


def _feed(c: KController, steps: int, asked: int, accepted: int, draft_ms: float) -> None:
    """Verified steps of the chain drafter's (only) situation, as if each had drafted."""
    for _ in range(steps):
        c._situation = ""
        c.update(asked, asked, accepted, draft_ms)


def test_cheap_accurate_drafts_get_long_proposals():
    c = KController(_Chain(), 4, PASS)
    assert c.choose(4) == 4  # cost not measured yet: draft to measure it
    _feed(c, 20, 4, 4, draft_ms=0.4)  # prompt lookup on a copy: ~free, all accepted
    assert c.choose(4) == 4
    assert c.choose(2) == 2  # never more than the budget


def test_expensive_or_wrong_drafts_turn_drafting_off_and_probe():
    c = KController(_Chain(), 4, PASS)
    c.choose(4)
    for _ in range(10):  # a draft model at 19 ms a token whose first draft is accepted half of the time
        _feed(c, 1, 4, 0, draft_ms=4 * 19.0)
        _feed(c, 1, 4, 1, draft_ms=4 * 19.0)
    picks = [c.choose(4) for _ in range(40)]
    # plain steps, with a one-token probe after 4, then 8, 16 ... plain steps
    assert picks[:5] == [0, 0, 0, 0, 1] and picks[5:14] == [0] * 8 + [1]
    assert set(picks) == {0, 1} and c.chooser.prober.wait <= MAX_PROBE_WAIT
    rep = c.report()
    assert rep["k_chosen"][0] == picks.count(0) and rep["k_chosen"][4] == 1 and rep["draft_ms_per_token"] > 18


def test_the_estimates_follow_a_change_of_topic():
    c = KController(_Chain(), 4, PASS)
    c.choose(4)
    _feed(c, 30, 4, 4, draft_ms=4.0)
    assert c.choose(4) == 4
    _feed(c, 30, 4, 0, draft_ms=4.0)  # the drafts stop being accepted
    assert c.choose(4) == 0
    _feed(c, 30, 2, 2, draft_ms=2.0)  # and recover
    assert c.choose(4) >= 2


def test_a_step_without_a_proposal_is_no_evidence():
    c = KController(_Chain(), 3, PASS)
    c.choose(3)
    _feed(c, 5, 3, 3, draft_ms=0.3)
    before = c.chooser.acceptance[("chain", "")].alpha()
    c._situation = ""
    c.update(3, 0, 0, 0.1)  # prompt lookup found no match
    assert c.chooser.acceptance[("chain", "")].alpha() == before


def test_a_known_cost_needs_no_measuring_step():
    """A drafter that knows its cost (a draft model: its one-row pass time) is not made to
    draft first: at 19 ms a token with the prior acceptance, drafting is predicted to lose."""

    class Known(_Chain):
        def cost_ms(self) -> float:
            return 19.0

    assert KController(Known(), 4, PASS).choose(4) == 0


def test_a_stored_draft_cost_moves_with_the_machine():
    """A draft step timed at a slow moment (the stored table's) is read at the machine's speed
    of now (the pass table's online scale) until the request measures it: a machine running at
    half the table's times halves it too, and drafting that pays at the table's ratio still does."""
    import dataclasses

    class Known(_Chain):
        def cost_ms(self) -> float:
            return 8.0  # a third of the table's one-row pass

    costs = dataclasses.replace(PASS)
    c = KController(Known(), 4, costs)
    before = c.chooser.draft_cost(c.name)
    costs.observe(1, 0.5 * costs.target(1), weight=1.0)  # the machine now runs twice as fast
    assert before == 8.0 and c.chooser.draft_cost(c.name) == pytest.approx(4.0)
    _feed(c, 1, 2, 2, draft_ms=2 * 6.0)  # measured: from now on the measurements lead
    assert c.chooser.draft_cost(c.name) == pytest.approx(0.7 * 4.0 + 0.3 * 6.0)
    costs.observe(1, 4 * costs.target(1), weight=1.0)
    assert c.chooser.draft_cost(c.name) == pytest.approx(0.7 * 4.0 + 0.3 * 6.0)


def _switching(monkeypatch, seed: int, k_max: int) -> list[int]:
    """The controller replaced by one that picks a seeded random k in 0..k_max every step."""
    rng = random.Random(seed)
    picks: list[int] = []

    def choose(self, k: int, remaining=None, others=(0, 0.0)) -> int:
        picks.append(rng.randint(0, min(k, k_max)))
        return picks[-1]

    monkeypatch.setattr(KController, "choose", choose)
    return picks


@pytest.mark.parametrize("dtype", EXACT_MODES)
def test_greedy_identity_with_k_switching_every_step(tiny, monkeypatch, dtype):
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    picks = _switching(monkeypatch, 0, 4)
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
        for method in ("draft", "prompt-lookup"):
            kw = {"assistant_model": draft} if method == "draft" else {"drafter": "prompt-lookup"}
            out = specdec.generate(target, prompt, k=4, adaptive_k=True, max_new_tokens=24, ignore_eos=True, **kw)
            assert out.token_ids == plain.token_ids, (prompt, method)
    assert {0, 1, 4} <= set(picks)


def test_the_real_controller_is_exact_and_reports(tiny):
    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])
    plain = specdec.generate(target, PROMPTS[0], max_new_tokens=30, ignore_eos=True)
    out = specdec.generate(
        target, PROMPTS[0], assistant_model=draft, k=4, adaptive_k=True, max_new_tokens=30, ignore_eos=True
    )
    assert out.token_ids == plain.token_ids
    rep = out.metrics.drafter_info["adaptive_k"]
    # one choice per step with budget for a draft (the last step, one token left, has none)
    assert out.metrics.target_forwards - 1 <= sum(rep["k_chosen"].values()) <= out.metrics.target_forwards
    assert rep["draft_ms_per_token"] > 0  # known before it drafts: the draft's one-row pass time
    # positions that were proposed: up to 4 (the draft may never pay on a tiny model: none)
    assert isinstance(rep["alpha_by_position"], list) and len(rep["alpha_by_position"]) <= 4
    fixed = specdec.generate(
        target, PROMPTS[0], assistant_model=draft, k=4, max_new_tokens=30, ignore_eos=True, adaptive_k=False
    )
    assert "adaptive_k" not in fixed.metrics.drafter_info


@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)], ids=["T1", "T0.7-topk"]
)
@pytest.mark.slow
def test_sampling_law_with_k_switching(small_vocab, exact_joint, sample_joint, monkeypatch, sampling):
    target, draft = small_vocab
    no_timing(monkeypatch)
    picks = _switching(monkeypatch, 1, 2)
    counts = sample_joint(target, lambda: DraftModelDrafter(draft), sampling, runs=3000, adaptive_k=True)
    assert {0, 1, 2} <= set(picks)
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) > ALPHA


@pytest.mark.slow
def test_wrong_rule_fails_with_k_switching(small_vocab, exact_joint, sample_joint, monkeypatch, wrong_rule):
    """Negative control: the same test with a rule that recovers from p after a rejection."""
    wrong_rule("rejection")
    target, draft = small_vocab
    no_timing(monkeypatch)
    _switching(monkeypatch, 1, 2)
    sampling = SamplingParams(temperature=1.0)
    counts = sample_joint(target, lambda: DraftModelDrafter(draft), sampling, runs=3000, adaptive_k=True)
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) <= ALPHA


# -- the step guard: drafters that size their own proposals (trees, extra rows) ---------------
def test_step_guard_turns_slow_drafting_off_and_probes():
    from specdec.adaptive import StepGuard

    g = StepGuard(4, PASS)
    assert g.choose() == 4  # no evidence yet: draft
    for _ in range(5):  # 7 rows (a tree and a window), 4 ms drafting, 1.3 tokens a step: slower than plain
        g.update(4, 2, 0 if _ % 3 else 1, draft_ms=4.0, rows=7)
    assert not g.drafting_pays()
    picks = [g.choose() for _ in range(14)]
    assert picks[:5] == [0, 0, 0, 0, 4] and picks[5:14] == [0] * 8 + [4]
    for _ in range(10):  # the probes find long accepted paths: drafting pays again
        g.update(4, 4, 4, draft_ms=1.0, rows=5)
    assert g.drafting_pays() and g.choose() == 4
    rep = g.report()
    assert (
        rep["drafted_steps"] == 4
        and rep["plain_steps"] == 12
        and rep["drafted_tokens_per_ms"] > rep["plain_tokens_per_ms"]
    )


@pytest.mark.parametrize("dtype", EXACT_MODES)
def test_guarded_tree_drafter_is_exact_and_reports(tiny, monkeypatch, dtype):
    """Lookahead (a token tree plus window rows) under the guard, forced to switch between
    drafted and plain steps at random: greedy output is plain decoding's."""
    from specdec.adaptive import StepGuard

    rng = random.Random(5)
    monkeypatch.setattr(StepGuard, "drafting_pays", lambda self: rng.random() < 0.5)
    target = tiny("llama", dtype=dtype)
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
        out = specdec.generate(target, prompt, drafter="lookahead", k=3, max_new_tokens=24, ignore_eos=True)
        assert out.token_ids == plain.token_ids, prompt
        guard = out.metrics.drafter_info["guard"]
        assert guard["drafted_steps"] > 0 and guard["plain_steps"] > 0


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
    assert table.scale < 0.5 and out.metrics.drafter_info["adaptive_k"]["pass_scale"] == round(table.scale, 3)


def test_in_a_batch_a_sequences_k_is_priced_at_what_its_rows_add_to_the_pass():
    """Alone, a draft accepted half of the time pays (1.5 tokens for 36 ms against 1 for 30).
    Beside 20 rows that commit 20 tokens the pass is on its linear part: one more row costs 6 ms
    for 0.5 more tokens, less than the batch's own 21 tokens per 150 ms — plain steps."""
    from specdec.adaptive import MethodChooser

    c = MethodChooser(["x"], 8, PASS, draft_ms={"x": 0.0})
    for i in range(40):
        c.update("x", None, 1, 1, i % 2, 0.0)
    outlook = {"x": (None, 4, 0.0)}
    assert c.choose(outlook)[0] == "x"
    assert c.rate("x", None, 1, others=(20, 20.0)) < c.rate("plain", None, 0, others=(20, 20.0))
    assert [c.choose(outlook, others=(20, 20.0)) for _ in range(3)] == [("plain", 0)] * 3
    # no batch: the same rates as before
    assert c.rate("x", None, 1) == c.rate("x", None, 1, others=(0, 0.0)) and c.rate("plain", None, 0) == 1 / 30.0


# -- drafters that size their own proposals by confidence (a draft model) ----------------------
class _SelfSized(_Chain):
    sizes_itself = True

    def cost_ms(self) -> float:
        return 6.0


def test_a_self_sized_drafter_gets_the_deepest_k_and_is_ranked_by_what_its_steps_did():
    c = KController(_SelfSized(), 8, PASS)
    assert c.choose(8) == 8 and c.choose(5) == 5  # whether to draft is chosen, not how deep
    c._situation = ""
    for _ in range(10):  # it stopped at 3 drafts, all kept: 4 tokens for 3 * 6 + pass(4) ms
        c.update(8, 3, 3, 18.0, rows=4)
    tokens, ms = c.chooser.realized["chain"]
    assert tokens == pytest.approx(4.0, rel=0.06) and ms == pytest.approx(18.0 + PASS.rows(4), rel=0.06)
    assert c.chooser.draft_ms["chain"] == pytest.approx(6.0)  # per token it drafted, not per k asked
    assert c.choose(8) == 8
    for _ in range(30):  # now it drafts 4 in vain every step: 1 token for 24 + pass(5) ms
        c.update(8, 4, 0, 24.0, rows=5)
    assert c.choose(8) == 0  # slower than plain, measured: plain steps (and probes)


def test_one_unlucky_first_draft_does_not_rank_a_self_sized_drafter_below_plain():
    """Its first step's record starts from what the position model predicted: a first draft
    rejected outright leaves it drafting; a few more in a row do not (a pass
    over a few rows costing what one does, as on a memory-bound CPU)."""
    c = KController(_SelfSized(), 8, Costs({r: 30.0 for r in range(1, 10)}))
    assert c.choose(8) == 8
    c._situation = ""
    c.update(8, 1, 0, 6.0, rows=2)
    assert c.choose(8) == 8
    for _ in range(5):
        c.update(8, 1, 0, 6.0, rows=2)
    assert c.choose(8) == 0


def test_a_self_sized_drafter_is_tried_early_where_nothing_pays_on_its_merits():
    """auto's members: where nothing beats plain decoding on its prior, the draft model is tried
    once (with its deepest k) before plain steps settle in; a drafter that was tried is not."""
    from specdec.adaptive import MethodChooser

    ch = MethodChooser(
        ["prompt-lookup", "draft-model"],
        8,
        PASS,
        draft_ms={"prompt-lookup": 0.1, "draft-model": 40.0},
        self_sized=frozenset({"draft-model"}),
    )
    assert ch.rate("draft-model", "", 1) < ch.rate("plain", None, 0)  # (40 ms a token never pays on its prior)
    both = {"prompt-lookup": ("", 8, 0.0), "draft-model": ("", 8, 0.0)}
    assert ch.choose(both, remaining=50)[0] == "prompt-lookup"  # copying pays: no trial
    alone = {"draft-model": ("", 8, 0.0)}  # no n-gram match: nothing pays on its merits
    assert ch.choose(alone, remaining=50) == ("draft-model", 8)
    assert ch.choose(alone, remaining=50) == ("plain", 0)  # tried once; then its estimates decide
    # ...unless catching it up would cost more than a small share of the rest of the request
    far = MethodChooser(["draft-model"], 8, PASS, draft_ms={"draft-model": 40.0}, self_sized=frozenset({"draft-model"}))
    assert far.choose({"draft-model": ("", 8, 5000.0)}, remaining=50) == ("plain", 0)


def test_earlier_requests_record_of_a_self_sized_drafter_is_where_a_request_starts():
    """`StepRecord`: a request ranks a self-sized drafter by what its steps did in earlier
    requests until its own steps say otherwise, so a few unlucky one-token steps early in a
    request do not send it to plain steps; each verified step also moves the record (slowly)."""
    from specdec.adaptive import StepRecord

    flat = Costs({r: 30.0 for r in range(1, 10)})
    record = StepRecord()
    record.step = (2.5, 40.0)  # earlier requests: 2.5 tokens per 40 ms step, plain is 1 per 30 ms

    drafter = _SelfSized()
    drafter.step_record = lambda: record  # type: ignore[method-assign]
    c = KController(drafter, 8, flat)
    assert c.choose(8) == 8 and c.chooser.realized["chain"] == (2.5, 40.0)
    c._situation = ""
    for _ in range(6):  # six drafts rejected outright: 1 token for 6 + 30 ms each
        c.update(8, 1, 0, 6.0, rows=2)
    assert c.choose(8) == 8  # (from the position model's guess, these six sent it to plain)
    assert record.step[0] < 2.5 and record.step[1] < 40.0  # the record heard of them
    fresh = KController(_SelfSized(), 8, flat)
    assert fresh.choose(8) == 8
    fresh._situation = ""
    for _ in range(6):
        fresh.update(8, 1, 0, 6.0, rows=2)
    assert fresh.choose(8) == 0
    # a seeded sampled request (`reproducible`) never reads it: no clock may enter its choices
    repro = KController(drafter, 8, flat, reproducible=True)
    repro.choose(8)
    assert "chain" not in repro.chooser.realized


def test_a_prior_from_many_earlier_proposals_outweighs_one_new_one():
    """`Acceptance.as_prior`: the memory's estimate weighs what it measured (up to
    MEMORY_PRIOR_WEIGHT proposals), so one lucky draft moves a well-measured 0.25 a little, not
    to 0.6; a memory of one proposal weighs one."""
    from specdec.adaptive import MEMORY_PRIOR_WEIGHT, Acceptance

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
