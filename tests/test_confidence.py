"""The draft model's depth from its own confidence (`specdec.drafters.confidence`): the pricing
rule by hand, the calibration, greedy identity and the sampling law with depths that follow
the draft's probabilities (and a wrong rule that must fail)."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT_MODES
from helpers import ALPHA, PASS, PROMPT_IDS, PROMPTS, always_draft, chi2_pvalue, no_timing

import specdec
from specdec.config import SamplingParams
from specdec.costs import Costs
from specdec.drafters import DraftModelDrafter
from specdec.drafters import draft_model as draft_module
from specdec.drafters.base import DraftSession, Feedback
from specdec.drafters.confidence import Calibration, Depth, keep_drafting
from specdec.memory import pools_of
from specdec.sampling import make_generator

# a pass over up to 5 rows costs what one does, then 6 ms a row (a memory-bound pass)
FLAT = Costs({r: 30.0 + (0.0 if r <= 5 else 6.0 * (r - 5)) for r in range(1, 12)})


def _after(chances: list[float]) -> Depth:
    d = Depth()
    for a in chances:
        d.add(a)
    return d


def test_keep_drafting_weighs_the_next_tokens_chance_against_its_cost():
    # 2 drafts, both kept surely: E = 3 in 2*8 + 30 = 46 ms; a third adds a_next for 8 ms more
    d = _after([1.0, 1.0])
    assert d.expected == 3.0 and d.all_kept == 1.0
    assert keep_drafting(d, 0.9, 8.0, FLAT)  # (3.9 / 54) > (3 / 46)
    assert not keep_drafting(d, 0.4, 8.0, FLAT)  # (3.4 / 54) < (3 / 46)
    # the same chance pays where drafting is cheap, not where a draft token costs a pass
    assert keep_drafting(d, 0.4, 1.0, FLAT) and not keep_drafting(d, 0.4, 30.0, FLAT)
    # a row that costs its full share needs more confidence than a free one (up to 5 rows here)
    deep = _after([1.0] * 3)
    assert keep_drafting(deep, 0.3, 2.0, FLAT) and not keep_drafting(deep, 0.3, 2.0, PASS)
    # what the earlier drafts risk counts: the next token only counts if all before it are kept
    assert not keep_drafting(_after([0.5, 0.5]), 0.9, 8.0, FLAT)


def test_calibration_starts_at_the_draft_probability_and_learns_acceptance():
    cal = Calibration()
    assert cal(0.95) == pytest.approx(0.95) and cal(0.15) == pytest.approx(0.15)
    for _ in range(50):  # the draft says 0.15 but the target agrees 90% of the time
        cal.update([0.15, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15], 9)
    assert cal(0.15) > 0.85
    assert cal.table()[1] == pytest.approx(0.9) and cal.table()[5] is None
    # positions after the first rejection teach nothing: only the rejected one counts
    fresh = Calibration()
    fresh.update([0.55, 0.95, 0.95], 0)
    assert fresh.table()[5] == 0.0 and fresh.table()[9] is None


def _rule_by_confidence(monkeypatch, threshold: float | None) -> list[bool]:
    """The pricing rule replaced by one that goes on while the calibrated chance that every
    draft so far is kept exceeds `threshold` (None: while its fourth decimal is even, for tiny
    models whose draft is never sure), so depths follow the draft's own probabilities of what
    it drew; the decisions are recorded."""
    decisions: list[bool] = []

    def rule(depth, a_next, draft_ms, costs) -> bool:
        p = depth.all_kept
        decisions.append(p > threshold if threshold is not None else int(p * 10000) % 2 == 0)
        return decisions[-1]

    monkeypatch.setattr(draft_module, "keep_drafting", rule)
    return decisions


@pytest.mark.parametrize("dtype", EXACT_MODES)
def test_greedy_identity_with_depths_from_confidence(tiny, monkeypatch, dtype):
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    decisions = _rule_by_confidence(monkeypatch, None)
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
        out = specdec.generate(
            target, prompt, assistant_model=draft, k=6, max_new_tokens=24, ignore_eos=True, chooser=always_draft
        )
        assert out.token_ids == plain.token_ids, prompt
    assert True in decisions and False in decisions  # both: deep drafts and early stops


def test_the_draft_stops_short_of_k_only_where_confidence_says_so(tiny, monkeypatch):
    """The real rule, priced by fixed costs: a draft model that is its own target (every token
    accepted) learns that and runs to k; with --draft-confidence 0, or --no-adaptive-k, every
    proposal is k long."""
    no_timing(monkeypatch)
    monkeypatch.setattr(draft_module.DraftModelDrafter, "cost_ms", lambda self: 2.0)
    target = tiny("qwen2")
    pools_of(target.model).pools.clear()
    out = specdec.generate(target, PROMPTS[0], assistant_model=target, k=6, max_new_tokens=120, ignore_eos=True)
    per = out.metrics.proposed_per_position
    # it starts at the prior (a tiny random model is never sure: one token), then goes deeper
    assert out.metrics.acceptance_rate == 1.0 and len(per) >= 4 and per[0] > per[-1]
    for confidence, depth in ((1, 1), (0, 5)):  # (a draft that never saw its tokens accepted stops at once)
        pools_of(target.model).pools.clear()
        drafter = DraftModelDrafter(target.model, confidence=confidence)
        drafter.begin(DraftSession(PROMPT_IDS, 64, SamplingParams(), make_generator(0, "cpu"), target.model))
        drafter.sync()
        assert len(drafter.propose(5).tokens) == depth
    fixed = specdec.generate(
        target, PROMPTS[0], assistant_model=target, k=4, max_new_tokens=21, ignore_eos=True, adaptive_k=False
    )
    assert fixed.metrics.proposed_per_position == [4, 4, 4, 4]


def test_confidence_option_is_checked():
    with pytest.raises(ValueError, match="--draft-confidence"):
        DraftModelDrafter(None, confidence=2)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["exact", "wrong-rule"])
def test_sampling_law_with_depths_from_confidence(
    small_vocab, exact_joint, sample_joint, monkeypatch, wrong_rule, broken
):
    """Depths decided by what the draft drew keep the target's law; the negative control (a rule
    that recovers from p after a rejection) must fail the same test."""
    if broken:
        wrong_rule("rejection")
    target, draft = small_vocab
    no_timing(monkeypatch)
    decisions = _rule_by_confidence(monkeypatch, 0.3)
    sampling = SamplingParams(temperature=1.0)
    counts = sample_joint(
        target,
        lambda: DraftModelDrafter(draft, vocab=0),
        sampling,
        runs=3000,
        k=3,
        adaptive_k=True,
        chooser=always_draft,
    )
    assert 0.2 < sum(decisions) / len(decisions) < 0.8  # the depth varied with what the draft drew
    p = chi2_pvalue(counts, exact_joint(target, sampling, 4))
    assert (p <= ALPHA) if broken else (p > ALPHA)


def test_the_calibration_learns_the_drafts_own_probability_even_where_it_did_not_decide_the_depth(tiny):
    """A one-token proposal (a probe; k < 2 is never priced) still records the draft's real
    probability of its token: a rejected probe must not teach that sure drafts fail."""
    target = tiny("llama")
    draft = tiny("llama", "close").model
    d = DraftModelDrafter(draft)
    d.begin(DraftSession(PROMPT_IDS * 2, 64, SamplingParams(), make_generator(0, "cpu"), target.model))
    d.calibration = Calibration()  # (this test's own, not the target's memory)
    token = int(d.propose(1).tokens[0])
    conf = d._confidences[0]
    assert 0.0 < conf < 1.0
    logits = torch.zeros(2, draft.args.vocab_size)
    logits[0, (token + 1) % draft.args.vocab_size] = 1.0  # the target disagrees
    d.accepted(Feedback([], (token + 1) % draft.args.vocab_size, logits))
    table = d.calibration.table()
    assert table[min(int(conf * 10), 9)] == 0.0 and sum(v is not None for v in table) == 1
