from .cache import ContextOverflowError, KVCache
from .config import ModelArgs, UnsupportedModelError
from .load import load_transformer
from .transformer import ForwardOutput, Transformer

__all__ = [
    "ContextOverflowError",
    "ForwardOutput",
    "KVCache",
    "ModelArgs",
    "Transformer",
    "UnsupportedModelError",
    "load_transformer",
]
