"""Predicted outputs: the prediction drafter's pointer and realignment, greedy identity with
plain decoding whatever the prediction (exact, edited, unrelated; alone and inside auto),
exact sampling with a negative control, the API's rules for which drafter reads a prediction."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT_MODES
from helpers import PASS, PROMPTS, fb

import specdec
from specdec.config import SamplingParams
from specdec.drafters import AutoDrafter, DraftSession, PredictionDrafter, PromptLookupDrafter
from specdec.offers import Estimates


def started(output_so_far: list[int], prediction: list[int], **kw) -> PredictionDrafter:
    """A drafter begun on a prompt [99] and the output's first token, then told the rest."""
    d = PredictionDrafter(**kw)
    d.begin(
        DraftSession(
            [99, output_so_far[0]], 1000, SamplingParams(), torch.Generator().manual_seed(0), prediction=prediction
        )
    )
    if output_so_far[1:]:
        d.catch_up(output_so_far[1:])
    return d


def test_an_output_in_step_gets_the_rest_of_the_prediction():
    p = [10, 11, 12, 13, 14, 15, 16]
    d = started([10, 11], p)
    assert d.propose(3).tokens.tolist() == [12, 13, 14]
    o = d.offer(8, Estimates(PASS, 8))
    assert (o.situation, o.most) == (2, 5)  # matched two tokens; five left
    d.accepted(fb(3, 15))  # all three kept, then the target's own 15
    assert d.propose(8).tokens.tolist() == [16]
    d.accepted(fb(1, 0))
    assert d.propose(4).tokens.tolist() == [] and d.offer(4, Estimates(PASS, 8)) is None  # past its end: nothing
    assert d.counts() == {"accepted_tokens": 4, "rejected_tokens": 0}


def test_after_an_edit_the_output_rejoins_where_it_left():
    #    a  b  c  \n d  e  f  \n g  h
    p = [1, 2, 3, 9, 4, 5, 6, 9, 7, 8]
    d = started([1, 2, 3, 9], p)  # in step through the first line (four tokens: settled)
    assert d.propose(2).tokens.tolist() == [4, 5]
    d.accepted(fb(0, 20))  # an inserted line: 20 21 \n, then the prediction's second line
    assert d.counts()["rejected_tokens"] == 2 and d.propose(3).tokens.tolist() == []
    d.catch_up([21, 9])
    # "\n" ends two places; the first at or after where it left wins: the second line
    assert d.propose(3).tokens.tolist() == [4, 5, 6]
    d = started([1, 2, 3, 9], p)
    d.propose(2)
    d.accepted(fb(0, 7))  # the second line deleted: "\n g" occurs once
    assert d.propose(3).tokens.tolist() == [8]


def test_a_changed_word_realigns_on_the_longest_run():
    p = [5, 6, 7, 8, 5, 6, 1, 2, 3]
    d = started([5, 6, 7, 8], p)
    d.propose(2)
    d.accepted(fb(0, 40))  # 5 6 replaced by 40
    assert d.propose(4).tokens.tolist() == []  # 40 is nowhere in the prediction
    d.catch_up([6, 1])  # then the prediction's text again: "6 1" occurs once
    assert d.propose(4).tokens.tolist() == [2, 3]


def test_nothing_to_follow_without_a_prediction():
    d = PredictionDrafter()
    d.begin(DraftSession([1, 2], 100, SamplingParams(), torch.Generator().manual_seed(0)))
    assert d.offer(4, Estimates(PASS, 8)) is None and d.propose(4).tokens.tolist() == []
    with pytest.raises(ValueError, match="max_ngram"):
        PredictionDrafter(max_ngram=0)


def _edits(out: list[int]) -> dict[str, list[int]]:
    """Predictions of an output: itself, with an inserted run, a deleted run, a changed token
    (each in the middle), shifted by a prefix, and one unrelated to it."""
    m = len(out) // 2
    return {
        "exact": out,
        "inserted": out[:m] + [7, 8, 9, 7] + out[m:],
        "deleted": out[:m] + out[m + 5 :],
        "changed": out[:m] + [(out[m] + 1) % 200] + out[m + 1 :],
        "prefixed": [3, 4] + out,
        "unrelated": [(t * 7 + 3) % 200 for t in reversed(out)],
    }


@pytest.mark.parametrize("dtype", EXACT_MODES)  # where identity is guaranteed
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.slow
def test_greedy_identity_whatever_the_prediction(tiny, arch, dtype):
    target = tiny(arch, dtype=dtype)
    accepted, rejected = {}, {}
    for prompt in PROMPTS[:3]:
        plain = specdec.generate(target, prompt, max_new_tokens=40, ignore_eos=True)
        for name, pred in _edits(plain.token_ids).items():
            for drafter in ("prediction", "auto"):
                for adaptive in (True, False):
                    out = specdec.generate(
                        target,
                        prompt,
                        drafter=drafter,
                        prediction=pred,
                        k=6,
                        max_new_tokens=40,
                        ignore_eos=True,
                        adaptive_k=adaptive,
                    )
                    assert out.token_ids == plain.token_ids, (arch, prompt, name, drafter, adaptive)
                    counts = out.metrics.drafter_info["prediction"]
                    accepted[name] = accepted.get(name, 0) + counts["accepted_tokens"]
                    rejected[name] = rejected.get(name, 0) + counts["rejected_tokens"]
    # an exact prediction is taken whole (each step adds the target's bonus token besides); an
    # edited one mostly
    assert rejected["exact"] == 0 and accepted["exact"] >= 0.6 * 3 * 4 * 39
    assert accepted["inserted"] > accepted["unrelated"] and accepted["changed"] > accepted["unrelated"]


