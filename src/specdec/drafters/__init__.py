from .base import (
    DRAFTERS,
    Draft,
    Drafter,
    DraftSession,
    ExtraRows,
    point_mass,
    register,
)
from .draft_model import DraftModelDrafter
from .early_exit import EarlyExitDrafter
from .lookahead import LookaheadDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = [
    "DRAFTERS",
    "Draft",
    "DraftModelDrafter",
    "DraftSession",
    "Drafter",
    "EarlyExitDrafter",
    "ExtraRows",
    "LookaheadDrafter",
    "PromptLookupDrafter",
    "point_mass",
    "register",
]  # fmt: skip
