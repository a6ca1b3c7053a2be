"""End to end: greedy identity with plain decoding, exact sampling, stops, drafter rollback."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT_MODES, generate_many
from helpers import ALPHA, PROMPT_IDS, PROMPTS, chi2_pvalue

import specdec
from specdec.config import GenerationConfig, SamplingParams
from specdec.drafters import Draft, Drafter, DraftModelDrafter, DraftSession, Feedback
from specdec.drafters.draft_model import PREFILLED
from specdec.model import ContextOverflowError, load_transformer
from specdec.stops import StopChecker


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fp32_agrees_with_plain_decoding_mostly(tiny, arch):
    """fp32 is not batch-invariant (a k-row pass may differ from one-row passes in the last
    bits), so identity is not guaranteed there: only agreement is checked, on the first tokens
    of every prompt (a flip needs a near-tie, which random tiny models rarely have)."""
    target, draft = tiny(arch), tiny(arch, "close")
    agree = 0
    for prompt in PROMPTS:
        kw = dict(max_new_tokens=16, ignore_eos=True, chat=False)
        plain = specdec.generate(target, prompt, **kw).token_ids
        spec = specdec.generate(target, prompt, assistant_model=draft, k=4, adaptive_k=False, **kw).token_ids
        agree += plain[:4] == spec[:4]
    assert agree >= len(PROMPTS) - 1


class CheckingDrafter(Drafter):
    """Wraps a drafter; before every proposal, a fresh drafter begun on the committed tokens
    must propose the same greedy tokens, i.e. rollback left no stale state behind."""

    name = "checking"

    def __init__(self, model):
        super().__init__()
        self.inner = DraftModelDrafter(model)
        self.model = model
        self.checks = 0

    def begin(self, session: DraftSession) -> None:
        self.session = session
        self.committed = list(session.context)
        self.inner.begin(session)

    def propose(self, k: int):
        draft = self.inner.propose(k)
        fresh = DraftModelDrafter(self.model)
        fresh.begin(
            DraftSession(
                list(self.committed),
                self.session.capacity,
                self.session.sampling,
                self.session.generator,
                self.session.target,
                fixed_k=self.session.fixed_k,
            )
        )
        assert fresh.propose(k).tokens.tolist() == draft.tokens.tolist()
        self.checks += 1
        self.last = draft.tokens.tolist()
        return draft

    def accepted(self, feedback: Feedback) -> None:
        self.committed += self.last[: feedback.num_accepted] + [feedback.next_token]
        self.inner.accepted(feedback)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_draft_cache_rollback(tiny, k):
    target, draft = tiny("llama"), tiny("llama", "close")
    checker = CheckingDrafter(draft.model)
    out = specdec.generate(
        target, PROMPTS[1], drafter=checker, k=k, max_new_tokens=30, ignore_eos=True, chat=False, adaptive_k=False
    )
    assert checker.checks == out.metrics.steps > 1
    assert 0 < out.metrics.accepted < out.metrics.proposed  # partial acceptance happened


def test_same_model_as_draft_accepts_everything(tiny):
    target = tiny("qwen2")
    out = specdec.generate(
        target, PROMPTS[0], assistant_model=target, k=4, max_new_tokens=21, ignore_eos=True, adaptive_k=False
    )
    m = out.metrics
    assert m.acceptance_rate == 1.0 and m.mean_accepted_tokens == 5.0
    assert m.accepted_per_position == m.proposed_per_position == [4, 4, 4, 4]
    assert m.target_forwards == m.steps == 4 and m.new_tokens == 21


# -- exact sampling, end to end ----------------------------------------------------------
SAMPLINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]


# -- stops and context --------------------------------------------------------------------
def test_max_new_tokens_with_k_larger_than_budget(tiny):
    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])
    for n in (1, 2, 3):
        out = specdec.generate(
            target, "hello", assistant_model=draft, k=8, max_new_tokens=n, ignore_eos=True, adaptive_k=False
        )
        plain = specdec.generate(target, "hello", max_new_tokens=n, ignore_eos=True)
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert out.token_ids == plain.token_ids


def test_stop_checker_eos_and_strings(tiny):
    tok = tiny("llama").tokenizer
    cfg = GenerationConfig(max_new_tokens=50, stop=("lo w",))
    s = StopChecker(cfg, 50, tok, tok.eos_ids)
    ids = tok.encode("hello world")
    done_at = next(i for i, t in enumerate(ids) if s.push(t))
    assert done_at == ids.index(tok.encode("w")[0]) and s.finish_reason == "stop" and s.text() == "hel"
    s = StopChecker(GenerationConfig(max_new_tokens=50), 50, tok, tok.eos_ids)
    assert not s.push(ids[0]) and s.push(min(tok.eos_ids)) and s.finish_reason == "eos"
    s = StopChecker(GenerationConfig(max_new_tokens=50, ignore_eos=True), 50, tok, tok.eos_ids)
    assert not s.push(min(tok.eos_ids))


def test_stop_checks_decode_only_the_new_tail(tiny):
    """Each token decodes a short window, not the whole output: the work per token does not
    grow with the length (the old check decoded everything each time: quadratic)."""
    tok = tiny("llama").tokenizer
    sizes: list[int] = []
    decode = tok.decode
    tok.decode = lambda ids, **kw: (sizes.append(len(ids)), decode(ids, **kw))[1]  # type: ignore[method-assign]
    try:
        s = StopChecker(GenerationConfig(max_new_tokens=2000, stop=("zz",)), 2000, tok, tok.eos_ids)
        for t in tok.encode("speculative decoding " * 60):
            s.push(t)
    finally:
        tok.decode = decode  # type: ignore[method-assign]
    assert len(s.tokens) > 1000 and max(sizes) <= 4 and s.text() == "speculative decoding " * 60


def test_stop_string_cuts_speculative_step(tiny):
    """A step commits several tokens at once; none past the stop string may get out."""
    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])
    full = specdec.generate(target, PROMPTS[0], max_new_tokens=30, ignore_eos=True)
    stop = full.text[10:13]
    plain = specdec.generate(target, PROMPTS[0], max_new_tokens=30, ignore_eos=True, stop=[stop])
    spec = specdec.generate(
        target,
        PROMPTS[0],
        assistant_model=draft,
        k=6,
        max_new_tokens=30,
        ignore_eos=True,
        stop=[stop],
        adaptive_k=False,
    )
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason == "stop"
    assert spec.text == full.text[: full.text.index(stop)]
    assert len(spec.token_ids) < 30


def test_context_policies(tiny):
    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])  # context 512
    long_prompt = list(range(100)) * 5  # 500 tokens
    with pytest.raises(ContextOverflowError, match="--context-overflow truncate; API: context_overflow='truncate'"):
        specdec.generate(target, long_prompt, assistant_model=draft, max_new_tokens=20, adaptive_k=False)
    out = specdec.generate(
        target,
        long_prompt,
        assistant_model=draft,
        max_new_tokens=20,
        k=4,
        context_overflow="truncate",
        ignore_eos=True,
        adaptive_k=False,
    )
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
def test_greedy_identity_smollm2(smollm2_exact, noisy_smollm2, plain_outputs, k):
    plains = plain_outputs(smollm2_exact, REAL_PROMPTS, 32)
    specs = generate_many(
        smollm2_exact,
        [
            (p, dict(drafter=DraftModelDrafter(noisy_smollm2), k=k, max_new_tokens=32, adaptive_k=False))
            for p in REAL_PROMPTS
        ],
    )
    for prompt, plain, spec in zip(REAL_PROMPTS, plains, specs, strict=True):
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.finish_reason == plain.finish_reason
    assert sum(s.metrics.proposed - s.metrics.accepted for s in specs) > 0


@pytest.mark.real
def test_smollm2_stops_at_eos_and_stop_string(smollm2):
    out = specdec.generate(smollm2, REAL_PROMPTS[0], assistant_model=smollm2, max_new_tokens=60, adaptive_k=False)
    assert out.finish_reason == "eos" and out.token_ids[-1] in smollm2.tokenizer.eos_ids
    assert "Paris" in out.text
    cut = specdec.generate(
        smollm2, REAL_PROMPTS[0], assistant_model=smollm2, max_new_tokens=60, stop=["Paris"], adaptive_k=False
    )
    assert cut.finish_reason == "stop" and "Paris" not in cut.text and cut.text == out.text[: out.text.index("Paris")]


class RepeatLastDrafter(Drafter):
    """A model-free drafter with no probabilities (q is a point mass): guesses that the last
    committed token repeats, and offers at most two tokens whatever k is."""

    name = "repeat-last"

    def __init__(self, limit: int = 2):
        super().__init__()
        self.limit = limit

    def begin(self, session: DraftSession) -> None:
        self.last = session.context[-1]

    def propose(self, k: int):
        return Draft(torch.full((min(k, self.limit),), self.last, dtype=torch.long))

    def accepted(self, feedback: Feedback) -> None:
        self.last = feedback.next_token


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_deterministic_drafter_offering_fewer_than_k(tiny, temperature):
    target = tiny("llama", dtype=EXACT_MODES[0])
    kw = dict(max_new_tokens=30, ignore_eos=True, temperature=temperature, seed=3)
    out = specdec.generate(target, PROMPTS[2], drafter=RepeatLastDrafter(), k=5, adaptive_k=False, **kw)
    assert len(out.metrics.proposed_per_position) == 2
    assert out.metrics.proposed <= 2 * out.metrics.steps and len(out.token_ids) == 30
    if temperature == 0.0:
        assert out.token_ids == specdec.generate(target, PROMPTS[2], **kw).token_ids


def test_drafter_offering_more_than_k_is_refused(tiny):
    class Overeager(RepeatLastDrafter):
        def propose(self, k: int):
            return super().propose(self.limit)

    with pytest.raises(RuntimeError, match="proposed 3 tokens in a row, more than k=1"):
        specdec.generate(tiny("llama"), "abc", drafter=Overeager(limit=3), k=1, max_new_tokens=5, adaptive_k=False)


class FeatureRecorder(Drafter):
    """Drafts with a draft model and records the target's features it is shown: the prompt's
    at `begin`, the accepted path's after each step (what a feature-level drafter reads)."""

    name = "feature-recorder"
    wants_hidden = True
    feature_layers = (0, 1)

    def __init__(self, draft):
        super().__init__()
        self.inner = DraftModelDrafter(draft)

    def begin(self, session: DraftSession) -> None:
        self.pos = len(session.context) - 1  # position of the last committed token
        self.layers = {i: list(session.layers[i]) for i in self.feature_layers}
        self.hidden: list[torch.Tensor] = []
        self.inner.begin(session)

    def propose(self, k: int) -> Draft:
        return self.inner.propose(k)

    def accepted(self, feedback: Feedback) -> None:
        rows = feedback.accepted_rows
        for i in self.feature_layers:
            self.layers[i] += list(feedback.layers[i][rows])
        self.hidden += list(feedback.hidden[rows])
        self.inner.accepted(feedback)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_drafter_sees_the_targets_features_on_the_committed_path(tiny, arch):
    """Hidden states and chosen layers for the prompt and every committed token equal (bitwise,
    in an exact mode) what one-token decoding of the committed sequence computes."""
    target = tiny(arch, dtype=EXACT_MODES[-1])
    model = target.model
    prompt = specdec.encode_prompt(target.tokenizer, PROMPTS[0], chat=False)
    rec = FeatureRecorder(tiny(arch, "close", dtype=EXACT_MODES[-1]).model)
    out = specdec.generate(target, prompt, drafter=rec, k=3, max_new_tokens=20, ignore_eos=True, adaptive_k=False)
    assert 0 < out.metrics.accepted < out.metrics.proposed
    seq = prompt + out.token_ids
    cache = model.new_cache(len(seq))
    ref = model(torch.tensor([prompt]), cache, output_layers=(0, 1))
    layers = {i: list(ref.layers[i][0]) for i in (0, 1)}
    hidden: list[torch.Tensor] = []
    for t in seq[len(prompt) : len(prompt) + len(rec.hidden)]:
        step = model(torch.tensor([[t]]), cache, return_hidden=True, output_layers=(0, 1))
        hidden.append(step.hidden[0, 0])
        for i in (0, 1):
            layers[i].append(step.layers[i][0, 0])
    n = len(rec.layers[0])
    assert len(prompt) + len(rec.hidden) == n and n > len(prompt) + 10
    for i in (0, 1):
        assert torch.equal(torch.stack(rec.layers[i]), torch.stack(layers[i][:n]))
    assert torch.equal(torch.stack(rec.hidden), torch.stack(hidden))