@pytest.mark.slow
def test_auto_with_a_prediction_takes_deep_chains(tiny):
    target = tiny("llama", dtype=EXACT_MODES[-1])
    prompt = PROMPTS[3]
    plain = specdec.generate(target, prompt, max_new_tokens=60, ignore_eos=True)
    out = specdec.generate(
        target, prompt, drafter="auto", prediction=plain.token_ids, k=24, max_new_tokens=60, ignore_eos=True
    )
    assert out.token_ids == plain.token_ids
    steps = out.metrics.drafter_info["schedule"]["steps"]["prediction"]
    assert max(int(k.removeprefix("k=")) for k in steps) > 8  # past the chains of copying drafters


def test_which_drafter_reads_a_prediction(tiny):
    target = tiny("llama")
    with pytest.raises(ValueError, match="does not draft from a prediction"):
        specdec.generate(target, "x", drafter="prompt-lookup", prediction="abc", max_new_tokens=2)
    with pytest.raises(ValueError, match="does not draft from a prediction"):
        specdec.generate(target, "x", drafter=PromptLookupDrafter(), prediction=[1, 2], max_new_tokens=2)
    with pytest.raises(ValueError, match="prediction token ids"):
        specdec.generate(target, "x", prediction=[10**9], max_new_tokens=2)
    req = specdec.api.request(target, "x", prediction="hello there", max_new_tokens=2)
    assert req.drafter.name == "prediction" and req.prediction == target.tokenizer.encode_text("hello there")
    req = specdec.api.request(target, "x", prediction="hello", drafter="auto", max_new_tokens=2)
    assert isinstance(req.drafter, AutoDrafter)


@pytest.mark.parametrize("drafter", ["prediction", "auto"])
def test_the_counts_include_the_step_that_finishes(tiny, drafter):
    """The pass that ends the sequence (here: its length) is counted like any other: alone, the
    prediction drafter's counts are the engine's proposed and accepted tokens."""
    target = tiny("llama", dtype=EXACT_MODES[-1])
    plain = specdec.generate(target, PROMPTS[0], max_new_tokens=24, ignore_eos=True)
    for pred in (plain.token_ids, plain.token_ids[:10] + [5, 6] + plain.token_ids[10:]):
        out = specdec.generate(
            target, PROMPTS[0], drafter=drafter, prediction=pred, k=6, max_new_tokens=24, ignore_eos=True
        )
        assert out.token_ids == plain.token_ids
        counts, m = out.metrics.drafter_info["prediction"], out.metrics
        if drafter == "prediction":
            assert counts == {"accepted_tokens": m.accepted, "rejected_tokens": m.proposed - m.accepted}
        else:
            assert 0 < counts["accepted_tokens"] <= m.accepted
        if pred == plain.token_ids:  # taken whole: every token but the prompt pass's and each step's own
            assert counts["rejected_tokens"] == 0 and counts["accepted_tokens"] + m.steps + 1 == len(plain.token_ids)


# -- the one request path: the rules every front end (CLI, API, server) builds a request by ----
def test_one_function_decides_the_drafter_k_and_config_for_every_front_end():
    from specdec.plans import PLAIN, PlanError, choose_drafter, plan_request

    def plan(**kw):
        return plan_request(target="t", mode="f32", **kw)

    # a prediction: the named reader; else the front end's default if it reads predictions; else
    # auto with a draft at hand, the prediction drafter without one
    assert plan(draft="d", named="prediction", predicted=True).drafter == "prediction"
    assert plan(draft="d", default="draft-model", predicted=True).drafter == "auto"
    assert plan(draft=None, default="draft-model", predicted=True).drafter == "prediction"
    assert plan(draft=None, default="auto", predicted=True).drafter == "auto"
    assert plan(draft=None, default=PLAIN, predicted=True).drafter == "prediction"
    with pytest.raises(PlanError, match="does not draft from a prediction") as err:
        plan(draft="d", named="draft-model", predicted=True)
    assert err.value.param == "prediction"
    # no prediction: the named, else the default, else the draft model's drafter where one is at hand
    assert plan(draft="d").drafter == "draft-model" and plan(draft="d").uses_draft
    assert plan(draft=None).drafter is None and plan(draft="d", default=PLAIN).drafter is None
    assert plan(draft="d", named="prompt-lookup").drafter == "prompt-lookup"
    assert not plan(draft="d", named="prompt-lookup").uses_draft
    with pytest.raises(PlanError, match="needs a draft model") as err:
        choose_drafter("draft-model", None, False, False)
    assert err.value.param == "speculative"
    # k: the request's ("given"), else the tuned or the drafter's own; plain decoding has no k source
    assert (
        plan(draft=None, named="prompt-lookup", k=3).config.k,
        plan(draft=None, named="prompt-lookup", k=3).k_source,
    ) == (3, "given")
    assert plan(draft=None, named="suffix").k_source in ("tuned", "default")
    assert plan(draft=None).k_source is None
    # the config's rules: a stop string is one stop; a bad field is one line naming it
    assert plan(draft=None, config={"stop": "END", "max_new_tokens": 5}).config.stop == ("END",)
    with pytest.raises(PlanError, match="max_new_tokens"):
        plan(draft=None, config={"max_new_tokens": 0})
