"""specdec: exact speculative decoding for local language models."""

from .api import Comparison, LoadedModel, compare, encode_prompt, generate, load
from .config import GenerationConfig, SamplingParams
from .drafters import (
    DRAFTERS,
    Draft,
    Drafter,
    DraftModelDrafter,
    DraftSession,
    EarlyExitDrafter,
    LookaheadDrafter,
    PromptLookupDrafter,
)
from .engine import GenerationResult, plain_generate, speculative_generate
from .metrics import Metrics
from .verify import (
    TreeVerdict,
    Verdict,
    greedy_verify,
    point_mass_sample,
    rejection_sample,
    tree_greedy_verify,
    tree_point_mass_sample,
)

__version__ = "0.1.0"

__all__ = [
    "DRAFTERS",
    "Comparison",
    "Draft",
    "DraftModelDrafter",
    "DraftSession",
    "Drafter",
    "EarlyExitDrafter",
    "GenerationConfig",
    "GenerationResult",
    "LoadedModel",
    "LookaheadDrafter",
    "Metrics",
    "PromptLookupDrafter",
    "SamplingParams",
    "TreeVerdict",
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
    "tree_greedy_verify",
    "tree_point_mass_sample",
]  # fmt: skip
