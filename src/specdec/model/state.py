"""What specdec learns about one loaded model while a process runs, owned by the model (as
gpt-fast's model owns its caches): the measured costs, the acceptance seen, the heads and draft
vocabularies built for it. A model loaded afresh starts afresh; nothing global to reset."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (annotations only: the model layer imports nothing above it)
    from ..adaptive import Acceptance
    from ..costs import Costs
    from ..drafters.confidence import Calibration
    from ..drafters.suffix import SuffixStore
    from ..drafters.vocab import DraftVocab
    from .cache import KVCache
    from .prefix import PrefixStore


@dataclass
class ModelState:
    # costs.pass_costs: the pass time per row count this process decides by
    pass_costs: Costs | None = None
    # costs.draft_step_ms: drafting steps run on this model, ms by what they depend on
    draft_steps: dict[str, float] = field(default_factory=dict)
    # adaptive.acceptance_memory: (drafter, situation) -> acceptance over recent greedy requests
    acceptance: dict[tuple[str, Hashable], Acceptance] = field(default_factory=dict)
    # drafters.heads: trained heads loaded for this target and their runners, by (kind, source)
    heads: dict[tuple[str, str], tuple[Any, Any]] = field(default_factory=dict)
    # drafters.vocab: this draft model's vocabularies by size (None: the whole one)
    vocabs: dict[int, DraftVocab | None] = field(default_factory=dict)
    # drafters.early_exit: calibrations by (mode, kernels, k, ...)
    calibrations: dict[tuple, dict[str, Any]] = field(default_factory=dict)
    # drafters.draft_model: the last prefill of this draft model (tokens, window, cache, skip),
    # copied by the next request with the same prompt instead of computed again
    prefilled: tuple[tuple[int, ...], int, KVCache, int] | None = None
    # model.prefix: finished sequences' cached rows, reused by prompts that begin the same way
    prefixes: PrefixStore | None = None
    # drafters.suffix: earlier requests' outputs by pool (a server's API key; "" in a process)
    suffix: dict[str, SuffixStore] = field(default_factory=dict)
    # drafters.draft_model: how the draft's confidence predicted acceptance over recent greedy
    # requests, by draft model
    confidence: dict[Hashable, Calibration] = field(default_factory=dict)
