"""The prompt-lookup drafter: lookup rules, incremental index, greedy identity with plain
decoding (tiny models, SmolLM2), exact sampling (with a negative control), edge cases."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import fb

import specdec
from specdec.config import SamplingParams
from specdec.drafters import DraftSession, PromptLookupDrafter


def started(tokens: list[int], **kw) -> PromptLookupDrafter:
    d = PromptLookupDrafter(**kw)
    d.begin(DraftSession(list(tokens), 1000, SamplingParams(), torch.Generator().manual_seed(0)))
    return d


def test_longest_match_wins_then_the_most_recent():
    # suffix (7, 8): the 2-gram occurred once (followed by 1 2); the 1-gram 8 more recently (by 5)
    d = started([7, 8, 1, 2, 3, 8, 5, 6, 7, 8], max_ngram=2)
    assert d.propose(3).tokens.tolist() == [1, 2, 3]
    # with only 1-grams, the most recent earlier 8 is followed by 5 6
    d = started([7, 8, 1, 2, 3, 8, 5, 6, 7, 8], max_ngram=1)
    assert d.propose(2).tokens.tolist() == [5, 6]
    assert d.propose(4).tokens.tolist() == [5, 6]  # a single-token match proposes at most 2


def test_candidates_are_distinct_and_ranked():
    d = started([1, 2, 9, 1, 2, 9, 4, 2, 5, 1, 2], max_ngram=2)
    # (1, 2) is followed by 9 (twice, the same continuation) ; then 2 alone by 5 and 9
    assert d.candidates(1, limit=4) == [(2, [9]), (1, [5])]
    assert d.candidates(2, limit=1) == [(2, [9, 4])]


def test_single_token_matches_propose_fewer_tokens():
    d = started([5, 1, 2, 3, 4, 6, 7, 5], max_ngram=3)  # only "5" matches
    assert d.propose(4).tokens.tolist() == [1, 2]
    d = started([5, 1, 2, 3, 4, 6, 7, 5], max_ngram=3, single_token_match_limit=4)
    assert d.propose(4).tokens.tolist() == [1, 2, 3, 4]
    d = started([8, 5, 1, 2, 3, 4, 6, 8, 5], max_ngram=3)  # "8 5" matches: no limit
    assert d.propose(4).tokens.tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="single_token_match_limit"):
        PromptLookupDrafter(single_token_match_limit=0)


def test_no_match_proposes_nothing_and_short_contexts_are_fine():
    assert started([1, 2, 3, 4]).propose(4).tokens.shape == (0,)
    d = started([5], max_ngram=8)  # n-gram longer than the context
    assert d.propose(3).tokens.shape == (0,)
    d = started([5, 6, 5], max_ngram=8, single_token_match_limit=4)  # the match runs into the end
    assert d.propose(4).tokens.tolist() == [6, 5]


def test_incremental_index_equals_a_fresh_one():
    d = started([3, 1, 4, 1, 5, 9, 2, 6], max_ngram=3)
    committed = [3, 1, 4, 1, 5, 9, 2, 6]
    for step in range(12):
        prop = d.propose(3).tokens.tolist()
        n_acc = step % (len(prop) + 1)
        nxt = (step * 7) % 10
        d.accepted(fb(n_acc, nxt))
        committed += prop[:n_acc] + [nxt]
        fresh = started(committed, max_ngram=3)
        assert d._tokens == committed and dict(d._index) == dict(fresh._index)


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        PromptLookupDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="1 <= min_ngram"):
        PromptLookupDrafter(max_ngram=2, min_ngram=0)


@pytest.mark.real
def test_greedy_identity_smollm2(smollm2_exact):
    prompts = [
        "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
        "List the numbers 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and then again 1, 2, 3,",
        "What is the capital of France?",  # little to copy
    ]
    accepted = 0
    for prompt in prompts:
        plain = specdec.generate(smollm2_exact, prompt, max_new_tokens=48)
        for k, n in ((3, 3), (6, 2)):
            out = specdec.generate(
                smollm2_exact,
                prompt,
                drafter=PromptLookupDrafter(max_ngram=n),
                k=k,
                max_new_tokens=48,
                adaptive_k=False,
            )
            assert out.token_ids == plain.token_ids, (prompt, k)
            accepted += out.metrics.accepted
    assert accepted > 0


class Recording(PromptLookupDrafter):
    def begin(self, session):
        self.proposals: list[list[int]] = []
        super().begin(session)

    def propose(self, k):
        d = super().propose(k)
        self.proposals.append(d.tokens.tolist())
        return d


def test_proposal_copies_eos_like_any_token():
    d = started([4, 5, 0, 9, 4, 5], max_ngram=2)
    assert d.propose(3).tokens.tolist() == [0, 9, 4]


@pytest.mark.real
def test_match_running_into_eos(smollm2_exact):
    """A copied span that contains the end-of-sequence token: output and finish reason equal
    plain decoding's and nothing after the EOS is emitted. (" yellow" is declared the EOS, so
    the span the lookup copies from the prompt contains it.)"""
    eos = smollm2_exact.tokenizer.encode(" yellow")[0]
    tok = copy.copy(smollm2_exact.tokenizer)
    tok.eos_ids = frozenset({eos})
    model = dataclasses.replace(smollm2_exact, tokenizer=tok)
    prompt = "red, green, blue, yellow. red, green, blue, yellow. red, green,"
    plain = specdec.generate(model, prompt, max_new_tokens=30, chat=False)
    drafter = Recording(max_ngram=3)
    out = specdec.generate(model, prompt, drafter=drafter, k=5, max_new_tokens=30, chat=False, adaptive_k=False)
    assert out.token_ids == plain.token_ids and out.finish_reason == plain.finish_reason == "eos"
    assert out.token_ids[-1] == eos and any(eos in p[:-1] for p in drafter.proposals)  # EOS mid-draft
