from .base import DRAFTERS, Draft, Drafter, DraftSession, point_mass, register
from .draft_model import DraftModelDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = [
    "DRAFTERS",
    "Draft",
    "DraftModelDrafter",
    "DraftSession",
    "Drafter",
    "PromptLookupDrafter",
    "point_mass",
    "register",
]  # fmt: skip
