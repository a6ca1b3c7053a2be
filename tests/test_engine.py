"""End to end: greedy identity with plain decoding, exact sampling, stops, drafter rollback."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch
from helpers import ALPHA, chi2_pvalue

import specdec
from specdec import engine
from specdec.config import GenerationConfig, SamplingParams
from specdec.drafters import DraftModelDrafter, DraftSession
from specdec.model import ContextOverflowError, load_transformer
from specdec.testing import make_tiny_model
from specdec.verify import Verdict

PROMPTS = [
    "The cat sat on the mat. The cat sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "aaaaaaaaaaaaaaaaaaaaaaaa",
    "Q: 17 * 23 = ?\nA:",
    "x",
    "Speculative decoding proposes several tokens and verifies them in one pass.",
]


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("draft_kind", ["close", "independent"])
def test_greedy_identity_tiny(tiny, arch, draft_kind, dtype):
    target, draft = tiny(arch, dtype=dtype), tiny(arch, draft_kind, dtype=dtype)
    accepted = rejected = 0
    for prompt, k in itertools.product(PROMPTS, (1, 2, 3, 5, 8)):
        kw = dict(max_new_tokens=24, ignore_eos=True, chat=False)
        plain = specdec.generate(target, prompt, **kw)
        spec = specdec.generate(target, prompt, assistant_model=draft, k=k, **kw)
        assert spec.token_ids == plain.token_ids, (prompt, k)
        assert spec.text == plain.text
        accepted += spec.metrics.accepted
        rejected += spec.metrics.proposed - spec.metrics.accepted
    assert rejected > 0  # the test exercised rejections...
    if draft_kind == "close":
        assert accepted > 0  # ...and acceptances


class CheckingDrafter:
    """Wraps a drafter; before every proposal, a fresh drafter begun on the committed tokens
    must propose the same greedy tokens, i.e. rollback left no stale state behind."""

    def __init__(self, model):
        self.inner = DraftModelDrafter(model)
        self.model = model
        self.forwards = 0
        self.checks = 0

    def begin(self, session: DraftSession) -> None:
        self.session = session
        self.committed = session.context[0].tolist()
        self.inner.begin(session)

    def propose(self, k: int):
        draft = self.inner.propose(k)
        fresh = DraftModelDrafter(self.model)
        fresh.begin(DraftSession(torch.tensor([self.committed]), self.session.capacity,
                                 self.session.sampling, self.session.generator))  # fmt: skip
        assert fresh.propose(k).tokens.tolist() == draft.tokens.tolist()
        self.checks += 1
        self.last = draft.tokens[0].tolist()
        return draft

    def accepted(self, num_accepted: int, next_token: int) -> None:
        self.committed += self.last[:num_accepted] + [next_token]
        self.inner.accepted(num_accepted, next_token)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_draft_cache_rollback(tiny, k):
    target, draft = tiny("llama"), tiny("llama", "close")
    checker = CheckingDrafter(draft.model)
    out = specdec.generate(target, PROMPTS[1], drafter=checker, k=k, max_new_tokens=30, ignore_eos=True, chat=False)
    assert checker.checks == out.metrics.steps > 1
    assert 0 < out.metrics.accepted < out.metrics.proposed  # partial acceptance happened


def test_same_model_as_draft_accepts_everything(tiny):
    target = tiny("qwen2")
    out = specdec.generate(target, PROMPTS[0], assistant_model=target, k=4, max_new_tokens=21, ignore_eos=True)
    m = out.metrics
    assert m.acceptance_rate == 1.0 and m.mean_accepted_tokens == 5.0
    assert m.accepted_per_position == m.proposed_per_position == [4, 4, 4, 4]
    assert m.target_forwards == m.steps == 4 and m.new_tokens == 21


# -- exact sampling, end to end ----------------------------------------------------------
V_SMALL = 8
PROMPT_IDS = [1, 2, 3]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("v8")
    t = make_tiny_model(root / "t", "llama", seed=11, vocab_size=V_SMALL, tokenizer=False)
    d = make_tiny_model(root / "d", "llama", seed=12, vocab_size=V_SMALL, tokenizer=False, base=t, noise=0.3)
    return load_transformer(t, device="cpu"), load_transformer(d, device="cpu")


def exact_joint(model, sampling: SamplingParams, n: int, prompt: list[int] = PROMPT_IDS) -> dict[tuple, float]:
    """P(t1..tn | prompt) under the target alone, by enumeration."""
    from specdec.sampling import probs

    out: dict[tuple, float] = {}

    def walk(prefix: list[int], mass: float) -> None:
        if len(prefix) == n:
            out[tuple(prefix)] = mass
            return
        logits = model(torch.tensor([prompt + prefix]), model.new_cache(len(prompt) + n), last_only=True).logits[0, -1]
        p = probs(logits, sampling)
        for t in range(V_SMALL):
            if p[t] > 0:
                walk(prefix + [t], mass * float(p[t]))

    walk([], 1.0)
    return out


def sample_joint(target, drafter, sampling: SamplingParams, *, runs: int, n_tokens: int = 4, k: int = 2,
                 prompt: list[int] = PROMPT_IDS, expect_mixed: bool = True, bounds=(0.1, 0.9)) -> Counter:  # fmt: skip
    """Outputs of `runs` seeded speculative generations with `drafter`. With `expect_mixed`,
    drafts were offered and both branches of the rule (accept; reject + recover) exercised."""
    cfg = GenerationConfig(max_new_tokens=n_tokens, k=k, ignore_eos=True)
    counts: Counter = Counter()
    accepted = proposed = 0
    for seed in range(runs):
        out = engine.speculative_generate(target, drafter, prompt, cfg, dataclasses.replace(sampling, seed=seed))
        counts[tuple(out.token_ids)] += 1
        accepted, proposed = accepted + out.metrics.accepted, proposed + out.metrics.proposed
    if expect_mixed:
        assert proposed > runs // 2 and bounds[0] < accepted / proposed < bounds[1]
    return counts


SAMPLINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-topk-topp"])
def test_speculative_sampling_matches_target_distribution(small_vocab, sampling):
    target, draft = small_vocab
    counts = sample_joint(target, DraftModelDrafter(draft), sampling, runs=3000)
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) > ALPHA


def test_wrong_acceptance_rule_fails_end_to_end(small_vocab, monkeypatch):
    def always_accept(p, q, draft_tokens, generator) -> Verdict:
        B, K = draft_tokens.shape
        bonus = torch.multinomial(p[:, K], 1, generator=generator).squeeze(-1)
        return Verdict(torch.full((B,), K), bonus)

    monkeypatch.setattr(engine, "rejection_sample", always_accept)
    target, draft = small_vocab
    sampling = SAMPLINGS[0]
    counts = sample_joint(target, DraftModelDrafter(draft), sampling, runs=3000, expect_mixed=False)
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) <= ALPHA


# -- stops and context --------------------------------------------------------------------
def test_max_new_tokens_with_k_larger_than_budget(tiny):
    target, draft = tiny("llama"), tiny("llama", "close")
    for n in (1, 2, 3):
        out = specdec.generate(target, "hello", assistant_model=draft, k=8, max_new_tokens=n, ignore_eos=True)
        plain = specdec.generate(target, "hello", max_new_tokens=n, ignore_eos=True)
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert out.token_ids == plain.token_ids


def test_stop_checker_eos_and_strings(tiny):
    tok = tiny("llama").tokenizer
    cfg = GenerationConfig(max_new_tokens=50, stop=("lo w",))
    s = engine.StopChecker(cfg, 50, tok, tok.eos_ids)
    ids = tok.encode("hello world")
    done_at = next(i for i, t in enumerate(ids) if s.push(t))
    assert done_at == ids.index(tok.encode("w")[0]) and s.finish_reason == "stop" and s.text() == "hel"
    s = engine.StopChecker(GenerationConfig(max_new_tokens=50), 50, tok, tok.eos_ids)
    assert not s.push(ids[0]) and s.push(min(tok.eos_ids)) and s.finish_reason == "eos"
    s = engine.StopChecker(GenerationConfig(max_new_tokens=50, ignore_eos=True), 50, tok, tok.eos_ids)
    assert not s.push(min(tok.eos_ids))


def test_stop_string_cuts_speculative_step(tiny):
    """A step commits several tokens at once; none past the stop string may get out."""
    target, draft = tiny("llama"), tiny("llama", "close")
    full = specdec.generate(target, PROMPTS[0], max_new_tokens=30, ignore_eos=True)
    stop = full.text[10:13]
    plain = specdec.generate(target, PROMPTS[0], max_new_tokens=30, ignore_eos=True, stop=[stop])
    spec = specdec.generate(target, PROMPTS[0], assistant_model=draft, k=6, max_new_tokens=30,
                            ignore_eos=True, stop=[stop])  # fmt: skip
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason == "stop"
    assert spec.text == full.text[: full.text.index(stop)]
    assert len(spec.token_ids) < 30


def test_context_policies(tiny):
    target, draft = tiny("llama"), tiny("llama", "close")  # context 512
    long_prompt = list(range(100)) * 5  # 500 tokens
    with pytest.raises(ContextOverflowError, match="context_overflow='truncate'"):
        specdec.generate(target, long_prompt, assistant_model=draft, max_new_tokens=20)
    out = specdec.generate(target, long_prompt, assistant_model=draft, max_new_tokens=20, k=4,
                           context_overflow="truncate", ignore_eos=True)  # fmt: skip
    plain = specdec.generate(target, long_prompt, max_new_tokens=20, context_overflow="truncate", ignore_eos=True)
    assert len(out.token_ids) == 12 and out.finish_reason == "length" and out.token_ids == plain.token_ids
    with pytest.raises(ContextOverflowError, match="shorten the prompt"):
        specdec.generate(target, list(range(200)) * 3, max_new_tokens=1, context_overflow="truncate")


# -- real model ----------------------------------------------------------------------------
REAL_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "List three colors of the rainbow.",
    "Translate 'good morning' into French and Spanish.",
]


@pytest.fixture(scope="module")
def noisy_smollm2(smollm2):
    """SmolLM2 with perturbed weights: a draft with the same tokenizer that is sometimes wrong."""
    model = load_transformer(smollm2.path, device="cpu")
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.add_(0.15 * p.std() * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.real
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identity_smollm2(smollm2, noisy_smollm2, k):
    rejected = 0
    for prompt in REAL_PROMPTS:
        plain = specdec.generate(smollm2, prompt, max_new_tokens=32)
        spec = specdec.generate(smollm2, prompt, drafter=DraftModelDrafter(noisy_smollm2), k=k, max_new_tokens=32)
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.finish_reason == plain.finish_reason
        rejected += spec.metrics.proposed - spec.metrics.accepted
    assert rejected > 0


@pytest.mark.real
def test_smollm2_stops_at_eos_and_stop_string(smollm2):
    out = specdec.generate(smollm2, REAL_PROMPTS[0], assistant_model=smollm2, max_new_tokens=60)
    assert out.finish_reason == "eos" and out.token_ids[-1] in smollm2.tokenizer.eos_ids
    assert "Paris" in out.text
    cut = specdec.generate(smollm2, REAL_PROMPTS[0], assistant_model=smollm2, max_new_tokens=60, stop=["Paris"])
    assert cut.finish_reason == "stop" and "Paris" not in cut.text and cut.text == out.text[: out.text.index("Paris")]


class RepeatLastDrafter:
    """A model-free drafter with no probabilities (q is a point mass): guesses that the last
    committed token repeats, and offers at most two tokens whatever k is."""

    def __init__(self, limit: int = 2):
        self.limit, self.forwards = limit, 0

    name = "repeat-last"

    def begin(self, session: DraftSession) -> None:
        self.last = int(session.context[0, -1])

    def propose(self, k: int):
        from specdec.drafters import Draft

        n = min(k, self.limit)
        return Draft(torch.full((1, n), self.last, dtype=torch.long), None)

    def accepted(self, num_accepted: int, next_token: int) -> None:
        self.last = next_token


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_deterministic_drafter_offering_fewer_than_k(tiny, temperature):
    target = tiny("llama")
    kw = dict(max_new_tokens=30, ignore_eos=True, temperature=temperature, seed=3)
    out = specdec.generate(target, PROMPTS[2], drafter=RepeatLastDrafter(), k=5, **kw)
    assert len(out.metrics.proposed_per_position) == 2
    assert out.metrics.proposed <= 2 * out.metrics.steps and len(out.token_ids) == 30
    if temperature == 0.0:
        assert out.token_ids == specdec.generate(target, PROMPTS[2], **kw).token_ids


def test_drafter_offering_more_than_k_is_refused(tiny):
    class Overeager(RepeatLastDrafter):
        def propose(self, k: int):
            return super().propose(self.limit)

    with pytest.raises(RuntimeError, match="proposed 3 tokens in a row, more than k=1"):
        specdec.generate(tiny("llama"), "abc", drafter=Overeager(limit=3), k=1, max_new_tokens=5)
