"""Several sequences in one engine: each decodes exactly as it does alone (greedy, in the
batch-invariant modes; sampled, with its own seed), the sampling law holds with many
sequences in flight (with a negative control), sequences join and leave between steps."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
from conftest import EXACT_MODES
from helpers import ALPHA, PROMPTS, chi2_pvalue

import specdec
from specdec import Engine
from specdec.config import GenerationConfig, SamplingParams
from specdec.drafters import (
    Draft,
    Drafter,
    DraftModelDrafter,
    DraftSession,
    EarlyExitDrafter,
    LookaheadDrafter,
    PromptLookupDrafter,
)

KINDS = ("plain", "prompt-lookup", "silent", "draft-model", "early-exit", "lookahead")


class SilentDrafter(Drafter):
    """Never has anything to propose: its sequence still gets its one row per step."""

    name = "silent"

    def begin(self, session: DraftSession) -> None:
        pass

    def propose(self, k: int) -> Draft:
        return Draft.empty()


def make(kind: str, target: specdec.LoadedModel, draft: specdec.LoadedModel) -> Drafter | None:
    return {
        "plain": lambda: None,
        "prompt-lookup": PromptLookupDrafter,
        "silent": SilentDrafter,
        "draft-model": lambda: DraftModelDrafter(draft.model),
        "early-exit": lambda: EarlyExitDrafter(target.model, layer=1),
        "lookahead": lambda: LookaheadDrafter(window=2, ngram=3, guesses=2),
    }[kind]()


def together(target, prompts: list[list[int]], cfgs, samplings, drafters, join_at: dict[int, int] | None = None):
    """Decode every prompt in one engine; prompt i joins before step join_at[i] (default 0)."""
    eng = Engine(target.model, target.tokenizer)
    sids: dict[int, int] = {}
    step = 0
    while len(sids) < len(prompts) or eng.has_work():
        for i in range(len(prompts)):
            if i not in sids and (join_at or {}).get(i, 0) <= step:
                sids[i] = eng.add(prompts[i], cfgs[i], samplings[i], drafters[i])
        eng.step()
        step += 1
    return [eng.result(sids[i]) for i in range(len(prompts))]


def encode(target, texts) -> list[list[int]]:
    return [specdec.encode_prompt(target.tokenizer, t, chat=False) for t in texts]


@pytest.mark.parametrize("mode", EXACT_MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_batched_greedy_equals_each_prompt_alone(tiny, arch, mode):
    """N different prompts (mixed lengths, k and drafters, one that never proposes) decoded
    together give, per sequence, exactly the tokens of that prompt decoded alone."""
    target, draft = tiny(arch, dtype=mode), tiny(arch, "close", dtype=mode)
    greedy = SamplingParams()
    alone = [specdec.generate(target, p, max_new_tokens=20, ignore_eos=True, chat=False).token_ids for p in PROMPTS]
    proposed = 0
    for n, shift in ((1, 0), (2, 1), (3, 2), (5, 3), (6, 0)):
        idx = [(i + shift) % len(PROMPTS) for i in range(n)]
        cfgs = [GenerationConfig(max_new_tokens=20, k=1 + j % 4, ignore_eos=True, adaptive_k=False) for j in range(n)]
        drafters = [make(KINDS[(j + shift) % len(KINDS)], target, draft) for j in range(n)]
        join = {j: 2 * j for j in range(n)} if n == 6 else None  # the last case: staggered joins
        outs = together(target, encode(target, [PROMPTS[i] for i in idx]), cfgs, [greedy] * n, drafters, join)
        for j, (i, out) in enumerate(zip(idx, outs, strict=True)):
            assert out.token_ids == alone[i], (n, j, KINDS[(j + shift) % len(KINDS)])
            proposed += out.metrics.proposed
    assert proposed > 0


@pytest.mark.real
@pytest.mark.parametrize("mode", EXACT_MODES)
def test_batched_greedy_equals_alone_smollm2(smollm2_exact, mode):
    target = (
        smollm2_exact if mode == smollm2_exact.model.mode else specdec.load("smollm2-135m", dtype=mode, device="cpu")
    )
    texts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
        "List the numbers 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and then again 1, 2, 3,",
        "Hi",
    ]
    prompts = [specdec.encode_prompt(target.tokenizer, t) for t in texts]
    alone = [specdec.generate(target, p, max_new_tokens=24).token_ids for p in prompts]
    for n in (2, 3, 5):
        kinds = ["prompt-lookup", "plain", "draft-model", "silent", "early-exit"][:n]
        drafters = [
            make(k, target, target) if k != "early-exit" else EarlyExitDrafter(target.model, layer=20) for k in kinds
        ]
        cfg = GenerationConfig(max_new_tokens=24, k=3, adaptive_k=False)
        outs = together(target, prompts[:n], [cfg] * n, [SamplingParams()] * n, drafters)
        assert [o.token_ids for o in outs] == alone[:n], n


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_sampled_sequence_same_alone_and_in_any_batch(tiny, arch):
    """A sampled sequence with a fixed seed gives the same tokens alone or in a batch."""
    mode = EXACT_MODES[-1]
    target, draft = tiny(arch, dtype=mode), tiny(arch, "close", dtype=mode)
    cfg = GenerationConfig(max_new_tokens=16, k=3, ignore_eos=True, adaptive_k=False)
    sp = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i) for i in range(5)]
    prompts = encode(target, PROMPTS[:5])
    kinds = ["draft-model", "prompt-lookup", "plain", "early-exit", "lookahead"]
    alone = [
        together(target, [p], [cfg], [s], [make(k, target, draft)])[0].token_ids
        for p, s, k in zip(prompts, sp, kinds, strict=True)
    ]
    batched = together(target, prompts, [cfg] * 5, sp, [make(k, target, draft) for k in kinds], {3: 2, 4: 4})
    assert [o.token_ids for o in batched] == alone
    assert len({tuple(a) for a in alone}) == 5


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sequences_sharing_a_prompt_share_its_prefill_and_decode_as_alone(tiny, arch):
    """Sequences that start together with one prompt are prefilled once (the others copy the
    cache); each still gives the tokens it gives alone with its seed."""
    mode = EXACT_MODES[-1]
    target, draft = tiny(arch, dtype=mode), tiny(arch, "close", dtype=mode)
    cfg = GenerationConfig(max_new_tokens=12, k=3, ignore_eos=True, adaptive_k=False)
    sp = [SamplingParams(temperature=0.9, seed=200 + i) for i in range(5)]
    prompt = encode(target, PROMPTS[:1])[0]
    kinds = ["draft-model", "prompt-lookup", "plain", "early-exit", "lookahead"]
    alone = [
        together(target, [prompt], [cfg], [s], [make(k, target, draft)])[0].token_ids
        for s, k in zip(sp, kinds, strict=True)
    ]
    rows = []
    real = target.model.forward_batch

    def counting(segments, **kw):
        rows.append(sum(int(seg.tokens.shape[0]) for seg in segments))
        return real(segments, **kw)

    target.model.forward_batch = counting
    try:
        batched = together(target, [prompt] * 5, [cfg] * 5, sp, [make(k, target, draft) for k in kinds])
    finally:
        del target.model.forward_batch
    assert [o.token_ids for o in batched] == alone
    assert rows[0] == len(prompt)  # one prefill for the five
    assert len({tuple(a) for a in alone}) == 5


def alternating(target, draft):
    """A factory of drafters alternating between a draft model and early exit."""
    made = itertools.count()
    return lambda: DraftModelDrafter(draft) if next(made) % 2 else EarlyExitDrafter(target, layer=1)


@pytest.mark.slow
def test_sampling_law_with_sequences_in_flight(small_vocab, exact_joint, sample_joint):
    """Sequences join as others end, drafters of two kinds in one batch (`sample_joint`)."""
    target, draft = small_vocab
    sampling = SamplingParams(temperature=1.0)
    counts = sample_joint(target, alternating(target, draft), sampling, runs=3000, bounds=(0.1, 0.95))
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) > ALPHA


@pytest.mark.slow
def test_wrong_rule_fails_with_sequences_in_flight(small_vocab, exact_joint, sample_joint, wrong_rule):
    wrong_rule("rejection")
    target, draft = small_vocab
    sampling = SamplingParams(temperature=1.0)
    counts = sample_joint(target, alternating(target, draft), sampling, runs=3000, bounds=(0.1, 0.95))
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) <= ALPHA


def test_cancel_frees_the_sequence_and_leaves_the_others_identical(tiny):
    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])
    cfg = GenerationConfig(max_new_tokens=20, k=3, ignore_eos=True, adaptive_k=False)
    prompts = encode(target, PROMPTS[:3])
    alone = [specdec.generate(target, p, max_new_tokens=20, ignore_eos=True).token_ids for p in prompts]
    eng = Engine(target.model, target.tokenizer)
    sids = [
        eng.add(p, cfg, SamplingParams(), d)
        for p, d in zip(prompts, [DraftModelDrafter(draft.model), PromptLookupDrafter(), None], strict=True)
    ]
    for _ in range(3):
        eng.step()
    cache = weakref.ref(eng._live[sids[1]].cache)
    eng.cancel(sids[1])
    gc.collect()
    assert cache() is None and sids[1] not in eng.live()  # its KV cache is gone
    while eng.has_work():
        eng.step()
    cancelled = eng.result(sids[1])
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.token_ids) < 20
    assert cancelled.token_ids == alone[1][: len(cancelled.token_ids)]
    assert eng.result(sids[0]).token_ids == alone[0] and eng.result(sids[2]).token_ids == alone[2]
    with pytest.raises(KeyError):
        eng.cancel(sids[0])


def test_one_drafter_object_cannot_serve_two_live_sequences(tiny):
    target = tiny("llama")
    eng = Engine(target.model, target.tokenizer)
    d = PromptLookupDrafter()
    eng.add([1, 2, 3], GenerationConfig(max_new_tokens=4), SamplingParams(), d)
    with pytest.raises(ValueError, match="give each sequence its own drafter"):
        eng.add([1, 2, 3], GenerationConfig(max_new_tokens=4), SamplingParams(), d)


def test_draft_model_drafts_for_all_its_sequences_in_one_call_per_step(tiny):
    """Drafters of one draft model share its forward passes: k draft steps are k calls of the
    draft model whatever the batch size."""
    target, draft = tiny("qwen2", dtype=EXACT_MODES[-1]), tiny("qwen2", "close", dtype=EXACT_MODES[-1])
    calls: list[int] = []
    real = draft.model.forward_batch

    def counting(segments, **kw):
        calls.append(len(segments))
        return real(segments, **kw)

    draft.model.forward_batch = counting  # type: ignore[method-assign]
    try:
        cfg = GenerationConfig(max_new_tokens=12, k=3, ignore_eos=True, adaptive_k=False)
        outs = together(
            target,
            encode(target, PROMPTS[:4]),
            [cfg] * 4,
            [SamplingParams()] * 4,
            [DraftModelDrafter(draft.model) for _ in range(4)],
        )
    finally:
        del draft.model.forward_batch
    assert max(calls) == 4  # one call drafts a token for each of the 4 sequences
    assert sum(o.metrics.draft_forwards for o in outs) > len(calls)


def test_generate_batch_api(tiny):
    target = tiny("gemma3", dtype=EXACT_MODES[-1])
    outs = specdec.generate_batch(
        target,
        PROMPTS[:3],
        drafter="prompt-lookup",
        k=3,
        max_new_tokens=12,
        ignore_eos=True,
        chat=False,
        temperature=0.8,
        seed=5,
        adaptive_k=False,
    )
    for i, out in enumerate(outs):
        alone = specdec.generate(
            target,
            PROMPTS[i],
            drafter="prompt-lookup",
            k=3,
            max_new_tokens=12,
            ignore_eos=True,
            chat=False,
            temperature=0.8,
            seed=5 + i,
            adaptive_k=False,
        )
        assert out.token_ids == alone.token_ids and out.seed == 5 + i
    with pytest.raises(ValueError, match="3 prompts but 2 seeds"):
        specdec.generate_batch(target, PROMPTS[:3], seed=[1, 2], max_new_tokens=2)


def test_early_exit_drafts_for_all_its_sequences_in_one_call_per_step(tiny):
    """Early-exit drafters of one target share the early blocks' calls: a draft step runs
    blocks [0, L) once for every sequence's row."""
    mode = EXACT_MODES[-1]
    target = tiny("gemma3", dtype=mode)
    model = target.model
    calls: list[int] = []
    real = model.forward_batch

    def counting(segments, **kw):
        if kw.get("hi") is not None and kw["hi"] < model.args.n_layers:  # an early-exit draft call
            calls.append(len(segments))
        return real(segments, **kw)

    model.forward_batch = counting  # type: ignore[method-assign]
    try:
        cfg = GenerationConfig(max_new_tokens=12, k=3, ignore_eos=True, adaptive_k=False)
        prompts = encode(target, PROMPTS[:4])
        outs = together(
            target, prompts, [cfg] * 4, [SamplingParams()] * 4, [EarlyExitDrafter(model, layer=1) for _ in range(4)]
        )
    finally:
        del model.forward_batch
    assert max(calls) == 4
    alone = [specdec.generate(target, p, max_new_tokens=12, ignore_eos=True).token_ids for p in prompts]
    assert [o.token_ids for o in outs] == alone
