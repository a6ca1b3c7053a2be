"""specdec: exact speculative decoding for local language models."""

from .api import (
    Comparison,
    LoadedModel,
    Request,
    Stream,
    build_drafter,
    compare,
    encode_prompt,
    generate,
    generate_batch,
    load,
    request,
    stream,
)
from .config import GenerationConfig, SamplingParams
from .drafters import (
    DRAFTERS,
    Draft,
    Drafter,
    DraftModelDrafter,
    DraftSession,
    Eagle3Drafter,
    EarlyExitDrafter,
    Feedback,
    LookaheadDrafter,
    PromptLookupDrafter,
    make_drafter,
)
from .engine import Delta, Engine, GenerationResult
from .metrics import Metrics
from .verify import (
    TreeVerdict,
    Verdict,
    greedy_verify,
    point_mass_sample,
    rejection_sample,
    tree_greedy_verify,
    tree_point_mass_sample,
    tree_rejection_sample,
)

__version__ = "0.1.0"

__all__ = [
    "DRAFTERS",
    "Comparison",
    "Delta",
    "Draft",
    "DraftModelDrafter",
    "DraftSession",
    "Drafter",
    "Eagle3Drafter",
    "EarlyExitDrafter",
    "Engine",
    "Feedback",
    "GenerationConfig",
    "GenerationResult",
    "LoadedModel",
    "LookaheadDrafter",
    "Metrics",
    "PromptLookupDrafter",
    "Request",
    "SamplingParams",
    "Stream",
    "TreeVerdict",
    "Verdict",
    "compare",
    "encode_prompt",
    "build_drafter",
    "generate",
    "generate_batch",
    "greedy_verify",
    "load",
    "make_drafter",
    "point_mass_sample",
    "rejection_sample",
    "request",
    "stream",
    "tree_greedy_verify",
    "tree_point_mass_sample",
    "tree_rejection_sample",
]  # fmt: skip
