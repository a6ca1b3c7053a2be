"""What drafters learn from earlier requests, per pool, handed to each in its `DraftSession`.

A *pool* is whose requests may teach whose: a server keeps one per API key (a response's speed
must not reveal what another client generated), a process one for all its sequences (""),
`specdec.compare` and `specdec bench` one per repeat (a repeat's speed must not come from an
earlier repeat's text). One `Memory` per pool holds:

* `acceptance`: the chooser's acceptance by (member, situation) over greedy requests, the prior
  of the next request's estimates (`offers.Estimates`);
* each drafter's own `part`: suffix decoding's store of earlier outputs, a draft model's
  confidence calibration and step record.

The engine (or a server) owns the pools and hands a sequence's Memory to its drafter; a drafter
never looks memory up by itself, and a test builds one. By default an engine uses its target's
pools for the life of the process (`pools_of`), dropped by `runtime.forget`."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from .runtime import per_model

if TYPE_CHECKING:
    from .offers import Acceptance

T = TypeVar("T")


class Memory:
    """One pool's memory (see the module doc)."""

    def __init__(self) -> None:
        self.acceptance: dict[tuple[str, Hashable], Acceptance] = {}
        self._parts: dict[Hashable, Any] = {}

    def part(self, key: Hashable, make: Callable[[], T]) -> T:
        """A drafter's own part under `key`, made by `make` on first use."""
        if key not in self._parts:
            self._parts[key] = make()
        return self._parts[key]

    def forget(self, key: Hashable) -> None:
        """Drop a drafter's part (a benchmark's run must not draft from an earlier run's text)."""
        self._parts.pop(key, None)

    def get(self, key: Hashable) -> Any:
        """A drafter's part under `key`, or None where it has none yet (a report reads it)."""
        return self._parts.get(key)


class Pools:
    """A target's memories by pool."""

    def __init__(self) -> None:
        self.pools: dict[str, Memory] = {}

    def of(self, pool: str) -> Memory:
        return self.pools.setdefault(pool, Memory())

    def drop(self, pool: str) -> None:
        """Forget one pool (a comparison's repeat, once measured)."""
        self.pools.pop(pool, None)


POOLS = per_model(memory=True)  # per target: the pools an engine uses by default


def pools_of(target: Any) -> Pools:
    """The target's pools for the life of the process (what `specdec.generate` calls share)."""
    return POOLS.of(target, Pools)
