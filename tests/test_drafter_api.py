"""Choosing a drafter by name through the API."""

from __future__ import annotations

import pytest
from conftest import EXACT_MODES

import specdec


def test_drafter_by_name_matches_the_object(tiny):
    target = tiny("qwen2", dtype=EXACT_MODES[-1])
    prompt = "abcabcabcabc"
    by_name = specdec.generate(
        target, prompt, drafter="prompt-lookup", k=3, max_new_tokens=16, ignore_eos=True, adaptive_k=False
    )
    by_obj = specdec.generate(
        target, prompt, drafter=specdec.PromptLookupDrafter(), k=3, max_new_tokens=16, ignore_eos=True, adaptive_k=False
    )
    plain = specdec.generate(target, prompt, max_new_tokens=16, ignore_eos=True)
    assert by_name.token_ids == by_obj.token_ids == plain.token_ids
    assert by_name.metrics.proposed == by_obj.metrics.proposed > 0


@pytest.mark.parametrize("name", ["early-exit", "lookahead", "suffix"])
def test_other_model_free_drafters_by_name(tiny, name):
    target = tiny("llama", dtype=EXACT_MODES[-1])
    prompt = "abcabcabcabc"
    out = specdec.generate(target, prompt, drafter=name, k=3, max_new_tokens=16, ignore_eos=True, adaptive_k=False)
    assert out.token_ids == specdec.generate(target, prompt, max_new_tokens=16, ignore_eos=True).token_ids
    assert out.metrics.steps > 0


def test_unknown_or_model_drafter_names_are_refused(tiny):
    with pytest.raises(
        ValueError,
        match="unknown drafter 'n-gram'; choose one of auto, draft-model, eagle3, early-exit, hydra, lookahead, "
        "medusa, prediction, prompt-lookup, suffix",
    ):
        specdec.generate(tiny("qwen2"), "ab", drafter="n-gram", max_new_tokens=2, adaptive_k=False)
    with pytest.raises(ValueError, match="needs a draft model"):
        specdec.generate(tiny("qwen2"), "ab", drafter="draft-model", max_new_tokens=2, adaptive_k=False)
    with pytest.raises(
        ValueError, match="the prompt-lookup drafter has no option 'window'; its options: max_ngram, min_ngram"
    ):
        specdec.generate(tiny("qwen2"), "ab", drafter="prompt-lookup", window=2, max_new_tokens=2, adaptive_k=False)
    with pytest.raises(ValueError, match="unknown option 'max_tokens': generation options are"):
        specdec.generate(tiny("qwen2"), "ab", max_tokens=2)
    with pytest.raises(ValueError, match="a drafter object serves one sequence"):
        specdec.generate_batch(
            tiny("qwen2"), ["ab", "cd"], drafter=specdec.PromptLookupDrafter(), max_new_tokens=2, adaptive_k=False
        )


def test_registry_declares_each_drafter_once():
    """Names, options and defaults come from one place; the CLI flags are built from it."""
    from specdec.cli import build_parser

    assert list(specdec.DRAFTERS) == [
        "auto",
        "draft-model",
        "eagle3",
        "early-exit",
        "lookahead",
        "medusa",
        "hydra",
        "prediction",
        "prompt-lookup",
        "suffix",
    ]
    assert specdec.DRAFTERS["auto"].needs == "any"
    la = specdec.DRAFTERS["lookahead"]
    assert la.defaults() == {"window": 1, "ngram": 3, "guesses": 2} and la.needs == ""
    assert specdec.DRAFTERS["early-exit"].needs == "target" and specdec.DRAFTERS["draft-model"].needs == "draft"
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for flag in (
        "--ngram-max",
        "--ngram-min",
        "--exit-layer",
        "--window",
        "--ngram",
        "--guesses",
        "--head",
        "--tree-topk",
        "--tree-tokens",
        "--tree-children",
        "--tree-frontier",
        "--suffix-factor",
        "--suffix-min-prob",
        "--suffix-max-nodes",
        "--suffix-max-tokens",
    ):
        assert flag in help_text
    built = specdec.make_drafter("lookahead", window=3)
    assert isinstance(built, specdec.LookaheadDrafter) and built.W == 3 and built.N == 3
