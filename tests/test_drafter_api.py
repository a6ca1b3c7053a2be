"""Choosing a drafter by name through the API."""

from __future__ import annotations

import pytest

import specdec


def test_drafter_by_name_matches_the_object(tiny):
    target = tiny("qwen2")
    prompt = "abcabcabcabc"
    by_name = specdec.generate(target, prompt, drafter="prompt-lookup", k=3, max_new_tokens=16, ignore_eos=True)
    by_obj = specdec.generate(target, prompt, drafter=specdec.PromptLookupDrafter(), k=3, max_new_tokens=16, ignore_eos=True)
    plain = specdec.generate(target, prompt, max_new_tokens=16, ignore_eos=True)
    assert by_name.token_ids == by_obj.token_ids == plain.token_ids
    assert by_name.metrics.proposed == by_obj.metrics.proposed > 0


@pytest.mark.parametrize("name", ["early-exit", "lookahead"])
def test_other_model_free_drafters_by_name(tiny, name):
    target = tiny("llama")
    prompt = "abcabcabcabc"
    out = specdec.generate(target, prompt, drafter=name, k=3, max_new_tokens=16, ignore_eos=True)
    assert out.token_ids == specdec.generate(target, prompt, max_new_tokens=16, ignore_eos=True).token_ids
    assert out.metrics.steps > 0


def test_unknown_or_model_drafter_names_are_refused(tiny):
    with pytest.raises(ValueError, match="unknown drafter 'n-gram'; choose one of early-exit, lookahead, prompt-lookup"):
        specdec.generate(tiny("qwen2"), "ab", drafter="n-gram", max_new_tokens=2)
    with pytest.raises(ValueError, match="assistant_model="):
        specdec.generate(tiny("qwen2"), "ab", drafter="draft-model", max_new_tokens=2)
