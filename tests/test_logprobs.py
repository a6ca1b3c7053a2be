"""Logprobs: each committed token's log-probability (and its alternatives) under speculation
equals plain decoding's, whatever drafted it; the rows they come from are the ones the tokens
were picked from; bad requests are refused in one line."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import EXACT_MODES
from helpers import PROMPTS

import specdec
from specdec.engine import token_logprobs


def test_token_logprobs_reads_each_tokens_row():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    lps = token_logprobs(logits, [2, 0], top=2)
    want = torch.log_softmax(logits, -1)
    assert [lp.token for lp in lps] == [2, 0]
    assert lps[0].logprob == pytest.approx(float(want[0, 2])) and lps[1].logprob == pytest.approx(float(want[1, 0]))
    assert [t for t, _ in lps[0].top] == [2, 1] and lps[1].top[0][0] == 0
    assert token_logprobs(logits, [1], top=0)[0].top == ()  # row 0 only: one token
    assert token_logprobs(logits, [], top=3) == []


@pytest.mark.parametrize("dtype", EXACT_MODES)
@pytest.mark.slow
def test_speculative_logprobs_equal_plain_decodings(tiny, dtype):
    target, draft = tiny("qwen2", dtype=dtype), tiny("qwen2", "close", dtype=dtype)
    accepted: dict[str, int] = {}
    for prompt in PROMPTS[:4]:
        plain = specdec.generate(target, prompt, max_new_tokens=30, ignore_eos=True, logprobs=5)
        assert plain.logprobs is not None and len(plain.logprobs) == len(plain.token_ids) == 30
        assert [lp.token for lp in plain.logprobs] == plain.token_ids
        assert all(lp.logprob <= 0 and len(lp.top) == 5 and lp.top[0][1] >= lp.logprob for lp in plain.logprobs)
        runs = {
            "prompt-lookup": {"drafter": "prompt-lookup", "adaptive_k": False, "k": 4},
            "draft-model": {"assistant_model": draft, "k": 4, "adaptive_k": False},
            "auto": {"drafter": "auto", "assistant_model": draft},
            "prediction": {"prediction": plain.token_ids[:12] + [5, 6] + plain.token_ids[12:]},
        }
        for name, kw in runs.items():
            out = specdec.generate(target, prompt, max_new_tokens=30, ignore_eos=True, logprobs=5, **kw)
            assert out.token_ids == plain.token_ids, name
            accepted[name] = accepted.get(name, 0) + out.metrics.accepted
            # the same numbers, not merely close: the rows are what plain decoding computed
            assert out.logprobs == plain.logprobs, name
    assert accepted["draft-model"] > 0 and accepted["prediction"] > 0  # (drafts were verified, not plain steps only)


@pytest.mark.slow
def test_streamed_deltas_carry_their_tokens_logprobs(tiny):
    target = tiny("llama")
    stream = specdec.stream(target, PROMPTS[0], drafter="prompt-lookup", max_new_tokens=20, ignore_eos=True, logprobs=0)
    got = []
    for delta in stream:
        assert delta.logprobs is not None and [lp.token for lp in delta.logprobs] == delta.token_ids
        got += delta.logprobs
    assert got == stream.result.logprobs and all(math.isfinite(lp.logprob) for lp in got)


def test_bad_logprobs_are_refused(tiny):
    target = tiny("llama")
    for bad in (-1, 21, True, 2.5):
        with pytest.raises(ValueError, match="logprobs is the number of alternatives per token, 0..20"):
            specdec.generate(target, "x", max_new_tokens=2, logprobs=bad)
    assert specdec.generate(target, "x", max_new_tokens=2).logprobs is None
