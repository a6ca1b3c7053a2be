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
from .drafters.base import Drafter, DraftSession
from .metrics import Metrics, timer
from .model.cache import ContextOverflowError
from .model.transformer import Transformer
from .sampling import make_generator, pick, probs
from .tokenizer import Tokenizer
from .verify import greedy_verify, point_mass_sample, rejection_sample


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
    capacity = len(prompt_ids) + n_new  # drafts never run past the token budget (k_eff below)
    cache = target.new_cache(capacity)

    # Prefill: the first token comes from the target alone, exactly as in plain decoding.
    with timer(dev) as t:
        logits = target(_as_batch(prompt_ids, dev), cache, last_only=True).logits[:, -1]
    m.prefill_time = t[0]
    last = int(pick(logits, sampling, gen))
    done = stopper.push(last)
    if not done:
        with timer(dev) as t:
            session = DraftSession(_as_batch(prompt_ids + [last], dev), capacity, sampling,
                                   make_generator(seed + 1, dev))  # fmt: skip
            drafter.begin(session)
        m.prefill_time += t[0]
        m.draft_time += t[0]
    while not done:
        k = min(cfg.k, stopper.limit - len(stopper.tokens) - 1)  # a step commits up to k + 1
        with timer(dev) as t:
            draft = drafter.propose(k)
        m.draft_time += t[0]
        if draft.tokens.shape[1] > k:
            raise RuntimeError(f"drafter {drafter.name!r} proposed {draft.tokens.shape[1]} tokens, more than k={k}")
        start = cache.length
        with timer(dev) as t:
            inputs = torch.cat([_as_batch([last], dev), draft.tokens], dim=1)  # [1, K+1]
            target_logits = target(inputs, cache).logits  # [1, K+1, V]
            if sampling.greedy:
                verdict = greedy_verify(target_logits, draft.tokens)
            elif draft.probs is None:  # deterministic drafter: q is a point mass on each draft
                verdict = point_mass_sample(probs(target_logits, sampling), draft.tokens, gen)
            else:
                verdict = rejection_sample(probs(target_logits, sampling), draft.probs, draft.tokens, gen)
            n_acc, nxt = int(verdict.num_accepted[0]), int(verdict.next_token[0])
        m.target_forwards += 1
        m.target_time += t[0]
        cache.truncate(start + 1 + n_acc)  # keep `last` and the accepted drafts; drop the rest
        m.record_step(draft.tokens.shape[1], n_acc)  # a drafter may offer fewer than k
        for token in draft.tokens[0, :n_acc].tolist() + [nxt]:
            if done := stopper.push(token):
                break
        last = nxt
        if not done:
            drafter.accepted(n_acc, nxt)
    m.draft_forwards = drafter.forwards - forwards_before
    m.wall_time = time.perf_counter() - t0
    m.new_tokens = len(stopper.tokens)
    return GenerationResult(stopper.tokens, stopper.text(), stopper.finish_reason or "length", seed, m)
