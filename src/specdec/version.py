"""specdec's version (a leaf: every layer may name it)."""

__version__ = "0.1.0"
