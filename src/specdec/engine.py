"""The decode loops: plain autoregressive decoding (the reference every speedup is measured
against) and speculative decoding: prefill -> propose -> verify -> commit/rollback.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import GenerationConfig, SamplingParams
from .drafters.base import Draft, Drafter, DraftSession
from .metrics import Metrics, timer
from .model.cache import ContextOverflowError, KVCache
from .model.transformer import Transformer
from .sampling import make_generator, pick, probs
from .tokenizer import Tokenizer
from .verify import (
    greedy_verify,
    point_mass_sample,
    rejection_sample,
    tree_greedy_verify,
    tree_point_mass_sample,
)


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids (an end token that stopped generation included)
    text: str  # decoded text, stop string excluded
    finish_reason: str  # "eos" | "stop" | "length"
    seed: int  # the seed used (reproduce a sampled run with it)
    metrics: Metrics = field(default_factory=Metrics)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "seed": self.seed, "metrics": self.metrics.to_dict()}  # fmt: skip


class StopChecker:
    """Feeds on generated tokens one at a time; says when to stop and never lets a token past
    the stop through (the caller commits only what `push` accepted)."""

    def __init__(self, cfg: GenerationConfig, max_new_tokens: int, tokenizer: Tokenizer | None,
                 eos_ids: frozenset[int]) -> None:  # fmt: skip
        if cfg.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.stop = cfg.stop
        self.eos = frozenset() if cfg.ignore_eos else eos_ids
        self.limit = max_new_tokens
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stop_at: int | None = None  # character offset of a matched stop string

    def push(self, token: int) -> bool:
        """Append one token; True when generation is over (this token is the last)."""
        self.tokens.append(token)
        if token in self.eos:
            self.finish_reason = "eos"
        elif self.stop and self._stop_hit():
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.limit:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _stop_hit(self) -> bool:
        assert self.tokenizer is not None
        text = self.tokenizer.decode(self.tokens)
        # Only a stop string that ends inside the newest token's text is new.
        tail_from = len(self.tokenizer.decode(self.tokens[:-1])) - max(len(s) for s in self.stop)
        hits = [i for s in self.stop if (i := text.find(s, max(tail_from, 0))) >= 0]
        if hits:
            self.stop_at = min(hits)
        return bool(hits)

    def text(self) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens)
        return text[: self.stop_at] if self.stop_at is not None else text


def plan_length(prompt_len: int, cfg: GenerationConfig, context: int) -> int:
    """How many new tokens fit, per the context-overflow policy."""
    if prompt_len < 1:
        raise ValueError("the prompt is empty; give at least one token of input")
    if prompt_len >= context:
        raise ContextOverflowError(
            f"the prompt has {prompt_len} tokens but the model's context is {context}; shorten the prompt"
        )
    if prompt_len + cfg.max_new_tokens > context:
        if cfg.context_overflow == "error":
            raise ContextOverflowError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the model's "
                f"context of {context}; lower max_new_tokens or use context_overflow='truncate'"
            )
        return context - prompt_len
    return cfg.max_new_tokens


def _seed(sampling: SamplingParams) -> int:
    return sampling.seed if sampling.seed is not None else random.SystemRandom().randrange(2**63)


def _as_batch(prompt_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, T]


def plain_generate(
    target: Transformer,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    sampling: SamplingParams,
    tokenizer: Tokenizer | None = None,
) -> GenerationResult:
    """Reference decoder: one target forward per token."""
    seed = _seed(sampling)
    gen = make_generator(seed, target.device)
    n_new = plan_length(len(prompt_ids), cfg, target.args.max_seq_len)
    stopper = StopChecker(cfg, n_new, tokenizer, tokenizer.eos_ids if tokenizer else frozenset())
    m = Metrics(prompt_tokens=len(prompt_ids))
    t0 = time.perf_counter()
    cache = target.new_cache(len(prompt_ids) + n_new)
    with timer(target.device) as t:
        logits = target(_as_batch(prompt_ids, target.device), cache, last_only=True).logits[:, -1]  # [1, V]
    m.prefill_time = t[0]
    while True:
        token = int(pick(logits, sampling, gen))
        if stopper.push(token):
            break
        with timer(target.device) as t:
            logits = target(_as_batch([token], target.device), cache).logits[:, -1]
        m.target_forwards += 1
        m.target_time += t[0]
    m.wall_time = time.perf_counter() - t0
    m.new_tokens = len(stopper.tokens)
    return GenerationResult(stopper.tokens, stopper.text(), stopper.finish_reason or "length", seed, m)


def speculative_generate(
    target: Transformer,
    drafter: Drafter,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    sampling: SamplingParams,
    tokenizer: Tokenizer | None = None,
) -> GenerationResult:
    """Speculative decoding. Lossless: sampled output follows the target's distribution, and
    greedy output equals `plain_generate`'s token for token (guaranteed bitwise in
    batch-invariant modes such as int8; see `specdec.model.kernels`)."""
    seed = _seed(sampling)
    dev = target.device
    gen = make_generator(seed, dev)  # target sampling and verification
    n_new = plan_length(len(prompt_ids), cfg, target.args.max_seq_len)
    stopper = StopChecker(cfg, n_new, tokenizer, tokenizer.eos_ids if tokenizer else frozenset())
    m = Metrics(prompt_tokens=len(prompt_ids))
    forwards_before = drafter.forwards
    t0 = time.perf_counter()
    capacity = len(prompt_ids) + n_new  # chains never run past the token budget (k_eff below)
    # tree branches and extra rows need scratch slots beyond it (a drafter says how many)
    cache = target.new_cache(capacity + getattr(drafter, "scratch_rows", 0))

    # Prefill: the first token comes from the target alone, exactly as in plain decoding.
    with timer(dev) as t:
        logits = target(_as_batch(prompt_ids, dev), cache, last_only=True).logits[:, -1]
    m.prefill_time = t[0]
    last = int(pick(logits, sampling, gen))
    done = stopper.push(last)
    if not done:
        with timer(dev) as t:
            session = DraftSession(_as_batch(prompt_ids + [last], dev), capacity, sampling,
                                   make_generator(seed + 1, dev), target=target, target_cache=cache)  # fmt: skip
            drafter.begin(session)
        m.prefill_time += t[0]
        m.draft_time += t[0]
    while not done:
        k = min(cfg.k, stopper.limit - len(stopper.tokens) - 1)  # a step commits up to k + 1
        with timer(dev) as t:
            draft = drafter.propose(k)
        m.draft_time += t[0]
        if draft.depth() > k:
            raise RuntimeError(f"drafter {drafter.name!r} proposed {draft.depth()} tokens in a row, more than k={k}")
        start = cache.length
        with timer(dev) as t:
            logits, extra_logits = _target_pass(target, last, draft, cache)  # [1, K+1, V], [1, R, V] | None
            path, nxt = _verify(logits, draft, sampling, gen)
        m.target_forwards += 1
        m.target_time += t[0]
        m.scored_rows += logits.shape[1] + (0 if extra_logits is None else extra_logits.shape[1])
        n_acc = len(path)
        if draft.parents is None:
            cache.truncate(start + 1 + n_acc)  # keep `last` and the accepted drafts; drop the rest
        else:  # keep `last` and the accepted path's slots, moved to follow it
            cache.keep(start + 1, torch.tensor([start + 1 + j for j in path], dtype=torch.long, device=dev))
        m.record_step(draft.depth(), n_acc)  # a drafter may offer fewer than k
        accepted = draft.tokens[0].tolist()
        for token in [accepted[j] for j in path] + [nxt]:
            if done := stopper.push(token):
                break
        last = nxt
        if extra_logits is not None:
            drafter.scored_extra(extra_logits)  # type: ignore[attr-defined]
        if not done:
            if draft.parents is None:
                drafter.accepted(n_acc, nxt)
            else:
                drafter.accepted(n_acc, nxt, path=path)  # type: ignore[call-arg]
    m.draft_forwards = drafter.forwards - forwards_before
    m.drafter_info = dict(getattr(drafter, "info", {}))
    m.wall_time = time.perf_counter() - t0
    m.new_tokens = len(stopper.tokens)
    return GenerationResult(stopper.tokens, stopper.text(), stopper.finish_reason or "length", seed, m)


def _target_pass(target: Transformer, last: int, draft: Draft, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over the last committed token, the draft and any extra rows.
    Returns logits [1, K+1, V] (row 0 after `last`, row j+1 after draft node j) and the
    extra rows' logits [1, R, V] (None without extra rows)."""
    dev = target.device
    K = draft.tokens.shape[1]
    inputs = torch.cat([_as_batch([last], dev), draft.tokens], dim=1)  # [1, K+1]
    if draft.hidden is not None:
        # self-speculation: the drafter ran blocks [0, from_layer) for these rows already
        if draft.parents is not None or draft.extra is not None:
            raise ValueError("a draft with precomputed hidden states must be a plain chain")
        blocks = (draft.from_layer, target.args.n_layers)
        return target(inputs, cache, blocks=blocks, hidden_in=draft.hidden).logits, None
    if draft.parents is None and draft.extra is None:
        return target(inputs, cache).logits, None
    # token tree and/or extra rows: explicit positions and mask among the new rows
    parents = draft.parents if draft.parents is not None else list(range(-1, K - 1))
    if len(parents) != K:
        raise ValueError(f"the draft has {K} tokens but {len(parents)} parents")
    depth = [0, *draft.depths()]  # checks that parents come first
    R = 0 if draft.extra is None else draft.extra.tokens.shape[1]
    mask = torch.zeros(K + 1 + R, K + 1 + R, dtype=torch.bool)
    mask[0, 0] = True
    for j, par in enumerate(parents):
        mask[j + 1] = mask[par + 1]  # a node sees its parent's ancestors...
        mask[j + 1, j + 1] = True  # ...its parent and itself
    if draft.extra is not None:
        inputs = torch.cat([inputs, draft.extra.tokens], dim=1)
        mask[K + 1 :, 0] = True
        mask[K + 1 :, K + 1 :] = draft.extra.mask
        depth += draft.extra.offsets.tolist()
    positions = (cache.length + torch.tensor(depth, dtype=torch.long, device=dev))[None]  # [1, K+1+R]
    logits = target(inputs, cache, positions, tree_mask=mask.to(dev)).logits
    return logits[:, : K + 1], (logits[:, K + 1 :] if R else None)


def _verify(logits: torch.Tensor, draft: Draft, sampling: SamplingParams, gen: torch.Generator) -> tuple[list[int], int]:
    """The accepted draft nodes (a chain's first n, or a tree path) and the next token."""
    if draft.parents is not None:
        tokens = draft.tokens[0].tolist()
        if sampling.greedy:
            tv = tree_greedy_verify(logits[0], tokens, draft.parents)
        elif draft.probs is None:
            tv = tree_point_mass_sample(probs(logits, sampling)[0], tokens, draft.parents, gen)
        else:
            raise NotImplementedError("token trees are verified for deterministic drafts (probs=None) only")
        return tv.path, tv.next_token
    if sampling.greedy:
        verdict = greedy_verify(logits, draft.tokens)
    elif draft.probs is None:  # deterministic drafter: q is a point mass on each draft
        verdict = point_mass_sample(probs(logits, sampling), draft.tokens, gen)
    else:
        verdict = rejection_sample(probs(logits, sampling), draft.probs, draft.tokens, gen)
    return list(range(int(verdict.num_accepted[0]))), int(verdict.next_token[0])
