from .auto import AutoDrafter
from .base import (
    DRAFTERS,
    Draft,
    Drafter,
    DrafterSpec,
    DraftSession,
    ExtraRows,
    Feedback,
    Option,
    Switchable,
    make_drafter,
    point_mass,
    register,
    uses_draft_model,
)
from .cross import CrossDraftModelDrafter
from .draft_model import DraftModelDrafter
from .eagle3 import Eagle3Drafter
from .early_exit import EarlyExitDrafter
from .lookahead import LookaheadDrafter
from .medusa import HydraDrafter, MedusaDrafter
from .prediction import PredictionDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter

__all__ = [
    "AutoDrafter",
    "DRAFTERS",
    "Draft",
    "CrossDraftModelDrafter",
    "DraftModelDrafter",
    "DraftSession",
    "Drafter",
    "DrafterSpec",
    "Eagle3Drafter",
    "EarlyExitDrafter",
    "ExtraRows",
    "Feedback",
    "HydraDrafter",
    "LookaheadDrafter",
    "MedusaDrafter",
    "Option",
    "PredictionDrafter",
    "PromptLookupDrafter",
    "SuffixDrafter",
    "Switchable",
    "make_drafter",
    "point_mass",
    "register",
    "uses_draft_model",
]
