"""What a process learns about a loaded model while it runs, kept by the module that owns each
kind of it and keyed weakly by the model (a model dropped takes its entries with it; a model
loaded afresh starts afresh). The model layer holds none of it: `model/` knows no layer above.

Two lifetimes: *artifacts* (the pass table, draft-step timings, loaded heads, draft vocabularies,
calibrations) are facts about the model on this machine and live as long as it does; *memory*
(acceptance seen, suffix decoding's outputs, cached prompt rows, the draft's confidence
calibration) is what earlier requests teach later ones, and `forget` drops it — a benchmark's
warm-up must not inform its timed runs."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

V = TypeVar("V")


class PerModel(weakref.WeakKeyDictionary[Any, V]):
    """One owner's entries, by model (weakly); `memory`: dropped by `forget`."""

    def __init__(self, memory: bool) -> None:
        super().__init__()
        self.memory = memory

    def of(self, model: Any, make: Callable[[], V]) -> V:
        """The model's entry, made by `make` on first use."""
        got = self.get(model)
        if got is None:
            got = self[model] = make()
        return got


_MEMORY: list[PerModel[Any]] = []  # (the owners whose entries `forget` drops; filled at import)


def per_model(*, memory: bool) -> PerModel[Any]:
    """A new owner's cache; `memory`: what earlier requests taught (dropped by `forget`), else an
    artifact of the model on this machine (kept while the model lives)."""
    cache: PerModel[Any] = PerModel(memory)
    if memory:
        _MEMORY.append(cache)
    return cache


def forget_all() -> None:
    """`forget` for every model at once (a test starts as a new process would)."""
    for cache in _MEMORY:
        cache.clear()


def forget(model: Any) -> None:
    """Drop what `model`'s requests left behind (acceptance memory, suffix decoding's stores of
    outputs, cached rows, the draft's confidence calibration)."""
    for cache in _MEMORY:
        cache.pop(model, None)
