"""Python API, shaped like Hugging Face's ``generate(..., assistant_model=draft)``.

>>> import specdec
>>> target = specdec.load("qwen2.5-coder-1.5b")
>>> draft = specdec.load("qwen2.5-coder-0.5b")
>>> out = specdec.generate(target, "Write a Python function that reverses a list.",
...                        assistant_model=draft, k=4, max_new_tokens=64)
>>> out.text, out.metrics.acceptance_rate
>>> for delta in specdec.stream(target, "Explain recursion.", drafter="prompt-lookup"):
...     print(delta.text, end="", flush=True)
>>> outs = specdec.generate_batch(target, ["First prompt", "Second prompt"], assistant_model=draft)
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import store
from .config import GenerationConfig, SamplingParams
from .drafters import cross
from .drafters.base import Drafter, draft_model_method, make_drafter, needs_draft_model, uses_draft_model
from .drafters.base import prepare as prepare_drafter
from .engine import Delta, Engine, GenerationResult
from .memory import pools_of
from .model.load import load_transformer
from .model.transformer import Transformer
from .plans import CONFIG_FIELDS as _CONFIG_FIELDS
from .plans import SAMPLING_FIELDS as _SAMPLING_FIELDS
from .plans import plan_request
from .tokenizer import Messages, Tokenizer, tokenizers_equal
from .verify import Rules

Prompt = str | Messages | list[int]


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: Transformer
    tokenizer: Tokenizer

    def __repr__(self) -> str:
        a = self.model.args
        return f"LoadedModel({self.name!r}, {a.model_type}, {a.n_layers} layers, mode={self.model.mode})"


def load(
    name_or_path: str | Path, *, dtype: str = "auto", device: str | torch.device | None = None, bits: int | None = None
) -> LoadedModel:
    """Load a registered model name, a Hugging Face directory or a GGUF file.

    `dtype` is a precision/kernel mode: "auto" (the fastest mode that keeps greedy identity
    exact: q4k on the CPU, int8 where q4k's kernel cannot be built), "fp32", "bf16", "fp16",
    "int8" or "q4k". `bits` (q4k): load a draft model from a cheaper packing than its file's —
    4: every linear layer in Q4_K blocks (the draft's numbers change, and with them only the
    acceptance: speculative decoding stays exact whatever the draft computes)."""
    path = store.resolve(name_or_path)
    return LoadedModel(
        str(name_or_path), path, load_transformer(path, dtype=dtype, device=device, bits=bits), Tokenizer.from_dir(path)
    )


def load_draft(
    name_or_path: str | Path,
    *,
    dtype: str = "auto",
    device: str | torch.device | None = None,
    bits: int | None | str = "default",
) -> LoadedModel:
    """`load` for a model that will draft: `bits="default"` takes the packing measured best for
    a known draft model (`registry.ModelSpec.draft_bits`) where the mode has it, else the file's own."""
    return load(
        name_or_path, dtype=dtype, device=device, bits=draft_bits(name_or_path, bits, dtype=dtype, device=device)
    )


def draft_bits(
    name_or_path: str | Path,
    bits: int | None | str = "default",
    *,
    dtype: str = "auto",
    device: str | torch.device | None = None,
) -> int | None:
    """The packing a draft model is loaded from: `bits` as given, or for "default" the one a
    known draft model drafts from in this mode (None: its file's own)."""
    if bits != "default":
        return bits  # type: ignore[return-value]
    from .model.kernels import get_mode
    from .model.load import resolve_device
    from .registry import MODELS

    spec = MODELS.get(str(name_or_path))
    return spec.draft_bits if spec is not None and get_mode(dtype, resolve_device(device)).name == "q4k" else None


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt, chat: bool | None = None) -> list[int]:
    """Token ids for a prompt: raw ids are kept; text goes through the chat template when the
    tokenizer has one (or `chat=True`), else is encoded as is."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty; give some text to continue")
        use_chat = tokenizer.has_chat_template if chat is None else chat
        return tokenizer.encode_chat([{"role": "user", "content": prompt}]) if use_chat else tokenizer.encode(prompt)
    if not prompt:
        raise ValueError("the prompt is empty; give some text, messages or token ids")
    if isinstance(prompt[0], dict):
        return tokenizer.encode_chat(prompt)  # type: ignore[arg-type]
    ids = [int(i) for i in prompt]  # type: ignore[arg-type]
    vocab = tokenizer.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    return ids


def build_drafter(
    target: LoadedModel,
    assistant_model: LoadedModel | None = None,
    drafter: Drafter | str | None = None,
    **options: Any,
) -> Drafter | None:
    """The drafter for one sequence: `drafter` may be a drafter object, or a registered name
    (`specdec.DRAFTERS`) built with `options`; `assistant_model` alone means the draft-model
    drafter. None: plain decoding."""
    if isinstance(drafter, Drafter):
        if assistant_model is not None or any(v is not None for v in options.values()):
            raise ValueError("pass a drafter object alone, or a drafter name with its options")
        return drafter
    if drafter is not None and not isinstance(drafter, str):
        raise TypeError(f"drafter must be a name or a specdec.Drafter, got {type(drafter).__name__}")
    crossing, left_out = None, None
    if assistant_model is not None:
        if drafter is not None and not uses_draft_model(drafter):
            raise ValueError(f"pass either assistant_model or drafter={drafter!r}, not both (auto uses both)")
        drafter = drafter or draft_model_method()
        try:
            crossing = draft_bridge(target, assistant_model)
        except ValueError as e:
            if needs_draft_model(drafter) or draft_model_method() in (options.get("methods") or ""):
                raise
            # (auto by default: it goes on without the draft, and says so after the run)
            left_out, assistant_model = {draft_model_method(): str(e)}, None
    if drafter is None:
        given = sorted(k for k, v in options.items() if v is not None)
        if given:
            known = sorted(_CONFIG_FIELDS | _SAMPLING_FIELDS | {"k", "chat", "config", "sampling"})
            raise ValueError(
                f"unknown option {given[0]!r}: generation options are {', '.join(known)}; "
                "a drafter's own options go with drafter=NAME"
            )
        return None
    return make_drafter(
        drafter,
        target=target.model,
        draft=assistant_model.model if assistant_model else None,
        bridge=crossing,
        left_out=left_out,
        **options,
    )


def draft_bridge(target: LoadedModel, draft: LoadedModel) -> cross.Bridge | None:
    """None where the draft shares the target's tokenizer; else the pair's `cross.Bridge`
    (built once, checked: one clear line where the pair cannot draft across)."""
    if tokenizers_equal(target.tokenizer, draft.tokenizer):
        return None
    vocabs = (target.model.args.vocab_size, draft.model.args.vocab_size)
    b = cross.bridge(target.tokenizer, draft.tokenizer, *vocabs, names=(target.name, draft.name))
    if b.refused is not None:
        raise ValueError(b.refused)
    return b


@dataclass
class Request:
    """One sequence, checked and encoded once: what the engine needs."""

    prompt_ids: list[int]
    config: GenerationConfig
    sampling: SamplingParams
    drafter: Drafter | None
    k_source: str | None  # "given", "tuned" or "default"; None for plain decoding
    prediction: list[int] | None = None  # the output expected (predicted outputs), tokenized
    logprobs: int | None = None  # each token's logprob with this many alternatives (None: none)
    # whose earlier outputs its drafter may draft from (`DraftSession.pool`; None: the pool of
    # the process's cached rows, "")
    drafter_pool: str | None = None
    # what picks each step's drafter and k (`adaptive.Chooser` or a subclass, made with a margin;
    # None: the default rule)
    chooser: Callable[[float], Any] | None = None


def request(
    target: LoadedModel,
    prompt: Prompt,
    *,
    assistant_model: LoadedModel | None = None,
    drafter: Drafter | str | None = None,
    drafter_options: dict[str, Any] | None = None,
    config: GenerationConfig | None = None,
    sampling: SamplingParams | None = None,
    k: int | None = None,
    chat: bool | None = None,
    prediction: str | list[int] | None = None,
    logprobs: int | None = None,
    chooser: Callable[[float], Any] | None = None,
    **kwargs: Any,
) -> Request:
    """Build a request from either config objects (`config=`, `sampling=`: built once by the
    caller) or the keywords of their fields (max_new_tokens=, temperature=, stop=, ...).
    `prediction`: the output expected (text, or token ids), drafted from by the prediction
    drafter (the default where a prediction is given; with an assistant model, auto).
    `logprobs`: return each token's logprob with this many alternatives (0..20). `chooser`: the
    rule that picks each step's drafter and k (an `adaptive.Chooser` subclass, called with the
    margin over plain decoding: a policy of one's own to compare; default `adaptive.Chooser`)."""
    unknown = set(kwargs) - _CONFIG_FIELDS - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown generation option {sorted(unknown)[0]!r}")
    if config is not None and set(kwargs) & _CONFIG_FIELDS:
        raise ValueError("pass config= or its fields as keywords, not both")
    if sampling is not None and set(kwargs) & _SAMPLING_FIELDS:
        raise ValueError("pass sampling= or its fields as keywords, not both")
    predicted = encode_prediction(target.tokenizer, prediction) if prediction is not None else None
    plan = plan_request(
        target=target.name,
        mode=target.model.mode,
        draft=assistant_model.name if assistant_model is not None else None,
        named=drafter,
        k=k,
        predicted=predicted is not None,
        config=config if config is not None else {key: v for key, v in kwargs.items() if key in _CONFIG_FIELDS},
        sampling=sampling if sampling is not None else {key: v for key, v in kwargs.items() if key in _SAMPLING_FIELDS},
    )
    spec = build_drafter(target, assistant_model, plan.drafter, **(drafter_options or {}))
    prompt_ids = encode_prompt(target.tokenizer, prompt, chat)
    return Request(prompt_ids, plan.config, plan.sampling, spec, plan.k_source, predicted, logprobs, chooser=chooser)