class SampledTreeDrafter(Drafter):
    """Drafts token trees by sampling (a test drafter): two root children drawn from the
    draft model's q without replacement, and one grandchild under the first, drawn from q
    there. The draft model is run on the whole committed context (tiny models)."""

    name = "sampled-tree"

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def begin(self, session: DraftSession) -> None:
        self.session, self.committed = session, list(session.context)

    def _q(self, tokens: list[int]) -> torch.Tensor:
        from specdec.sampling import probs

        logits = self.draft(torch.tensor([tokens]), self.draft.new_cache(len(tokens)), last_only=True).logits[0, -1]
        self.forwards += 1
        return probs(logits, self.session.sampling)

    def propose(self, k: int) -> Draft:
        g = self.session.generator
        q0 = self._q(self.committed)
        s = q0.clone()
        xs = []
        for _ in range(2):
            x = int(torch.multinomial(s / s.sum(), 1, generator=g))
            xs.append(x)
            s[x] = 0.0
        tokens, parents, rows = xs, [-1, -1], [q0, q0]
        if k >= 2:
            q1 = self._q(self.committed + xs[:1])
            tokens, parents, rows = xs + [int(torch.multinomial(q1, 1, generator=g))], [-1, -1, 0], rows + [q1]
        self.tokens = tokens
        return Draft(torch.tensor(tokens), torch.stack(rows), parents=parents)

    def accepted(self, feedback: Feedback) -> None:
        self.committed += [self.tokens[j] for j in feedback.path] + [feedback.next_token]


