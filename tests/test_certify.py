"""`specdec certify`: the two-sample test's calibration and power, and certificates on models
with an 8-token vocabulary (exact rules pass, the broken control is caught)."""

from __future__ import annotations

import json
import weakref
from collections import Counter

import numpy as np
import pytest
from helpers import PROMPT_IDS, V_SMALL

from specdec.api import LoadedModel
from specdec.certify import certify, two_sample_test


def _sample(probs: np.ndarray, n: int, rng: np.random.Generator) -> Counter:
    return Counter(rng.choice(len(probs), size=n, p=probs).tolist())


def test_two_sample_test_is_calibrated_and_has_power():
    """Same law: p-values spread over (0, 1) (about alpha of them below alpha). Laws 0.09 apart
    in total variation: caught at N = 2000 nearly always. The TV estimate brackets the truth."""
    rng = np.random.default_rng(0)
    law = rng.dirichlet(np.full(30, 0.5))
    same = [
        two_sample_test([_one(_sample(law, 2000, rng))], [_one(_sample(law, 2000, rng))], resamples=50, seed=i).p_value
        for i in range(200)
    ]
    assert 0.003 <= np.mean(np.array(same) < 0.05) <= 0.11
    assert 0.35 < np.median(same) < 0.65
    shifted = law.copy()
    top = int(np.argmax(law))
    shifted[top] += 0.1
    shifted /= shifted.sum()
    tv_true = 0.5 * np.abs(shifted - law).sum()
    results = [
        two_sample_test([_one(_sample(law, 2000, rng))], [_one(_sample(shifted, 2000, rng))], resamples=200, seed=i)
        for i in range(20)
    ]
    assert np.mean([r.p_value < 0.01 for r in results]) >= 0.9
    assert np.mean([r.tv_upper >= tv_true for r in results]) >= 0.8
    assert all(r.tv_null < tv_true for r in results)


def _one(c: Counter) -> Counter:
    """Outcomes as one-token continuations."""
    return Counter({(k,): v for k, v in c.items()})


def test_prefix_lengths_are_tested_and_combined():
    """An error in the first token of two-token continuations is found at length 1, and the
    p-value is Bonferroni-corrected for the two lengths tested."""
    rng = np.random.default_rng(1)
    a = Counter(zip(rng.choice(3, 3000, p=[0.5, 0.3, 0.2]).tolist(), rng.integers(0, 40, 3000).tolist(), strict=True))
    b = Counter(zip(rng.choice(3, 3000, p=[0.4, 0.3, 0.3]).tolist(), rng.integers(0, 40, 3000).tolist(), strict=True))
    t = two_sample_test([a], [b], resamples=20)
    assert t.length == 1 and t.p_by_length[0] < 1e-6 and t.p_value == min(1.0, 2 * t.p_by_length[0])
    same = two_sample_test([a], [a], resamples=20)
    assert same.p_value == 1.0 and same.tv == 0.0


class _IdTokenizer:
    """Token ids only (the 8-token models have no text)."""

    vocab_size = V_SMALL
    eos_ids = frozenset()
    has_chat_template = False

    def __init__(self) -> None:
        self.same: weakref.WeakSet = weakref.WeakSet()  # (as `Tokenizer`: drafts' tokenizers found equal)
        self.differ: weakref.WeakSet = weakref.WeakSet()  # (...and found different)

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))

    class hf:  # noqa: N801 - the one attribute tokenizers_equal reads
        @staticmethod
        def get_vocab() -> dict[str, int]:
            return {str(i): i for i in range(V_SMALL)}


@pytest.fixture(scope="module")
def v8(small_vocab):
    t, d = small_vocab
    return LoadedModel("v8-target", None, t, _IdTokenizer()), LoadedModel("v8-draft", None, d, _IdTokenizer())


@pytest.mark.parametrize("method", ["draft-model", "prompt-lookup", "early-exit"])
@pytest.mark.slow
def test_certificate_passes_an_exact_method_and_catches_the_broken_control(v8, method):
    target, draft = v8
    cert = certify(
        target,
        method=method,
        assistant_model=draft if method == "draft-model" else None,
        k=2,
        temperature=1.0,
        samples=1000,
        tokens=4,
        prompts=[PROMPT_IDS * 3],
        seed=1,
    )
    assert cert.proposed > 0 and cert.acceptance is not None and 0.05 < cert.acceptance < 0.95
    assert cert.passed, cert.table()
    assert cert.control_caught, cert.table()
    assert cert.verdict == "PASS"
    d = json.loads(json.dumps(cert.to_dict()))
    assert d["verdict"] == "PASS" and d["test"]["p_value"] >= d["alpha"] > d["control"]["p_value"]
    assert "caught" in cert.table() and "pass (same law)" in cert.table()