def encode_prediction(tokenizer: Tokenizer, prediction: str | list[int]) -> list[int]:
    """Token ids of a prediction: text is encoded as it stands (no chat template, no special
    tokens: it is output, not a prompt); ids are kept (the engine checks their range)."""
    if isinstance(prediction, str):
        return tokenizer.encode_text(prediction)
    if not isinstance(prediction, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in prediction):
        raise ValueError("a prediction is text or a list of token ids")
    return list(prediction)


def submit(engine: Engine, req: Request, pool: str = "") -> int:
    """Queue `req` on `engine` (every front end's one door to it: the CLI's and the Python API's
    runs, the server's worker); `pool`: whose cached rows (and, unless the request names a
    drafter pool, whose earlier outputs) it may start from (`Engine.add`)."""
    return engine.add(
        req.prompt_ids,
        req.config,
        req.sampling,
        req.drafter,
        pool,
        prediction=req.prediction,
        logprobs=req.logprobs,
        drafter_pool=req.drafter_pool,
        chooser=req.chooser,
    )


def _finish(result: GenerationResult, req: Request) -> GenerationResult:
    if req.drafter is not None:
        result.metrics.k, result.metrics.k_source = req.config.k, req.k_source
    return result


def run_request(
    target: LoadedModel, req: Request, on_delta: Callable[[Delta], None] | None = None, *, prefix_tokens: int = 0
) -> GenerationResult:
    """Decode one request to the end; `on_delta` sees each step's committed tokens and text.
    `prefix_tokens`: start from the rows of an earlier sequence that began the same way, and
    keep this one's, in the model's prefix store of that many tokens (`model.prefix`)."""
    prepare(target, req.drafter)  # (before the request's clock starts)
    engine = Engine(target.model, target.tokenizer, prefix_tokens=prefix_tokens)
    sid = submit(engine, req)
    while engine.has_work():
        for delta in engine.step():
            if on_delta is not None:
                on_delta(delta)
    return _finish(engine.result(sid), req)


