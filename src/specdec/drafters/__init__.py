from .base import DRAFTERS, Draft, Drafter, DraftSession, point_mass, register
from .draft_model import DraftModelDrafter

__all__ = ["DRAFTERS", "Draft", "Drafter", "DraftSession", "DraftModelDrafter", "point_mass", "register"]