@pytest.mark.parametrize(
    "sampling", [*SAMPLINGS, SamplingParams(temperature=0.5)], ids=["T1", "T0.7-topk-topp", "T0.5"]
)
@pytest.mark.slow
def test_sampled_token_trees_match_target_distribution(small_vocab, exact_joint, sample_joint, sampling):
    target, draft = small_vocab
    counts = sample_joint(target, lambda: SampledTreeDrafter(draft), sampling, runs=3000, bounds=(0.05, 0.95))
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) > ALPHA


@pytest.mark.slow
def test_wrong_sampled_tree_rule_fails_end_to_end(small_vocab, exact_joint, sample_joint, wrong_rule):
    """Negative control: keeping a rejected child's mass in the proposal over-accepts the later
    siblings (most visible with a peaked draft: T = 0.5)."""
    wrong_rule("sampled-tree")
    target, draft = small_vocab
    sampling = SamplingParams(temperature=0.5)
    counts = sample_joint(target, lambda: SampledTreeDrafter(draft), sampling, runs=3000, bounds=(0.05, 0.95))
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) <= ALPHA


@pytest.mark.parametrize("dtype", EXACT_MODES)
def test_a_prompt_read_in_chunks_gives_what_one_pass_gives(tiny, dtype):
    """A prompt longer than the engine's prefill chunk is read over several steps, each reporting its
    progress (a delta without tokens); every output, greedy and sampled, speculative and plain,
    beside sequences with the same prompt (which share its chunks), is bitwise what one pass
    gives."""
    from specdec import engine as eng

    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    prompt = list(range(3, 60)) * 2  # 114 tokens
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True, k=3, adaptive_k=False)

    def runs(chunk: int = eng.PREFILL_CHUNK) -> list[list[int]]:
        out, progress = [], []
        for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=5)):
            e = eng.Engine(target.model, target.tokenizer, prefill_chunk=chunk)
            ids = [
                e.add(prompt, cfg, sampling, None),
                e.add(prompt, cfg, sampling, DraftModelDrafter(draft.model)),
                e.add(prompt, cfg, sampling, None),
            ]
            while e.has_work():
                progress += [d.prefilled for d in e.step() if d.seq_id == ids[0] and d.prefilled is not None]
            out += [e.result(i).token_ids for i in ids]
        return out, progress

    whole, none = runs()
    assert none == [] and whole[0] == whole[1] == whole[2] and whole[3] == whole[5]  # (sampled: the law, not the draws)
    chunked, progress = runs(25)
    assert chunked == whole
    assert progress == [25, 50, 75, 100] * 2  # then the first token, at 114
    with pytest.raises(ValueError, match="prefill_chunk is the most prompt rows"):
        eng.Engine(target.model, prefill_chunk=0)