def generate(target: LoadedModel, prompt: Prompt, **kwargs: Any) -> GenerationResult:
    """Generate from `target`; speculative when an assistant model or a drafter is given,
    plain autoregressive decoding otherwise.

    Keywords: ``assistant_model=`` (a draft model) or ``drafter=`` (a registered name such
    as "prompt-lookup", or a `Drafter` object) with the drafter's options (e.g.
    ``max_ngram=4``); ``k`` (unset: the k `specdec bench --tune` stored for this target,
    method and mode, else 4; `metrics.k_source` says which); the fields of
    `GenerationConfig` (``max_new_tokens``, ``stop``, ``ignore_eos``, ``context_overflow``)
    and `SamplingParams` (``temperature``, ``top_k``, ``top_p``, ``seed``), or the objects
    themselves as ``config=`` and ``sampling=``; ``chat`` (use the chat template; default:
    when the tokenizer has one); ``chooser`` (the rule that picks each step's drafter and k:
    an `adaptive.Chooser` subclass)."""
    return run_request(target, _request_kw(target, prompt, kwargs))


class Stream:
    """Iterate to get each step's `Delta` (tokens and text committed); `result` is the whole
    `GenerationResult` once the iteration has ended."""

    def __init__(self, target: LoadedModel, req: Request) -> None:
        prepare(target, req.drafter)
        self._engine = Engine(target.model, target.tokenizer)
        self._req = req
        self._sid = submit(self._engine, req)
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Delta]:
        if self.result is not None:  # iterated already
            return
        try:
            while self._engine.has_work():
                for delta in self._engine.step():
                    if delta.token_ids or delta.text or delta.finished:
                        yield delta
        finally:
            if self._engine.has_work():  # the caller stopped early: free the sequence
                self._engine.cancel(self._sid)
            self.result = _finish(self._engine.result(self._sid), self._req)


