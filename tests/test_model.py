"""The native decoder against transformers (the reference oracle), and the KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import specdec
from specdec.model import KVCache, load_transformer

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma3"]  # every family (see model/families.py)


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    from specdec.model.convert import float_weights

    ref = AutoModelForCausalLM.from_pretrained(float_weights(path), dtype=torch.float32)
    with torch.no_grad():
        return ref(ids).logits


def prompt(n: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_logits_match_transformers(tiny_dir, arch):
    path = tiny_dir(arch)
    ids = prompt(24)  # longer than the tiny Gemma's sliding window (8)
    ours = load_transformer(path, device="cpu")
    got = ours(ids, ours.new_cache(32)).logits
    torch.testing.assert_close(got, hf_logits(path, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decoding_matches_one_pass(tiny_dir, arch):
    model = load_transformer(tiny_dir(arch), device="cpu")
    ids = prompt(20, seed=1)
    full = model(ids, model.new_cache(32)).logits
    cache = model.new_cache(32)
    parts = [model(ids[:, :7], cache).logits]
    parts += [model(ids[:, i : i + 1], cache).logits for i in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_then_continue_equals_never_having_drafted(tiny_dir, arch):
    model = load_transformer(tiny_dir(arch), device="cpu")
    ids = prompt(16, seed=2)
    clean = model.new_cache(32)
    model(ids[:, :10], clean)
    want = model(ids[:, 10:12], clean).logits

    cache = model.new_cache(32)
    model(ids[:, :10], cache)
    model(prompt(5, seed=9), cache)  # rejected drafts
    assert cache.length == 15
    cache.truncate(10)
    got = model(ids[:, 10:12], cache).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chain_tree_mask_equals_causal(tiny_dir, arch):
    model = load_transformer(tiny_dir(arch), device="cpu")
    ids = prompt(12, seed=3)
    a, b = model.new_cache(16), model.new_cache(16)
    model(ids[:, :6], a), model(ids[:, :6], b)
    causal = model(ids[:, 6:], a).logits
    tree = model(ids[:, 6:], b, tree_mask=torch.ones(6, 6, dtype=torch.bool).tril()).logits
    torch.testing.assert_close(tree, causal, rtol=0, atol=0)


def test_tree_branches_do_not_see_each_other(tiny_dir):
    """Two siblings at the same position, each attending only to the prefix, score exactly like
    two separate one-token continuations."""
    model = load_transformer(tiny_dir("llama"), device="cpu")
    ids = prompt(8, seed=4)
    cache = model.new_cache(16)
    model(ids, cache)
    siblings = torch.tensor([[5, 9]])
    positions = torch.tensor([[8, 8]])
    out = model(siblings, cache, positions, tree_mask=torch.eye(2, dtype=torch.bool)).logits
    for j, tok in enumerate((5, 9)):
        c = model.new_cache(16)
        model(ids, c)
        one = model(torch.tensor([[tok]]), c).logits
        torch.testing.assert_close(out[:, j], one[:, 0], rtol=1e-5, atol=1e-5)


def test_keep_compacts_selected_slots(tiny_dir):
    model = load_transformer(tiny_dir("llama"), device="cpu")
    ids = prompt(10, seed=5)
    cache = model.new_cache(16)
    model(ids, cache)
    k_before = cache.k[:, :, :, [6, 8]].clone()
    cache.keep(5, torch.tensor([6, 8]))
    assert cache.length == 7
    torch.testing.assert_close(cache.k[:, :, :, 5:7], k_before, rtol=0, atol=0)
    assert cache.pos[0, :7].tolist() == [0, 1, 2, 3, 4, 6, 8]


def test_cache_refuses_overrun_and_bad_truncate():
    cache = KVCache(1, 1, 1, 4, 2, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="capacity"):
        cache.reserve(5)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(1)


def test_hidden_states_and_layers_on_request(tiny_dir):
    model = load_transformer(tiny_dir("qwen2"), device="cpu")
    out = model(prompt(5), model.new_cache(8), return_hidden=True, output_layers=(0,))
    assert out.hidden.shape == (1, 5, model.args.dim)
    assert set(out.layers) == {0} and out.layers[0].shape == (1, 5, model.args.dim)
    torch.testing.assert_close(model.lm_head(out.hidden), out.logits)


@pytest.mark.real
def test_smollm2_logits_match_transformers(smollm2):
    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    got = smollm2.model(ids, smollm2.model.new_cache(32)).logits
    torch.testing.assert_close(got, hf_logits(smollm2.path, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b"])
def test_real_logits_match_transformers(name):
    lm = specdec.load(name, dtype="fp32", device="cpu")
    ids = torch.tensor([lm.tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number.')])
    got = lm.model(ids, lm.model.new_cache(64)).logits
    torch.testing.assert_close(got, hf_logits(lm.path, ids), rtol=1e-4, atol=1e-4)
