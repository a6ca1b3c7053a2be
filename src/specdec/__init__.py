"""specdec: exact speculative decoding for local language models."""

from .api import Comparison, LoadedModel, compare, encode_prompt, generate, load
from .config import GenerationConfig, SamplingParams
from .drafters import (
    DRAFTERS,
    Draft,
    Drafter,
    DraftModelDrafter,
    DraftSession,
    PromptLookupDrafter,
)
from .engine import GenerationResult, plain_generate, speculative_generate
from .metrics import Metrics
from .verify import Verdict, greedy_verify, point_mass_sample, rejection_sample

__version__ = "0.1.0"

__all__ = [
    "DRAFTERS",
    "Comparison",
    "Draft",
    "DraftModelDrafter",
    "DraftSession",
    "Drafter",
    "GenerationConfig",
    "GenerationResult",
    "LoadedModel",
    "Metrics",
    "PromptLookupDrafter",
    "SamplingParams",
    "Verdict",
    "compare",
    "encode_prompt",
    "generate",
    "greedy_verify",
    "load",
    "plain_generate",
    "point_mass_sample",
    "rejection_sample",
    "speculative_generate",
]  # fmt: skip