def stream(target: LoadedModel, prompt: Prompt, **kwargs: Any) -> Stream:
    """Like `generate` (same keywords), but yields text as it is committed:

        for delta in specdec.stream(target, "Explain recursion.", drafter="prompt-lookup"):
            print(delta.text, end="", flush=True)

    No delta ever holds a stop string or text after it; the deltas' texts add up to the
    final text."""
    return Stream(target, _request_kw(target, prompt, kwargs))


def _request_kw(target: LoadedModel, prompt: Prompt, kwargs: dict[str, Any]) -> Request:
    kw = dict(kwargs)
    named = {
        n: kw.pop(n)
        for n in ("assistant_model", "drafter", "config", "sampling", "k", "chat", "prediction", "logprobs", "chooser")
        if n in kw
    }
    fields = {n: kw.pop(n) for n in list(kw) if n in _CONFIG_FIELDS | _SAMPLING_FIELDS}
    return request(target, prompt, drafter_options=kw, **named, **fields)


def generate_batch(
    target: LoadedModel, prompts: Sequence[Prompt], *, seed: int | Sequence[int] | None = None, **kwargs: Any
) -> list[GenerationResult]:
    """Several prompts decoded together (one target pass per step for all of them); same
    keywords as `generate`, with one drafter per prompt built from the drafter's name (or
    `assistant_model`). `seed`: one per prompt, or an int s (prompt i gets s + i). Each
    result is what that prompt gives alone with its seed (bitwise in the batch-invariant
    modes)."""
    if isinstance(kwargs.get("drafter"), Drafter) and len(prompts) > 1:
        raise ValueError("a drafter object serves one sequence; pass the drafter's name to generate_batch")
    if isinstance(seed, int) or seed is None:
        seeds: list[int | None] = [None if seed is None else seed + i for i in range(len(prompts))]
    else:
        seeds = list(seed)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    reqs = [_request_kw(target, p, kwargs | {"seed": s}) for p, s in zip(prompts, seeds, strict=True)]
    return run_requests(target, reqs)


def run_requests(target: LoadedModel, reqs: Sequence[Request], rules: Rules | None = None) -> list[GenerationResult]:
    """Decode requests together to the end. `rules`: the sampling rules the engine verifies
    with (`verify.EXACT`; only `specdec certify`'s control passes others)."""
    for r in reqs:
        prepare(target, r.drafter)
    engine = Engine(target.model, target.tokenizer, rules)
    sids = [submit(engine, r) for r in reqs]
    while engine.has_work():
        engine.step()
    return [_finish(engine.result(sid), r) for sid, r in zip(sids, reqs, strict=True)]


def _ratio(fast: GenerationResult, plain: GenerationResult) -> float:
    """Plain wall time / speculative wall time per generated token."""
    s, p = fast.metrics, plain.metrics
    return (p.wall_time / max(p.new_tokens, 1)) / (s.wall_time / max(s.new_tokens, 1))


