"""The decode engine: a stepper over a set of live sequences.

    engine = Engine(target, tokenizer)
    sid = engine.add(prompt_ids, cfg, sampling, drafter)   # any number, any time
    while engine.has_work():
        for delta in engine.step():                         # tokens and text committed this step
            print(delta.text, end="")
    result = engine.result(sid)

One `step` is: propose (every sequence's drafter; drafters of one draft model together) ->
one target pass over every live sequence's rows (a new sequence's prompt, or its last
committed token and its draft) -> verify each sequence with its own generator -> commit or
roll back. Plain decoding is the same loop for a sequence without a drafter (k = 0).
Sequences join and leave between steps; each has its own KV cache, freed when it ends. Each
step's k is the drafter's plan (`Drafter.plan`, told the rest of the batch's load): with
`adaptive_k` (the default) the drafter's schedule, the chooser of `--drafter auto` over that one
drafter (`specdec.adaptive.Schedule`, made by `Drafter.start`): its offer against a plain step
(0 = a plain step where drafting is not predicted to beat plain decoding). Drafters with
`own_schedule` — auto, early exit's calibration — decide for themselves. The engine holds no
controller of its own.

Lossless: sampled output follows the target's distribution, and greedy output equals plain
decoding token for token — bitwise in the batch-invariant modes (q4k, int8), where a
sequence computes exactly the same alone or in any batch (see `specdec.model.kernels`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import GenerationConfig, SamplingParams
from .costs import Costs, Pricing, observe_pass
from .drafters.base import Draft, Drafter, DraftSession, Feedback, Switchable
from .memory import Pools, pools_of
from .metrics import Metrics, timer
from .model.cache import ContextOverflowError, KVCache
from .model.prefix import PrefixStore
from .model.transformer import ForwardOutput, Segment, Transformer
from .runtime import per_model
from .sampling import make_generator, pick, probs
from .stops import StopChecker
from .tokenizer import Tokenizer
from .verify import EXACT, Rules, greedy_verify, lossy_typical_acceptance, tree_greedy_verify

# the most alternatives a token's logprobs list (OpenAI's top_logprobs limit)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of a committed token, and of the most likely tokens in its
    place: log-softmax of the target's raw logits (the model's distribution, before temperature,
    top-k or top-p), computed from the same rows verification read. Those rows are what plain
    decoding computes for the token, so speculation returns plain decoding's numbers."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's logprob under the row of `logits` ([N, V], row i the distribution token i
    was picked from) and, with `top` > 0, that many alternatives."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if top <= 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen, strict=True)]
    vals, ids = lp.topk(top, dim=-1)
    return [
        TokenLogprob(t, c, tuple(zip(i, v, strict=True)))
        for t, c, i, v in zip(tokens, chosen, ids.tolist(), vals.tolist(), strict=True)
    ]


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids (an end token that stopped generation included)
    text: str  # decoded text, stop string excluded
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled"
    seed: int  # the seed used (reproduce a sampled run with it)
    metrics: Metrics = field(default_factory=Metrics)
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, where asked for

    def to_dict(self) -> dict[str, Any]:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "metrics": self.metrics.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        return out


@dataclass(frozen=True)
class Step:
    """What one verification pass did for a sequence: its pass number (the sequence's own, from
    1 after the prefill), the draft tokens it verified (in a row: a tree's depth), how many of
    them it accepted, and who drafted them (`Drafter.proposer`: a method, auto's member; None
    where nothing was proposed). The delta's tokens are the accepted drafts, then the target's
    own token (unless a stop ended the text inside the drafts)."""

    index: int
    proposed: int
    accepted: int
    by: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"pass": self.index, "proposed": self.proposed, "accepted": self.accepted, "by": self.by}


@dataclass
class Delta:
    """What one step committed for one sequence."""

    seq_id: int
    token_ids: list[int]  # tokens committed in this step (none past a stop)
    text: str  # text they completed (never a stop string or text after it)
    finish_reason: str | None = None  # set on the sequence's last delta
    prefilled: int | None = None  # while the prompt is read in chunks: its tokens read so far (no tokens yet)
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, where the request asked
    step: Step | None = None  # the pass that committed them (None: the prefill's first token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def plan_length(
    prompt_len: int,
    cfg: GenerationConfig,
    context: int,
    *,
    length_name: str = "max_new_tokens",
    fix: str = "lower max_new_tokens or let the output stop at the context end (--context-overflow "
    "truncate; API: context_overflow='truncate')",
) -> int:
    """How many new tokens fit, per the context-overflow policy. `length_name`, `fix`: how the
    caller's interface spells the length and the remedy (the server's is OpenAI's max_tokens)."""
    if prompt_len < 1:
        raise ValueError("the prompt is empty; give at least one token of input")
    if prompt_len >= context:
        raise ContextOverflowError(
            f"the prompt has {prompt_len} tokens but the model's context is {context}; shorten the prompt"
        )
    if prompt_len + cfg.max_new_tokens > context:
        if cfg.context_overflow == "error":
            raise ContextOverflowError(
                f"prompt ({prompt_len} tokens) + {length_name} ({cfg.max_new_tokens}) exceeds the model's "
                f"context of {context}; {fix}"
            )
        return context - prompt_len
    return cfg.max_new_tokens


# The most prompt rows one sequence brings to a step. A long prompt is read over several steps,
# so a front end can show its progress, Ctrl-C acts between chunks, and the other sequences of
# a batch keep decoding meanwhile. A row's result depends on its own prefix only (bitwise, in
# the batch-invariant modes), so the chunks compute what one pass over the prompt computes.
PREFILL_CHUNK = 512


@dataclass
class _Sequence:
    """One request's state in the engine."""

    id: int
    prompt: list[int]
    cfg: GenerationConfig
    sampling: SamplingParams
    seed: int
    gen: torch.Generator  # the target's sampling and verification draws
    drafter: Drafter | None
    stopper: StopChecker
    cache: KVCache | None
    metrics: Metrics
    started: float
    last: int | None = None  # last committed token, not yet in the cache (None: not prefilled)
    prefilled: int = 0  # prompt tokens in the cache (the prompt is read PREFILL_CHUNK rows per step)
    forwards_before: int = 0  # the drafter's forward count at begin
    k_now: int = 0  # this step's k (planned once per step)
    # draft rows it sends per pass when drafting is on (an average of recent steps; None: none
    # yet): what a batch of it costs, whatever k allowed (a tree drafter sizes its own)
    draft_rows: float | None = None
    draft_ms: float = 0.0  # this step's drafting time (ms)
    pricing: Pricing | None = None  # what its choices are priced by (the engine's, per sequence)
    pool: str = ""  # whose earlier sequences' cached rows it may reuse (a server's API key)
    drafter_pool: str = ""  # whose earlier outputs its drafter may draft from (`DraftSession.pool`)
    chooser: Any = None  # what picks its drafter's steps (`DraftSession.chooser`; None: the default)
    prediction: list[int] | None = None  # the output the client expects (`DraftSession.prediction`)
    top_logprobs: int | None = None  # None: no logprobs; else each token's, with this many alternatives
    final: Feedback | None = None  # the pass that finished it (what its drafter's `end` is told)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def k(self) -> int:
        """Draft tokens at most: a step commits up to k + 1 tokens, never past the budget."""
        if self.drafter is None:
            return 0
        return max(0, min(self.cfg.k, self.stopper.limit - len(self.stopper.tokens) - 1))

    def plan_k(self, others: tuple[float, float] = (0, 0.0)) -> int:
        """This step's k: the drafter's plan within the budget's (`Drafter.plan`: its schedule's
        choice, 0 a plain step). `others`: (rows, expected tokens) the rest of the batch brings
        to the pass."""
        k = self.k()
        if k > 0 and self.drafter is not None:
            k = self.drafter.plan(k, self.stopper.limit - len(self.stopper.tokens), others)
        return k


PREFIXES = per_model(memory=True)  # each model's store of finished sequences' rows (`model.prefix`)


def prefix_store(model: Transformer, max_tokens: int) -> PrefixStore:
    """The model's store of finished sequences' rows, made on first use; its bound is the largest
    asked for."""
    store = PREFIXES.of(model, lambda: PrefixStore(max_tokens))
    store.max_tokens = max(store.max_tokens, max_tokens)
    return store


def _leaders(seqs: list[_Sequence]) -> Callable[[_Sequence], _Sequence]:
    """Sequences starting in this step with the same prompt share one prefill: the first (its
    leader) computes it, the others copy its cache slots and its output. A row of a pass depends
    on its own prefix only, so that is what their own prefill computes (bitwise in the
    batch-invariant modes). Returns each sequence's leader (itself, where it leads or decodes)."""
    first: dict[tuple[Any, ...], _Sequence] = {}
    leader = {s.id: first.setdefault((s.prefilled, *s.prompt), s) for s in seqs if s.last is None}
    return lambda s: leader.get(s.id, s)


def _copy_shared_prefills(seqs: list[_Sequence], lead: Callable[[_Sequence], _Sequence]) -> None:
    """Followers take their leader's prefilled rows (before any sequence finishes and frees its cache)."""
    for s in seqs:
        if lead(s) is not s:
            leader = lead(s)
            assert s.cache is not None and leader.cache is not None
            # (it holds the leader's earlier chunks already: copied when they were read)
            s.cache.copy_prefix(leader.cache, leader.prefilled, start=s.prefilled)
            s.prefilled = leader.prefilled


class Engine:
    """Steps any number of sequences together over one target model (see the module doc)."""

    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer | None = None,
        rules: Rules | None = None,
        prefix_tokens: int = 0,
        pass_tables: Callable[[Transformer, int], Costs] | None = None,
        pools: Pools | None = None,
        history: dict[str, Any] | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(
                f"prefill_chunk is the most prompt rows a sequence reads per step; give >= 1 (got {prefill_chunk})"
            )
        self.target = target
        self.prefill_chunk = prefill_chunk  # the most prompt rows a sequence brings to one step
        # what earlier requests taught, per pool, handed to each sequence's drafter
        # (`memory.Memory`): the given pools, else the target's for the life of the process
        self.pools = pools if pools is not None else pools_of(target)
        self.tokenizer = tokenizer
        # the sampling rules it verifies with: `verify.EXACT` (certify's control hands it broken ones)
        self.rules = rules if rules is not None else EXACT
        # what its sequences' choices are priced by (`costs.Pricing`): this machine's measured
        # pass tables, or the ones given (tests)
        self.pass_tables = pass_tables
        # what its sequences' members measured before on this machine (`costs.Pricing.past`):
        # the given dict standing for the cache's table (tests), else the cache's
        self.history = history
        # finished sequences' rows, up to `prefix_tokens`, copied by later prompts that begin the
        # same way (`model.prefix`): only where a copied row is bitwise what a prefill computes
        self.prefixes = prefix_store(target, prefix_tokens) if prefix_tokens > 0 and target.rows_bitwise else None
        self._live: dict[int, _Sequence] = {}
        self._done: dict[int, GenerationResult] = {}
        self._next_id = 0

    # -- sequences ---------------------------------------------------------------------------
    def add(
        self,
        prompt_ids: list[int],
        cfg: GenerationConfig,
        sampling: SamplingParams,
        drafter: Drafter | None = None,
        pool: str = "",
        *,
        prediction: list[int] | None = None,
        logprobs: int | None = None,
        drafter_pool: str | None = None,
        chooser: Callable[[float], Any] | None = None,
    ) -> int:
        """Queue a sequence (prefilled in the next step); returns its id. `pool`: whose earlier
        sequences' cached rows it may start from (with the engine's `prefix_tokens`), and whose
        earlier outputs its drafter may draft from, unless `drafter_pool` names another (a
        benchmark keeps each method's memory apart but shares cached rows).
        `prediction`: the output expected, as token ids (drafted from by a drafter that reads it:
        `prediction`, auto). `logprobs`: return each committed token's logprob with this many
        alternatives (0..MAX_TOP_LOGPROBS; None: none). `chooser`: what picks its drafter's steps
        (`DraftSession.chooser`; None: `adaptive.Chooser`)."""
        n_new = plan_length(len(prompt_ids), cfg, self.target.args.max_seq_len)
        if logprobs is not None and (
            isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(
                f"logprobs is the number of alternatives per token, 0..{MAX_TOP_LOGPROBS} (got {logprobs!r})"
            )
        if prediction is not None:
            vocab = self.target.args.vocab_size
            if any(not 0 <= t < vocab for t in prediction):
                raise ValueError(f"prediction token ids must lie in [0, {vocab})")
        if drafter is not None and any(s.drafter is drafter for s in self._live.values()):
            raise ValueError("this drafter object already serves a live sequence; give each sequence its own drafter")
        seed = sampling.seed if sampling.seed is not None else random.SystemRandom().randrange(2**63 - 1)
        eos = self.tokenizer.eos_ids if self.tokenizer is not None else frozenset()
        scratch = drafter.scratch_rows if drafter is not None else 0
        drafter_pool = pool if drafter_pool is None else drafter_pool
        pricing = Pricing.of(self.target, sampling, self.pass_tables, self.history)
        sid = self._next_id
        self._next_id += 1
        self._live[sid] = _Sequence(
            sid,
            list(prompt_ids),
            cfg,
            sampling,
            seed,
            make_generator(seed, self.target.device),
            drafter,
            StopChecker(cfg, n_new, self.tokenizer, eos),
            self.target.new_cache(len(prompt_ids) + n_new + scratch),
            Metrics(
                prompt_tokens=len(prompt_ids),
                k=cfg.k if drafter is not None else None,
                exact=sampling.exact or drafter is None,
            ),
            time.perf_counter(),
            pricing=pricing,
            pool=pool,
            drafter_pool=drafter_pool,
            chooser=chooser,
            prediction=list(prediction) if prediction else None,
            top_logprobs=logprobs,
        )
        if self.prefixes is not None:
            # (the prompt's last row is computed in any case: it gives the first token)
            hit = self.prefixes.longest(pool, prompt_ids[:-1])
            if hit is not None:
                seq = self._live[sid]
                seq.cache.copy_prefix(*hit)  # type: ignore[union-attr]
                seq.prefilled = seq.metrics.cached_tokens = hit[1]
        return sid

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence between steps; its cache is freed and its result kept ("cancelled")."""
        seq = self._live.get(seq_id)
        if seq is None:
            raise KeyError(f"no live sequence {seq_id}")
        seq.stopper.finish_reason = "cancelled"
        self._finish(seq)

    def has_work(self) -> bool:
        return bool(self._live)

    def live(self) -> list[int]:
        return list(self._live)

    def draft_rows(self, seq_id: int) -> float | None:
        """Draft rows the live sequence has sent per pass of late when drafting was on (None:
        it has not drafted yet)."""
        return self._live[seq_id].draft_rows

    def result(self, seq_id: int) -> GenerationResult:
        """The finished sequence's result (removed from the engine)."""
        if seq_id in self._live:
            raise ValueError(f"sequence {seq_id} is still running")
        return self._done.pop(seq_id)

    # -- the step ----------------------------------------------------------------------------
    def step(self, drafting: bool = True) -> list[Delta]:
        """One propose -> target pass -> verify -> commit over every live sequence.
        `drafting=False`: a plain step for every sequence (a server turns drafting off where a
        large batch leaves no room for it; exactness is unchanged, as with any k = 0 step)."""
        seqs = list(self._live.values())
        if not seqs:
            return []
        self._plan_ks(seqs, drafting)
        drafts = self._propose([s for s in seqs if s.last is not None])
        lead = _leaders(seqs)
        run = [s for s in seqs if lead(s) is s]
        outs, seconds, rows = self._pass(run, drafts, seqs)
        _copy_shared_prefills(seqs, lead)
        deltas = []
        for s in seqs:
            out = outs[lead(s).id]
            if s.last is None:
                delta = self._after_prefill(s, out, seconds)
            else:
                delta = self._after_decode(s, drafts.get(s.id), out, seconds, rows, drafting)
            deltas.append(delta)
            if delta.finished:
                self._finish(s)
        return deltas

    def _plan_ks(self, seqs: list[_Sequence], drafting: bool) -> None:
        """This step's k for each sequence, priced at what its rows add to the batch's pass."""
        load = {s.id: _load(s, self.prefill_chunk) for s in seqs}  # (rows, expected tokens) each brings to the pass
        total = (sum(r for r, _ in load.values()), sum(t for _, t in load.values()))
        for s in seqs:
            # a seeded sampled request's k must not depend on what else is in the batch
            others = (
                (0, 0.0)
                if len(seqs) == 1 or s.pricing.reproducible
                else (total[0] - load[s.id][0], total[1] - load[s.id][1])
            )
            s.k_now = s.plan_k(others) if s.last is not None and drafting else 0
            s.draft_ms = 0.0

    def _pass(
        self, run: list[_Sequence], drafts: dict[int, Draft], seqs: list[_Sequence]
    ) -> tuple[dict[int, ForwardOutput], float, int]:
        """The target's one pass over the rows of `run` (prompt chunks, drafts): each one's
        output by its id, the pass's seconds and rows. A pass of decode rows alone, through
        every layer, is what the online cost estimate follows."""
        segments = [self._segment(s, drafts.get(s.id)) for s in run]
        with timer(self.target.device) as t:
            outs = self.target.forward_batch(
                segments,
                return_hidden=any(s.drafter is not None and s.drafter.wants_hidden for s in seqs),
                output_layers=tuple(
                    sorted({i for s in seqs if s.drafter is not None for i in s.drafter.feature_layers})
                ),
            )
        rows = sum(int(seg.tokens.shape[0]) for seg in segments)
        if all(s.last is not None for s in seqs) and all(seg.lo == 0 for seg in segments):
            observe_pass(self.target, rows, 1e3 * t[0])
        for s in run:
            if s.last is None:
                s.prefilled = s.cache.length  # type: ignore[union-attr]
        return {s.id: out for s, out in zip(run, outs, strict=True)}, t[0], rows

    def _after_prefill(self, s: _Sequence, out: ForwardOutput, seconds: float) -> Delta:
        """A sequence that read (a chunk of) its prompt in this pass: more to read, or its first token."""
        s.metrics.prefill_time += seconds
        if s.prefilled < len(s.prompt):  # more of the prompt to read
            return Delta(s.id, [], "", prefilled=s.prefilled)
        return self._first_token(s, out)

    def _after_decode(
        self, s: _Sequence, draft: Draft | None, out: ForwardOutput, seconds: float, rows: int, drafting: bool
    ) -> Delta:
        """A decoding sequence: its draft verified and committed, the pass counted."""
        s.metrics.target_forwards += 1
        s.metrics.target_time += seconds
        s.metrics.record_pass(rows, 1e3 * seconds)
        delta = self._commit(s, draft or Draft.empty(), out, 1e3 * seconds)
        if drafting and s.drafter is not None:
            n = float(draft.tokens.shape[0]) if draft is not None else 0.0
            s.draft_rows = n if s.draft_rows is None else 0.7 * s.draft_rows + 0.3 * n
        return delta

    def _propose(self, seqs: list[_Sequence]) -> dict[int, Draft]:
        """Every drafting sequence's proposal; drafters that share a batch key draft together."""
        groups: dict[Any, list[_Sequence]] = {}
        for s in seqs:
            if s.drafter is not None and s.k_now > 0:
                key = s.drafter.batch_key()
                groups.setdefault(key if key is not None else ("alone", s.id), []).append(s)
        drafts: dict[int, Draft] = {}
        for s in seqs:
            if isinstance(s.drafter, Switchable) and s.k_now > 0:
                with timer(self.target.device) as t:
                    s.drafter.sync()  # catching up is timed apart: its offer carried it separately
                s.metrics.draft_time += t[0]
        for group in groups.values():
            with timer(self.target.device) as t:
                ks = [s.k_now for s in group]
                out = type(group[0].drafter).propose_batch([s.drafter for s in group], ks)  # type: ignore[arg-type]
            for s, k, draft in zip(group, ks, out, strict=True):
                s.metrics.draft_time += t[0] / len(group)
                s.draft_ms = 1e3 * t[0] / len(group)
                if draft.depth() > k:
                    raise RuntimeError(
                        f"drafter {s.drafter.name!r} proposed {draft.depth()} tokens in a row, more than k={k}"
                    )  # type: ignore[union-attr]
                drafts[s.id] = draft
        return drafts

    def _segment(self, s: _Sequence, draft: Draft | None) -> Segment:
        """The rows a sequence brings to the target pass: its prompt (prefill), or its last
        committed token followed by the draft's nodes and extra rows."""
        dev = self.target.device
        assert s.cache is not None
        if s.last is None:
            chunk = s.prompt[s.prefilled : s.prefilled + self.prefill_chunk]
            return Segment(torch.tensor(chunk, dtype=torch.long, device=dev), s.cache, last_only=True)
        last = torch.tensor([s.last], dtype=torch.long, device=dev)
        if draft is None or (draft.tokens.numel() == 0 and draft.extra is None):
            return Segment(last, s.cache)
        tokens = torch.cat([last, draft.tokens])  # [K+1]
        K = draft.tokens.shape[0]
        if draft.hidden is not None:
            # self-speculation: the drafter ran blocks [0, from_layer) for these rows already
            if draft.parents is not None or draft.extra is not None:
                raise ValueError("a draft with precomputed hidden states must be a plain chain")
            return Segment(tokens, s.cache, hidden_in=draft.hidden, lo=draft.from_layer)
        if draft.parents is None and draft.extra is None:
            return Segment(tokens, s.cache)
        # token tree and/or extra rows: explicit positions and mask among the new rows
        parents = draft.parents if draft.parents is not None else list(range(-1, K - 1))
        if len(parents) != K:
            raise ValueError(f"the draft has {K} tokens but {len(parents)} parents")
        depth = [0, *draft.depths()]  # checks that parents come first
        R = 0 if draft.extra is None else draft.extra.tokens.shape[0]
        mask = torch.zeros(K + 1 + R, K + 1 + R, dtype=torch.bool)
        mask[0, 0] = True
        for j, par in enumerate(parents):
            mask[j + 1] = mask[par + 1]  # a node sees its parent's ancestors...
            mask[j + 1, j + 1] = True  # ...its parent and itself
        if draft.extra is not None:
            tokens = torch.cat([tokens, draft.extra.tokens])
            mask[K + 1 :, 0] = True
            mask[K + 1 :, K + 1 :] = draft.extra.mask
            depth += draft.extra.offsets.tolist()
        positions = s.cache.length + torch.tensor(depth, dtype=torch.long, device=dev)
        return Segment(tokens, s.cache, positions, tree_mask=mask.to(dev))

    def _first_token(self, s: _Sequence, out: ForwardOutput) -> Delta:
        """After the prefill: the target's first token, exactly as in plain decoding; then the
        drafter begins on the committed tokens."""
        s.last = int(pick(out.logits[:, -1], s.sampling, s.gen))
        if s.top_logprobs is not None:
            s.logprobs += token_logprobs(out.logits[:, -1], [s.last], s.top_logprobs)
        done = s.stopper.push(s.last)
        if not done and s.drafter is not None:
            with timer(self.target.device) as t:
                s.forwards_before = s.drafter.forwards
                layers = {i: out.layers[i][0] for i in s.drafter.feature_layers}
                s.drafter.start(
                    DraftSession(
                        s.prompt + [s.last],
                        len(s.prompt) + s.stopper.limit,
                        s.sampling,
                        make_generator(s.seed + 1, self.target.device),
                        self.target,
                        s.cache,
                        layers,
                        fixed_k=not s.cfg.adaptive_k,
                        k=s.cfg.k,
                        prediction=s.prediction,
                        pool=s.drafter_pool,
                        memory=self.pools.of(s.drafter_pool),
                        pricing=s.pricing,
                        chooser=s.chooser,
                    )
                )
            s.metrics.prefill_time += t[0]
            s.metrics.draft_time += t[0]
        return self._delta(s, [s.last])

    def _commit(self, s: _Sequence, draft: Draft, out: ForwardOutput, pass_ms: float | None = None) -> Delta:
        """Verify the sequence's rows, keep the accepted path in its cache, tell the drafter."""
        assert s.cache is not None
        K = draft.tokens.shape[0]
        by = s.drafter.proposer() if s.drafter is not None and draft.depth() else None  # (before it is told)
        logits = out.logits[0]  # [K+1+R, V]
        path, nxt = _verify(logits[: K + 1], draft, s.sampling, s.gen, self.rules)
        start = s.cache.length - logits.shape[0]  # slot of the last committed token
        if draft.parents is None and draft.extra is None:
            s.cache.truncate(start + 1 + len(path))  # keep `last` and the accepted drafts; drop the rest
        else:  # keep `last` and the accepted path's slots, moved to follow it
            s.cache.keep(
                start + 1, torch.tensor([start + 1 + j for j in path], dtype=torch.long, device=s.cache.pos.device)
            )
        m = s.metrics
        m.scored_rows += logits.shape[0]
        if s.drafter is not None:
            m.record_step(draft.depth(), len(path))  # a drafter may offer fewer than k
        if s.drafter is not None:
            s.drafter.verified(draft.depth(), len(path), s.draft_ms, logits.shape[0], pass_ms)
        committed = []
        tokens = draft.tokens.tolist()
        for token in [tokens[j] for j in path] + [nxt]:
            committed.append(token)
            if s.stopper.push(token):
                break
        s.last = nxt
        if s.top_logprobs is not None:  # (token i was picked from the row after the path's first i nodes)
            rows = [0] + [j + 1 for j in path]
            s.logprobs += token_logprobs(logits[rows[: len(committed)]], committed, s.top_logprobs)
        if s.drafter is not None and not s.stopper.finish_reason:
            s.drafter.accepted(
                Feedback(
                    path,
                    nxt,
                    logits[: K + 1],
                    logits[K + 1 :] if draft.extra is not None else None,
                    out.hidden[0] if out.hidden is not None else None,
                    {i: h[0] for i, h in out.layers.items()},
                    pass_ms=pass_ms,
                )
            )
        elif s.drafter is not None:
            s.final = Feedback(path, nxt, logits[: K + 1], kept=min(len(path), len(committed)))
        return self._delta(s, committed, Step(m.target_forwards, draft.depth(), len(path), by))

    def _delta(self, s: _Sequence, tokens: list[int], step: Step | None = None) -> Delta:
        lps = s.logprobs[len(s.logprobs) - len(tokens) :] if s.top_logprobs is not None else None
        return Delta(s.id, tokens, s.stopper.take_text(), s.stopper.finish_reason, logprobs=lps, step=step)

    def _finish(self, s: _Sequence) -> None:
        m = s.metrics
        if s.drafter is not None:
            s.drafter.finish(s.final)  # (a drafter may complete its report there)
            m.draft_forwards = s.drafter.forwards - s.forwards_before
            m.drafter_info = dict(s.drafter.info)
        m.wall_time = time.perf_counter() - s.started
        m.new_tokens = len(s.stopper.tokens)
        if self.prefixes is not None and s.cache is not None:
            # the committed tokens whose rows the cache holds (the newest token has none yet)
            tokens = s.prompt + s.stopper.tokens
            self.prefixes.put(s.pool, tokens[: min(s.cache.length, len(tokens))], s.cache)
        s.cache = None  # free the KV cache
        del self._live[s.id]
        reason = s.stopper.finish_reason or "length"
        self._done[s.id] = GenerationResult(
            s.stopper.tokens,
            s.stopper.text(),
            reason,
            s.seed,
            m,
            s.logprobs[: len(s.stopper.tokens)] if s.top_logprobs is not None else None,
        )


def _load(s: _Sequence, chunk: int) -> tuple[float, float]:
    """(rows, expected tokens) a sequence brings to a pass, as of late: a prompt chunk (no
    token until its last), or its last token and the draft rows it has sent lately, committing
    its measured tokens per pass."""
    if s.last is None:
        rest = len(s.prompt) - s.prefilled
        return float(min(rest, chunk)), 1.0 if rest <= chunk else 0.0
    return 1.0 + (s.draft_rows or 0.0), s.metrics.mean_accepted_tokens or 1.0


def _verify(
    logits: torch.Tensor, draft: Draft, sampling: SamplingParams, gen: torch.Generator, rules: Rules
) -> tuple[list[int], int]:
    """The accepted draft nodes (a chain's first n, or a tree path) and the next token.
    logits: [K+1, V]."""
    K = draft.tokens.shape[0]
    if K == 0:  # nothing drafted: the target's own token, as plain decoding picks it
        return [], int(pick(logits[:1], sampling, gen))
    tokens = draft.tokens.tolist()
    if not sampling.exact:  # asked for explicitly, flagged in the metrics: NOT the target's distribution
        tv = lossy_typical_acceptance(
            probs(logits, sampling), tokens, draft.parents, sampling.epsilon, sampling.delta, gen
        )
        return tv.path, tv.next_token
    if draft.parents is not None:
        if sampling.greedy:
            tv = tree_greedy_verify(logits, tokens, draft.parents)
        elif draft.attempts is not None:  # drawn and deterministic drafts in one tree
            q = draft.probs if draft.probs is not None else torch.zeros(K, logits.shape[-1], device=logits.device)
            tv = rules.tree_mixed(probs(logits, sampling), q, tokens, draft.parents, draft.attempts, gen)
        elif draft.probs is None:
            tv = rules.tree_point_mass(probs(logits, sampling), tokens, draft.parents, gen)
        else:  # siblings drawn from q without replacement
            tv = rules.tree_rejection(probs(logits, sampling), draft.probs, tokens, draft.parents, gen)
        return tv.path, tv.next_token
    if sampling.greedy:
        verdict = greedy_verify(logits[None], draft.tokens[None])
    elif draft.probs is None:  # deterministic drafter: q is a point mass on each draft
        verdict = rules.point_mass(probs(logits[None], sampling), draft.tokens[None], gen)
    else:
        verdict = rules.rejection(probs(logits[None], sampling), draft.probs[None], draft.tokens[None], gen)
    return list(range(int(verdict.num_accepted[0]))), int(verdict.next_token[0])


def run(
    target: Transformer,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    sampling: SamplingParams,
    drafter: Drafter | None = None,
    tokenizer: Tokenizer | None = None,
    rules: Rules | None = None,
    prediction: list[int] | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
) -> GenerationResult:
    """One sequence, to the end: plain decoding without a drafter, speculative with one."""
    engine = Engine(target, tokenizer, rules, prefill_chunk=prefill_chunk)
    sid = engine.add(prompt_ids, cfg, sampling, drafter, prediction=prediction)
    while engine.has_work():
        engine.step()
    return engine.result(sid)
