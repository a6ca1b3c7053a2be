"""Python API, shaped like Hugging Face's ``generate(..., assistant_model=draft)``.

    >>> import specdec
    >>> target = specdec.load("qwen2.5-coder-1.5b")
    >>> draft = specdec.load("qwen2.5-coder-0.5b")
    >>> out = specdec.generate(target, "Write a Python function that reverses a list.",
    ...                        assistant_model=draft, k=4, max_new_tokens=64)
    >>> out.text, out.metrics.acceptance_rate
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import store
from .bench import tuning
from .config import GenerationConfig, OverflowPolicy, SamplingParams
from .drafters.base import DRAFTERS, Drafter
from .drafters.draft_model import DraftModelDrafter
from .drafters.early_exit import EarlyExitDrafter
from .engine import GenerationResult, plain_generate, speculative_generate
from .model.load import load_transformer
from .model.transformer import Transformer
from .tokenizer import Messages, Tokenizer, check_same_tokenizer


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: Transformer
    tokenizer: Tokenizer

    def __repr__(self) -> str:
        a = self.model.args
        return f"LoadedModel({self.name!r}, {a.model_type}, {a.n_layers} layers, mode={self.model.mode})"


def load(name_or_path: str | Path, *, dtype: str = "auto", device: str | torch.device | None = None) -> LoadedModel:
    """Load a registered model name, a Hugging Face directory or a GGUF file.

    `dtype` is a precision/kernel mode: "auto" (the fastest mode that keeps greedy identity
    exact: q4k on the CPU, int8 where q4k's kernel cannot be built), "fp32", "bf16", "fp16",
    "int8" or "q4k"."""
    path = store.resolve(name_or_path)
    return LoadedModel(str(name_or_path), path, load_transformer(path, dtype=dtype, device=device),
                       Tokenizer.from_dir(path))  # fmt: skip


def encode_prompt(tokenizer: Tokenizer, prompt: str | Messages | list[int], chat: bool | None = None) -> list[int]:
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


def make_drafter(
    target: LoadedModel, assistant_model: LoadedModel | None, drafter: Drafter | str | None
) -> Drafter | None:
    """`drafter` may be a drafter object or the name of one that needs no second model
    ("prompt-lookup", "early-exit", "lookahead"), with its default options."""
    if assistant_model is not None and drafter is not None:
        raise ValueError("pass either assistant_model or drafter, not both")
    if isinstance(drafter, str):
        model_free = {name: cls for name, cls in DRAFTERS.items() if name != "draft-model"}
        if drafter not in model_free:
            hint = "; the draft-model drafter is chosen by passing assistant_model=" if drafter == "draft-model" else ""
            raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(sorted(model_free))}{hint}")
        return EarlyExitDrafter(target.model) if drafter == "early-exit" else model_free[drafter]()
    if assistant_model is None:
        return drafter
    check_same_tokenizer(target.tokenizer, assistant_model.tokenizer, names=(target.name, assistant_model.name))
    return DraftModelDrafter(assistant_model.model)


def generate(
    target: LoadedModel,
    prompt: str | Messages | list[int],
    *,
    assistant_model: LoadedModel | None = None,
    drafter: Drafter | str | None = None,
    k: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: tuple[str, ...] | list[str] = (),
    ignore_eos: bool = False,
    context_overflow: OverflowPolicy = "error",
    chat: bool | None = None,
) -> GenerationResult:
    """Generate from `target`; speculative when an assistant model or a drafter is given,
    plain autoregressive decoding otherwise. `k` unset: the k that `specdec bench --tune`
    stored for this target, method and mode, else 4 (`metrics.k_source` says which)."""
    spec = make_drafter(target, assistant_model, drafter)
    k, k_source = resolve_k(target, spec, assistant_model, k)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, k=k, stop=tuple(stop), ignore_eos=ignore_eos,
                           context_overflow=context_overflow)  # fmt: skip
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    ids = encode_prompt(target.tokenizer, prompt, chat)
    if spec is None:
        return plain_generate(target.model, ids, cfg, sampling, target.tokenizer)
    result = speculative_generate(target.model, spec, ids, cfg, sampling, target.tokenizer)
    result.metrics.k, result.metrics.k_source = k, k_source
    return result


def resolve_k(target: LoadedModel, spec: Drafter | None, assistant_model: LoadedModel | None,
              k: int | None) -> tuple[int, str]:  # fmt: skip
    """(k, where it came from): "given", "tuned" (`specdec bench --tune`) or "default"."""
    if k is not None:
        return k, "given"
    if spec is not None:
        method = "draft-model" if assistant_model is not None else getattr(spec, "name", "")
        draft = assistant_model.name if assistant_model is not None else None
        tuned = tuning.lookup(target.name, method, draft, target.model.mode)
        if tuned is not None:
            return tuned, "tuned"
    return tuning.DEFAULT_K, "default"


@dataclass
class Comparison:
    speculative: GenerationResult
    plain: GenerationResult
    greedy: bool

    @property
    def identical(self) -> bool | None:
        """Greedy only: does speculative output equal plain decoding token for token?"""
        return self.speculative.token_ids == self.plain.token_ids if self.greedy else None

    @property
    def speedup(self) -> float:
        """Plain wall time / speculative wall time per generated token (same prompt, same run)."""
        s, p = self.speculative.metrics, self.plain.metrics
        return (p.wall_time / p.new_tokens) / (s.wall_time / s.new_tokens)

    def to_dict(self) -> dict[str, Any]:
        m = self.speculative.metrics
        return {
            "identical": self.identical,
            "speedup": self.speedup,
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


def compare(target: LoadedModel, prompt: str | Messages | list[int], **kwargs: Any) -> Comparison:
    """Run plain decoding and speculative decoding on the same prompt, side by side."""
    if kwargs.get("assistant_model") is None and kwargs.get("drafter") is None:
        raise ValueError("compare needs an assistant_model or a drafter")
    plain_kwargs = {k: v for k, v in kwargs.items() if k not in ("assistant_model", "drafter", "k")}
    _warm_up(target, kwargs.get("assistant_model"))
    plain = generate(target, prompt, **plain_kwargs)
    spec = generate(target, prompt, **kwargs)
    return Comparison(spec, plain, greedy=float(kwargs.get("temperature", 0.0)) == 0.0)


def _warm_up(*models: LoadedModel | None) -> None:
    """One short forward per model so first-call costs (allocation, kernel selection) are not
    billed to whichever method runs first."""
    for lm in models:
        if lm is not None:
            cache = lm.model.new_cache(8)
            lm.model(torch.zeros(1, 4, dtype=torch.long, device=lm.model.device), cache)