@pytest.mark.slow
def test_draft_model_trees_are_certified_and_the_broken_control_caught(v8, monkeypatch):
    """`specdec certify --drafter draft-model --draft-tree 1`: siblings drawn without
    replacement, verified by the tree rule (trees grown two children a node, whatever the
    prices say, so the rule meets siblings at every depth)."""
    from test_draft_tree import _bushy

    _bushy(monkeypatch)
    target, draft = v8
    # (3000 a side: the broken tree rule moves the law less than the broken chain rule does)
    cert = certify(
        target,
        method="draft-model",
        assistant_model=draft,
        k=2,
        temperature=1.0,
        samples=3000,
        tokens=4,
        prompts=[PROMPT_IDS * 3],
        seed=2,
        options={"tree": 1},
    )
    assert cert.proposed > 0 and cert.options == {"tree": 1}
    assert cert.passed and cert.control_caught and cert.verdict == "PASS", cert.table()


@pytest.mark.slow
def test_certificate_fails_a_wrong_method(v8, wrong_rule):
    """The method itself broken (the engine's rule replaced): the certificate says FAIL."""
    target, draft = v8
    wrong_rule("rejection")
    cert = certify(
        target,
        method="draft-model",
        assistant_model=draft,
        k=2,
        samples=1000,
        tokens=4,
        prompts=[PROMPT_IDS * 3],
        seed=2,
        control=False,
    )
    assert cert.verdict == "FAIL" and not cert.passed


def test_certify_refuses_bad_settings(v8):
    target, _ = v8
    for kw, message in (
        ({"samples": 5}, "too few"),
        ({"alpha": 2.0}, "alpha"),
        ({"tokens": 0}, "tokens"),
        ({"temperature": 0.0}, "greedy"),
    ):
        with pytest.raises(ValueError, match=message):
            certify(target, method="prompt-lookup", prompts=[PROMPT_IDS], **kw)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_tree_drafters_are_certified_with_a_fixed_tree(v8, monkeypatch, kind):
    """Trees sized by the cost model depend on the pass times this machine stored; where those
    say no row pays (here: a row costs a whole token), every step is plain and the rule never
    runs. A certificate fixes the tree size (and says so) instead."""
    from helpers import random_heads

    import specdec.costs
    from specdec.api import generate_batch
    from specdec.certify import TREE_TOKENS
    from specdec.costs import Costs

    target, _ = v8
    monkeypatch.setattr(specdec.costs, "pass_costs", lambda model, rows: Costs({1: 10.0, 2: 20.0, 64: 640.0}))
    heads = random_heads(
        target.model, kind, seed=9, num_heads=2, noise=0.3, hydra_inner=8, vocab_ids=[0, 1, 2, 4, 5, 7]
    )
    sized = generate_batch(
        target,
        [PROMPT_IDS * 3] * 4,
        seed=[0, 1, 2, 3],
        max_new_tokens=4,
        ignore_eos=True,
        chat=False,
        temperature=1.0,
        drafter=kind,
        adaptive_k=False,
        head=heads,
    )
    assert sum(r.metrics.proposed for r in sized) == 0  # control: the cost model drafts nothing here
    cert = certify(
        target,
        method=kind,
        k=2,
        samples=100,
        tokens=4,
        prompts=[PROMPT_IDS * 3],
        seed=3,
        control=False,
        options={"head": heads},
    )
    assert cert.options["total"] == TREE_TOKENS and cert.proposed > 0 and cert.acceptance is not None
    assert f"--tree-tokens {TREE_TOKENS}" in cert.table()
    assert json.loads(json.dumps(cert.to_dict()))["options"] == {"head": type(heads).__name__, "total": TREE_TOKENS}
    mine = certify(
        target,
        method=kind,
        k=2,
        samples=100,
        tokens=4,
        prompts=[PROMPT_IDS * 3],
        seed=3,
        control=False,
        options={"head": heads, "total": 3},
    )
    assert mine.options["total"] == 3 and "--tree-tokens 3" in mine.table()