def test_wrong_chunks_fail_the_same_check(tiny, monkeypatch):
    """Negative control: a chunked prefill that skips a token of the prompt changes the output
    (the identity above is not vacuous)."""
    from specdec import engine as eng

    target = tiny("llama", dtype="q4k" if "q4k" in EXACT_MODES else EXACT_MODES[0])
    prompt = list(range(3, 60)) * 2
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    whole = eng.run(target.model, prompt, cfg, SamplingParams(), tokenizer=target.tokenizer).token_ids
    real = eng.Engine._segment

    def skipping(self, s, draft):
        seg = real(self, s, draft)
        if s.last is None and s.prefilled == 25:  # drop the chunk's first token
            s.prompt = s.prompt[:25] + s.prompt[26:]
            seg = real(self, s, draft)
        return seg

    monkeypatch.setattr(eng.Engine, "_segment", skipping)
    skipped = eng.run(target.model, prompt, cfg, SamplingParams(), tokenizer=target.tokenizer, prefill_chunk=25)
    assert skipped.token_ids != whole


def test_copying_part_of_a_prefix_needs_the_part_before_it(tiny):
    """`copy_prefix(..., start=)` copies only slots start..n of a prefix the cache holds up to
    `start` already; a start past what it holds is refused, not silently left stale."""
    model = tiny("llama").model
    a, b = model.new_cache(16), model.new_cache(16)
    model(torch.arange(3, 11)[None], a, last_only=True)  # 8 slots
    b.copy_prefix(a, 4)
    b.copy_prefix(a, 8, start=4)
    assert b.length == 8 and torch.equal(b.k[0][:, :, :8], a.k[0][:, :, :8]) and torch.equal(b.pos[:, :8], a.pos[:, :8])
    with pytest.raises(ValueError, match="from slot 6"):
        model.new_cache(16).copy_prefix(a, 8, start=6)


def test_a_draft_that_caught_up_keeps_the_prompts_prefill_for_the_next_sequence(tiny):
    """The draft keeps the last prompt it prefilled for the next sequence with that prompt (n > 1,
    a benchmark's repeats); a sequence whose draft first followed tokens another drafter
    committed (auto) prefills more than the prompt, and must not displace it."""
    from specdec.sampling import make_generator

    model = tiny("llama", "close").model
    context = list(PROMPT_IDS) * 4

    def begun() -> DraftModelDrafter:
        d = DraftModelDrafter(model)
        d.begin(DraftSession(list(context), 64, SamplingParams(), make_generator(0, "cpu")))
        return d

    begun().sync()
    prompt = PREFILLED.get(model)
    assert prompt is not None and len(prompt[0]) == len(context) - 1
    late = begun()
    late.catch_up([5, 6, 7])
    late.sync()
    assert PREFILLED.get(model) is prompt
    again = begun()
    assert again._catch_up_ms() == 0.0  # (it copies the prompt's prefill)
