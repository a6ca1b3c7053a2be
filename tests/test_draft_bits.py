"""A draft model's cheaper packings (`bits=4`: every linear layer in Q4_K blocks; 3 and 2: the
layers in the kernel's 3- and 2-bit codes): kept beside the model's own packing, never pruned
by it, and exact in use (only acceptance may change)."""

from __future__ import annotations

import pytest
from conftest import EXACT_MODES
from helpers import PROMPTS

import specdec
from specdec.model import kquant
from specdec.model.load import load_transformer, q4k_cache_file

pytestmark = pytest.mark.skipif("q4k" not in EXACT_MODES, reason="the q4k kernel cannot be built on this machine")


def _kinds(model) -> set[int]:
    return {
        m.kernel.kind for _, m in model.named_modules() if isinstance(getattr(m, "kernel", None), kquant.KQuantKernel)
    }


def test_four_bit_packing_sits_beside_the_models_own(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    d = tiny_dir("qwen2", "close")
    own = load_transformer(d, dtype="q4k")
    four = load_transformer(d, dtype="q4k", bits=4)
    assert _kinds(own) == {kquant.Q6K} and _kinds(four) == {kquant.Q4K}  # (a float model re-quantizes to Q6_K)
    assert four.bits == 4 and own.bits is None
    assert q4k_cache_file(d).exists() and q4k_cache_file(d, 4).exists() and q4k_cache_file(d) != q4k_cache_file(d, 4)
    load_transformer(d, dtype="q4k")  # loading one packing prunes stale files, not the other packing
    assert q4k_cache_file(d, 4).exists()
    with pytest.raises(ValueError, match="packing of the q4k mode"):
        load_transformer(d, dtype="int8", bits=4)
    with pytest.raises(ValueError, match="not a packing"):
        load_transformer(d, dtype="q4k", bits=5)
    for bits in kquant.LOW_BITS:  # the layers' codes narrower, the LM head Q4_K
        low = load_transformer(d, dtype="q4k", bits=bits)
        assert low.bits == bits and _kinds(low) == {bits, kquant.Q4K} and low.lm_head.kernel.kind == kquant.Q4K
        assert q4k_cache_file(d, bits).exists() and q4k_cache_file(d, 4).exists()


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_greedy_identity_with_a_low_bit_draft(tiny, tiny_dir, bits):
    target = tiny("qwen2", "target", "q4k")
    draft = specdec.load(tiny_dir("qwen2", "close"), bits=bits)
    proposed = 0
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=20, ignore_eos=True)
        spec = specdec.generate(
            target, prompt, assistant_model=draft, k=3, max_new_tokens=20, ignore_eos=True, adaptive_k=False
        )
        assert spec.token_ids == plain.token_ids, prompt
        proposed += spec.metrics.proposed
    assert proposed > 0
