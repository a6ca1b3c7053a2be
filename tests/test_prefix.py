"""Reusing finished sequences' rows (specdec.model.prefix): a prompt that begins like an earlier
sequence copies that sequence's cached rows and prefills only the rest. Outputs are bitwise what
a fresh prefill gives (greedy and seeded sampling, plain and speculative), each pool sees only
its own rows, and the store keeps to its bound."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT_MODES

from specdec.config import GenerationConfig, SamplingParams
from specdec.drafters import DraftModelDrafter, SuffixDrafter
from specdec.engine import PREFIXES, Engine
from specdec.model.cache import KVCache
from specdec.model.prefix import MIN_TOKENS, PrefixStore


def _rows(n: int, mark: float = 0.0) -> KVCache:
    """A cache of n rows whose values say which slot they came from."""
    c = KVCache(1, 1, 1, n, 2, dtype=torch.float32, device="cpu")
    c.k[0, 0, 0, :, 0] = torch.arange(n, dtype=torch.float32) + mark
    c.length = n
    return c


def test_the_store_finds_the_longest_prefix_of_the_callers_pool():
    store = PrefixStore(1000)
    a = list(range(100, 140))  # 40 tokens
    store.put("p", a, _rows(40))
    assert store.longest("p", a[:30] + [7, 8]) is not None and store.longest("p", a[:30] + [7, 8])[1] == 30
    assert store.longest("q", a) is None  # another pool's rows are never offered
    assert store.longest("p", a[: MIN_TOKENS - 1] + [7] * 20) is None  # too short to be worth it
    cache, n = store.longest("p", a + [1, 2])
    assert n == 40 and cache.capacity == 40 and torch.equal(cache.k[0, 0, 0, :, 0], torch.arange(40.0))
    store.put("p", a + [5] * 10, _rows(50, mark=0.5))  # extends the entry: replaces it
    assert len(store) == 1 and store.tokens == 50
    store.put("p", a[:20], _rows(20))  # held already, as part of the longer one
    assert len(store) == 1
    store.put("p", a, _rows(30))  # more tokens than the cache holds rows: refused
    assert len(store) == 1


def test_the_store_keeps_to_its_bound_least_recently_used_out():
    store = PrefixStore(100)
    seqs = [[i] * 40 for i in range(3)]
    store.put("p", seqs[0], _rows(40))
    store.put("p", seqs[1], _rows(40))
    assert store.longest("p", seqs[0]) is not None  # (seqs[0] is now the most recently used)
    store.put("p", seqs[2], _rows(40))  # 120 > 100: seqs[1] goes
    assert store.tokens == 80 and store.longest("p", seqs[1]) is None
    assert store.longest("p", seqs[0]) is not None and store.longest("p", seqs[2]) is not None
    store.put("p", [9] * 101, _rows(101))  # larger than the whole store: not kept
    assert store.tokens == 80
    with pytest.raises(ValueError, match=">= 0 tokens"):
        PrefixStore(-1)


def _turns(engine: Engine, prompt: list[int], cfg: GenerationConfig, make_sampling, make_drafter) -> list:
    """A two-turn conversation: the second prompt is the first, its output and new text."""
    results = []
    for turn in range(2):
        sid = engine.add(prompt, cfg, make_sampling(), make_drafter())
        while engine.has_work():
            engine.step()
        results.append(engine.result(sid))
        prompt = prompt + results[-1].token_ids + [11 + turn, 12, 13, 14]
    return results


@pytest.mark.parametrize("dtype", EXACT_MODES)
@pytest.mark.parametrize("method", ["none", "suffix", "draft-model"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_next_turn_reuses_the_rows_and_gives_the_same_output(tiny, dtype, method, temperature):
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    assert target.model.rows_bitwise
    cfg = GenerationConfig(max_new_tokens=14, ignore_eos=True, k=3, adaptive_k=False)
    prompt = list(range(3, 40)) * 2  # 74 tokens
    drafters = {"none": lambda: None, "suffix": SuffixDrafter, "draft-model": lambda: DraftModelDrafter(draft.model)}

    def run(prefix_tokens: int) -> list:
        return _turns(
            Engine(target.model, target.tokenizer, prefix_tokens=prefix_tokens),
            prompt,
            cfg,
            lambda: SamplingParams(temperature=temperature, seed=7),
            drafters[method],
        )

    fresh, reused = run(0), run(4096)
    assert [r.token_ids for r in reused] == [r.token_ids for r in fresh]
    # the second prompt's rows up to the first turn's newest token came from the store
    assert [r.metrics.cached_tokens for r in reused] == [0, len(prompt) + 14 - 1]
    assert [r.metrics.cached_tokens for r in fresh] == [0, 0]


def test_wrong_rows_change_the_output(tiny):
    """Negative control: the store offering rows computed from other tokens changes the next
    turn's output (so the identity above is not vacuous: the rows are really used)."""
    target = tiny("llama", dtype=EXACT_MODES[0])
    cfg = GenerationConfig(max_new_tokens=14, ignore_eos=True)
    prompt = list(range(3, 40)) * 2

    def second_turn(engine: Engine) -> list[int]:
        return _turns(engine, prompt, cfg, SamplingParams, lambda: None)[1].token_ids

    good = second_turn(Engine(target.model, target.tokenizer, prefix_tokens=4096))
    PREFIXES.pop(target.model, None)  # (a store of its own: the model's holds the good rows)
    engine = Engine(target.model, target.tokenizer, prefix_tokens=4096)
    real_put = engine.prefixes.put

    def put_other(pool, tokens, cache):  # rows of other tokens, under these tokens
        other = target.model.new_cache(len(tokens))
        noise = torch.randint(
            3, target.model.args.vocab_size, (1, len(tokens)), generator=torch.Generator().manual_seed(0)
        )
        target.model(noise, other)
        real_put(pool, tokens, other)

    engine.prefixes.put = put_other
    assert second_turn(engine) != good


def test_pools_do_not_share_rows(tiny):
    target = tiny("llama", dtype=EXACT_MODES[0])
    engine = Engine(target.model, target.tokenizer, prefix_tokens=4096)
    cfg = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    prompt = list(range(3, 60))
    cached = []
    for pool in ("a", "b", "a"):
        sid = engine.add(prompt, cfg, SamplingParams(), None, pool=pool)
        while engine.has_work():
            engine.step()
        cached.append(engine.result(sid).metrics.cached_tokens)
    assert cached == [0, 0, len(prompt) - 1]


def test_no_reuse_where_rows_depend_on_the_pass(tiny):
    """In a mode whose prefill rows are not bitwise one-token rows (fp32), nothing is reused."""
    target = tiny("llama", dtype="fp32")
    assert not target.model.rows_bitwise
    assert Engine(target.model, target.tokenizer, prefix_tokens=4096).prefixes is None