@dataclass
class Comparison:
    speculative: GenerationResult  # the first speculative run
    plain: GenerationResult  # the first plain run
    greedy: bool
    # every (speculative, plain) pair, in the order they ran (`compare_requests`); empty: the one above
    pairs: list[tuple[GenerationResult, GenerationResult]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.pairs:
            self.pairs = [(self.speculative, self.plain)]

    @property
    def identical(self) -> bool | None:
        """Greedy only: does every speculative output equal plain decoding token for token?"""
        return all(f.token_ids == p.token_ids for f, p in self.pairs) if self.greedy else None

    @property
    def speedups(self) -> list[float]:
        """Each pair's plain / speculative time per generated token."""
        return [_ratio(f, p) for f, p in self.pairs]

    @property
    def speedup(self) -> float:
        """The median of the pairs' speedups (one pair: its own)."""
        return statistics.median(self.speedups)

    @property
    def band(self) -> tuple[float, float]:
        """The lowest and highest pair's speedup: where the median may lie on this machine now."""
        return min(self.speedups), max(self.speedups)

    def to_dict(self) -> dict[str, Any]:
        m = self.speculative.metrics
        return {
            "identical": self.identical,
            "speedup": self.speedup,
            "speedups": self.speedups,
            "speedup_band": list(self.band),
            "acceptance_rate": m.acceptance_rate,
            "mean_accepted_tokens": m.mean_accepted_tokens,
            "tokens_per_second": m.tokens_per_second,
            "plain_tokens_per_second": self.plain.metrics.tokens_per_second,
            "text": self.speculative.text,
            "finish_reason": self.speculative.finish_reason,
            "seed": self.speculative.seed,
            "speculative": self.speculative.to_dict(),
            "plain": self.plain.to_dict(),
        }


def compare(target: LoadedModel, prompt: Prompt, *, repeats: int = 1, **kwargs: Any) -> Comparison:
    """Run plain decoding and speculative decoding on the same prompt, side by side (same
    keywords as `generate`), `repeats` times in alternating order (`compare_requests`)."""
    return compare_requests(
        target, lambda: _request_kw(target, prompt, kwargs), kwargs.get("assistant_model"), repeats=repeats
    )


_COMPARISONS = itertools.count()  # (each comparison's repeat: a pool of its own)


def compare_requests(
    target: LoadedModel,
    make: Callable[[], Request],
    assistant_model: LoadedModel | None = None,
    on_delta: Callable[[Delta], None] | None = None,
    repeats: int = 1,
) -> Comparison:
    """Plain decoding of a speculative request's prompt with its settings, and the request
    itself (`make()` builds it afresh for each run: a drafter serves one sequence), `repeats`
    times in alternating order: plain then speculative, speculative then plain, ... (ABBA), so
    that a machine speeding up or slowing down during the runs favours neither side. What
    either side would time once per machine (the pass table, the draft's step) is timed
    before its clock starts (`run_request` calls `prepare`). Each repeat's speculative run
    drafts from a memory of its own (`memory.Memory`: a pool made for it and dropped after), so
    no repeat's speed comes from an earlier repeat's text or acceptance. The first speculative
    run's deltas go to `on_delta`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 (got {repeats})")
    first = make()
    if first.drafter is None:
        raise ValueError("compare needs an assistant_model or a drafter")
    # both sides draw from one seed, so a sampled comparison is like for like (every repeat too)
    seed = first.sampling.seed if first.sampling.seed is not None else int(torch.randint(2**62, (1,)))
    _warm_up(target, assistant_model)
    pairs: list[tuple[GenerationResult, GenerationResult]] = []
    pools = pools_of(target.model)
    for i in range(repeats):
        spec = first if i == 0 else make()
        spec.sampling = dataclasses.replace(spec.sampling, seed=seed)
        spec.drafter_pool = f"compare-{next(_COMPARISONS)}"
        plain_req = Request(spec.prompt_ids, spec.config, spec.sampling, None, None, logprobs=spec.logprobs)
        watch = on_delta if i == 0 else None
        if i % 2 == 0:
            plain = run_request(target, plain_req)
            fast = run_request(target, spec, watch)
        else:
            fast = run_request(target, spec, watch)
            plain = run_request(target, plain_req)
        pools.drop(spec.drafter_pool)
        pairs.append((fast, plain))
    return Comparison(pairs[0][0], pairs[0][1], greedy=first.sampling.greedy, pairs=pairs)


def prepare(target: LoadedModel, drafter: Drafter | None = None) -> None:
    """Time now what a first request would otherwise time inside itself, once per machine (then
    read from the specdec cache): the target's pass time for every row count a step can bring
    (`costs.pass_costs`), and the drafter's own step (a draft model's, a head's call). Nothing
    is generated, so no memory learns from it. Every request runs it before its clock starts
    (a lookup once the numbers are known); `specdec models install` runs it for the
    registered models."""
    from .costs import TABLE_ROWS, pass_costs

    pass_costs(target.model, TABLE_ROWS)
    prepare_drafter(drafter)


def _warm_up(*models: LoadedModel | None) -> None:
    """One short forward per model so first-call costs (allocation, kernel selection) are not
    billed to whichever method runs first."""
    for lm in models:
        if lm is not None:
            cache = lm.model.new_cache(8)
            lm.model(torch.zeros(1, 4, dtype=torch.long, device=lm.model.device), cache)
