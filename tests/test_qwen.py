"""The default pair: Qwen2.5-Coder 1.5B target with the 0.5B draft (slow; run in CI)."""

from __future__ import annotations

import pytest

import specdec
from specdec.tokenizer import check_same_tokenizer

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
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    assert target.tokenizer.vocab_size == draft.tokenizer.vocab_size


@pytest.mark.parametrize("prompt", PROMPTS)
def test_qwen_pair_greedy_identity(pair, prompt):
    target, draft = pair
    cmp = specdec.compare(target, prompt, assistant_model=draft, k=4, max_new_tokens=32, adaptive_k=False)
    assert cmp.identical, (cmp.speculative.text, cmp.plain.text)
    assert cmp.speculative.metrics.acceptance_rate > 0
