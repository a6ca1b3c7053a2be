"""Frozen, validated configuration. The CLI is built from these dataclasses' fields."""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, TypeVar, get_args

OverflowPolicy = Literal["error", "truncate"]
DEFAULT_K = 4  # draft tokens per step when neither the caller nor `specdec bench --tune` chose one
MAX_K = 64  # the most draft tokens per step anywhere (CLI, API, server): a pass of k + 1 rows must stay cheap


def _opt(help: str, *flags: str, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    return {"help": help, "flags": flags, "choices": choices}


@dataclass(frozen=True)
class SamplingParams:
    """How a token is picked from a distribution; applied identically to target (p) and draft (q)."""

    temperature: float = field(default=0.0, metadata=_opt("0 = greedy; > 0 samples from softmax(logits / T)"))
    top_k: int = field(default=0, metadata=_opt("keep the k most likely tokens (0 = off)"))
    top_p: float = field(default=1.0, metadata=_opt("nucleus sampling mass in (0, 1] (1 = off)"))
    seed: int | None = field(default=None, metadata=_opt("random seed (unset: a fresh one, reported in the output)"))
    acceptance: str = field(
        default="exact",
        metadata=_opt(
            "how drafts are verified when sampling: 'exact' (the output is distributed as the target's, always the "
            "default) or 'typical' (Medusa's typical acceptance: NOT exact, accepts more; every output says so)",
            choices=("exact", "typical"),
        ),
    )
    epsilon: float = field(
        default=0.09,
        metadata=_opt(
            "typical acceptance: a draft token x is accepted where p(x) > min(epsilon, delta * exp(-entropy of p))"
        ),
    )
    delta: float = field(default=0.3, metadata=_opt("typical acceptance: see --epsilon"))

    def __post_init__(self) -> None:
        if isinstance(self.temperature, float) and math.isnan(self.temperature):
            raise ValueError("temperature must be a number >= 0 (0 means greedy), got nan")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63 - 1):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1), got {self.seed}")
        if self.acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance must be 'exact' or 'typical', got {self.acceptance!r}")
        if self.acceptance == "typical" and self.temperature == 0.0:
            raise ValueError(
                "typical acceptance is a sampling rule: give --temperature > 0 (greedy decoding "
                "verifies exactly, and typical acceptance would gain nothing there)"
            )
        if not 0.0 < self.epsilon <= 1.0 or not self.delta > 0.0:
            raise ValueError(
                f"typical acceptance needs epsilon in (0, 1] and delta > 0, got {self.epsilon}, {self.delta}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def exact(self) -> bool:
        """False with typical acceptance: the output is then not distributed as the target's."""
        return self.acceptance == "exact"


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and when to stop."""

    max_new_tokens: int = field(default=128, metadata=_opt("maximum number of tokens to generate"))
    k: int = field(
        default=DEFAULT_K,
        metadata=_opt(
            "draft tokens proposed per target pass (unset: the k `specdec bench --tune` stored, else 4)",
            "-k",
            "--num-draft-tokens",
        ),
    )
    stop: tuple[str, ...] = field(default=(), metadata=_opt("stop string (repeatable); not included in the text"))
    ignore_eos: bool = field(default=False, metadata=_opt("keep generating past end-of-sequence tokens"))
    adaptive_k: bool = field(
        default=True,
        metadata=_opt(
            "never slower than plain decoding: each step's k (up to -k) is chosen from this request's measured "
            "acceptance and costs, 0 = a plain step where drafting is not predicted to pay (draft-model, "
            "prompt-lookup); other drafters' steps turn plain where drafting is measured slower (--no-adaptive-k: "
            "draft k tokens every step)"
        ),
    )
    context_overflow: OverflowPolicy = field(
        default="error",
        metadata=_opt(
            "prompt + max_new_tokens beyond the model context: 'error', or 'truncate' the output at the context end",
            choices=get_args(OverflowPolicy),
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise ValueError(f"k (draft tokens per step) must be between 1 and {MAX_K}, got {self.k}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.context_overflow not in get_args(OverflowPolicy):
            raise ValueError(
                f"context_overflow must be one of {get_args(OverflowPolicy)}, got {self.context_overflow!r}"
            )


T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one option per dataclass field (flags, help and choices come from field metadata)."""
    for f in fields(cls):
        meta = f.metadata
        flags = meta.get("flags") or ()
        names = [*flags] if any(fl.startswith("--") for fl in flags) else [*flags, "--" + f.name.replace("_", "-")]
        default = f.default if f.default is not MISSING else None
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help", "")}  # the formatter adds defaults
        if f.type in ("bool", bool):
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = default
        elif str(f.type).startswith("tuple"):
            kwargs["action"] = "append"
            kwargs["default"] = None
        else:
            kwargs["default"] = default
            kwargs["type"] = _scalar_type(str(f.type))
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
        parser.add_argument(*names, **kwargs)


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        v = getattr(ns, f.name)
        if str(f.type).startswith("tuple"):
            v = tuple(v or ())
        values[f.name] = v
    return cls(**values)


def _scalar_type(annotation: str):
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str
