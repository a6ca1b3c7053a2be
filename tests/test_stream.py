"""Streaming: the deltas add up to the final text, never hold a stop string or what follows
it, and stopping a stream early frees its sequence."""

from __future__ import annotations

import pytest
from conftest import EXACT_MODES
from helpers import PROMPTS

import specdec
from specdec.config import GenerationConfig
from specdec.stops import Detokenizer, StopChecker


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "lookahead"])
def test_deltas_add_up_to_the_final_text(tiny, arch, drafter):
    """Tiny random models emit arbitrary bytes, split multi-byte characters included."""
    target = tiny(arch, dtype=EXACT_MODES[-1])
    for prompt in PROMPTS:
        s = specdec.stream(target, prompt, drafter=drafter, max_new_tokens=40, ignore_eos=True, chat=False)
        deltas = list(s)
        assert s.result is not None and deltas[-1].finish_reason == s.result.finish_reason == "length"
        assert "".join(d.text for d in deltas) == s.result.text == target.tokenizer.decode(s.result.token_ids)
        assert [t for d in deltas for t in d.token_ids] == s.result.token_ids
        assert (
            s.result.token_ids
            == specdec.generate(target, prompt, max_new_tokens=40, ignore_eos=True, chat=False).token_ids
        )


@pytest.mark.parametrize("drafter", [None, "prompt-lookup"])
def test_no_delta_holds_a_stop_string_or_what_follows(tiny, drafter):
    target = tiny("llama", dtype=EXACT_MODES[-1])
    checked = 0
    for prompt in PROMPTS[:4]:
        full = specdec.generate(target, prompt, max_new_tokens=40, ignore_eos=True, chat=False).text
        for a, b in ((6, 9), (12, 14), (20, 24)):
            stop = full[a:b]
            if not stop.strip() or "\ufffd" in stop:
                continue
            s = specdec.stream(
                target,
                prompt,
                drafter=drafter,
                k=4,
                max_new_tokens=40,
                ignore_eos=True,
                chat=False,
                stop=[stop, "never-generated"],
            )
            texts = [d.text for d in s]
            assert s.result.finish_reason == "stop" and s.result.text == full[: full.index(stop)]
            assert "".join(texts) == s.result.text
            assert not any(stop in t for t in texts)
            checked += 1
    assert checked >= 4


def test_a_possible_stop_prefix_is_held_back_until_decided():
    class Chars:  # a tokenizer whose tokens are characters
        eos_ids = frozenset()

        def decode(self, ids, **kw):
            return "".join(map(chr, ids))

    tok = Chars()
    s = StopChecker(GenerationConfig(max_new_tokens=20, stop=("abc",)), 20, tok, frozenset())  # type: ignore[arg-type]
    out = []
    for ch in "xyab":
        s.push(ord(ch))
        out.append(s.take_text())
    assert out == ["x", "y", "", ""]  # "ab" may begin "abc": held
    s.push(ord("d"))
    assert s.take_text() == "abd"  # it did not: released
    s.push(ord("a"))
    s.push(ord("b"))
    assert s.take_text() == "" and s.push(ord("c")) and s.finish_reason == "stop"
    assert s.take_text() == "" and s.text() == "xyabd"


def test_detokenizer_waits_for_complete_characters(tiny):
    tok = tiny("llama").tokenizer
    d = Detokenizer(tok)
    ids = tok.encode("é ü")  # two bytes each in the byte tokenizer
    pieces = [d.push(t) for t in ids]
    assert pieces[0] == "" and "".join(pieces) == "é ü"


def test_stopping_a_stream_early_cancels_its_sequence(tiny):
    target = tiny("qwen2")
    s = specdec.stream(target, PROMPTS[0], max_new_tokens=30, ignore_eos=True, chat=False)
    it = iter(s)
    got = [next(it) for _ in range(3)]
    it.close()  # the caller stops reading
    assert s.result is not None and s.result.finish_reason == "cancelled"
    assert s.result.token_ids == [t for d in got for t in d.token_ids]


@pytest.mark.real
def test_stream_real_text_smollm2(smollm2_exact):
    s = specdec.stream(smollm2_exact, "Write two sentences about the moon.", drafter="prompt-lookup", max_new_tokens=48)
    texts = [d.text for d in s]
    assert len([t for t in texts if t]) > 5 and "".join(texts) == s.result.text
    assert s.result.text == smollm2_exact.tokenizer.decode(s.result.token_ids)
