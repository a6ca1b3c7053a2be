"""What a process learns about a loaded model while it runs, kept by the module that owns each
kind of it, per model (a model dropped takes its entries with it; a model loaded afresh starts
afresh). The model layer's code reads none of it: `model/` knows no layer above.

Two lifetimes: *artifacts* (the pass table, draft-step timings, loaded heads, draft vocabularies,
calibrations) are facts about the model on this machine and live as long as it does; *memory*
(acceptance seen, suffix decoding's outputs, cached prompt rows, the draft's confidence
calibration) is what earlier requests teach later ones, and `forget` drops it — a benchmark's
warm-up must not inform its timed runs."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, TypeVar

V = TypeVar("V")


class PerModel(MutableMapping[Any, V]):
    """One owner's entries, by model.

    Each entry is kept in the model object's own `__dict__` (under a slot of this owner's),
    not in a WeakKeyDictionary: several entries hold their model (a draft vocabulary, a head's
    runner), and a WeakKeyDictionary's value that refers to its key keeps it alive forever. On
    the model, an entry is part of the model's own reference cycle and goes when it does. The
    model's code never reads it (model/ knows no layer above it)."""

    _count = itertools.count()

    def __init__(self) -> None:
        self._slot = f"_specdec_runtime_{next(self._count)}"
        self._holders: weakref.WeakSet[Any] = weakref.WeakSet()  # models holding an entry

    def __getitem__(self, model: Any) -> V:
        try:
            return vars(model)[self._slot]
        except KeyError:
            raise KeyError(model) from None

    def __setitem__(self, model: Any, value: V) -> None:
        object.__setattr__(model, self._slot, value)  # (not nn.Module's: never a submodule)
        self._holders.add(model)

    def __delitem__(self, model: Any) -> None:
        if self._slot not in vars(model):
            raise KeyError(model)
        object.__delattr__(model, self._slot)
        self._holders.discard(model)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._holders))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def of(self, model: Any, make: Callable[[], V]) -> V:
        """The model's entry, made by `make` on first use."""
        got = vars(model).get(self._slot)
        if got is None:
            got = make()
            self[model] = got
        return got


_MEMORY: list[PerModel[Any]] = []  # (the owners whose entries `forget` drops; filled at import)


def per_model(*, memory: bool) -> PerModel[Any]:
    """A new owner's cache; `memory`: what earlier requests taught (dropped by `forget`), else an
    artifact of the model on this machine (kept while the model lives)."""
    cache: PerModel[Any] = PerModel()
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
