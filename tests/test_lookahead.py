"""Lookahead decoding: the window's layout and mask, the n-gram pool, the verification tree,
greedy identity with plain decoding (tiny models, SmolLM2), exact sampling (with a negative
control), edge cases."""

from __future__ import annotations

import pytest
import torch
from helpers import LOOKAHEAD_CONFIGS, fb

import specdec
from specdec.config import SamplingParams
from specdec.drafters import DraftSession, LookaheadDrafter


def started(tokens: list[int], **kw) -> LookaheadDrafter:
    d = LookaheadDrafter(**kw)
    d.begin(DraftSession(list(tokens), 1000, SamplingParams(), torch.Generator().manual_seed(0)))
    return d


def test_window_rows_and_mask():
    d = started([5, 6, 7, 8], window=3, ngram=3, guesses=1, pool_from_context=False)
    d._levels = [[10, 11, 12], [20, 21, 22]]
    draft = d.propose(2)
    extra = draft.extra
    assert extra.tokens.tolist() == [10, 11, 12, 20, 21, 22]
    assert extra.offsets.tolist() == [1, 2, 3, 2, 3, 4]  # column i, level l sits at 1 + i + l
    # level 1, column 2 sees level 0 columns 0..2 and itself: the guessed sequence 10 11 12 22
    assert extra.mask[5].tolist() == [True, True, True, False, False, True]
    assert extra.mask[3].tolist() == [True, False, False, True, False, False]
    assert extra.mask[1].tolist() == [True, True, False, False, False, False]


def test_window_warms_up_then_pools_ngrams():
    d = started([5, 6, 7, 8], window=2, ngram=3, guesses=2, pool_from_context=False)
    assert len(d._levels) == 1 and d._pool == {}
    V = 50

    def logits_for(values: list[int]) -> torch.Tensor:
        lg = torch.zeros(len(values), V)
        lg[torch.arange(len(values)), torch.tensor(values)] = 1.0
        return lg

    lvl0 = d._levels[0]
    d.propose(2)
    d.accepted(fb([], 9, extra_logits=logits_for([30, 31])))  # warm-up: the guesses become level 1
    assert d._levels == [lvl0, [30, 31]] and d._pool == {}
    d.propose(2)
    d.accepted(fb([], 9, extra_logits=logits_for([0, 0, 40, 41])))  # full: columns give n-grams, oldest level dropped
    assert d._levels == [[30, 31], [40, 41]]
    assert d._pool[lvl0[0]][0] == (30, 40) and d._pool[lvl0[1]][0] == (31, 41)


def test_verification_tree_from_the_pool():
    d = started([1, 2, 3, 9, 1, 2, 4, 9, 1, 5, 6, 9], window=0, ngram=3, guesses=3)
    # context 3-grams starting with 9 (most recent first): (9 1 5), (9 1 2)
    assert d.propose(1).tokens.tolist() == [1]  # cut to k, merged
    draft = d.propose(2)
    assert draft.tokens.tolist() == [1, 5, 2] and draft.parents == [-1, 0, 0]  # shared prefix "1"
    assert draft.extra is None and draft.depth() == 2
    d.accepted(fb([0, 1], 7))  # committed 1 5 7
    assert d._tokens[-3:] == [1, 5, 7] and d._pool[1][0] == (5, 7)


def test_options_are_checked():
    for kw in (dict(window=-1), dict(ngram=1), dict(guesses=0)):
        with pytest.raises(ValueError, match="lookahead needs"):
            LookaheadDrafter(**kw)


def test_window_near_the_context_end(tmp_path):
    """The window is dropped when its rows would run past the model's context; output still
    equals plain decoding up to the last position."""
    from specdec.testing import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama", seed=4, max_pos=40)
    target = specdec.load(path, device="cpu")
    prompt = "abcabcabcabcabc"
    kw = dict(max_new_tokens=100, ignore_eos=True, context_overflow="truncate")
    plain = specdec.generate(target, prompt, **kw)
    out = specdec.generate(
        target, prompt, drafter=LookaheadDrafter(window=5, ngram=4, guesses=3), k=3, adaptive_k=False, **kw
    )
    assert out.token_ids == plain.token_ids and len(out.token_ids) == 40 - len(target.tokenizer.encode(prompt))


@pytest.mark.real
def test_greedy_identity_smollm2(smollm2_exact):
    prompts = [
        "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
        "Count from 1 to 30, separated by commas.",
        "What is the capital of France?",
    ]
    accepted = 0
    for prompt in prompts:
        plain = specdec.generate(smollm2_exact, prompt, max_new_tokens=48)
        for cfg, k in zip(LOOKAHEAD_CONFIGS, (2, 3, 1), strict=True):
            out = specdec.generate(
                smollm2_exact, prompt, drafter=LookaheadDrafter(**cfg), k=k, max_new_tokens=48, adaptive_k=False
            )
            assert out.token_ids == plain.token_ids, (prompt, cfg)
            accepted += out.metrics.accepted
    assert accepted > 0
