"""Earlier sequences' cached rows, reused by later prompts that begin the same way.

A chat's next turn, or a coding agent's next request, resends the whole conversation: the old
prompt, the model's answer, and a little new text. The rows of everything but the new text were
computed before; a store of finished sequences' KV rows, keyed by their tokens, lets the next
prompt copy its longest cached prefix and prefill only the rest.

Only for models whose rows are bitwise the same however a pass computes them
(`Transformer.rows_bitwise`): a reused row is then exactly what the prompt's own prefill would
have computed, so no output changes. The store is bounded in tokens (least recently used first
out) and kept per pool (a server's API key, as the suffix drafter's memory): whether a prompt's
prefix was cached shows in its time to first token, so one client's requests never speed up, or
reveal, another's unless the server pools them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .cache import KVCache

if TYPE_CHECKING:
    pass

# Shorter prefixes are not worth an entry (a few rows of prefill cost next to nothing).
MIN_TOKENS = 16


@dataclass
class _Entry:
    tokens: np.ndarray  # [n] int64: the tokens whose rows `cache` holds
    cache: KVCache  # capacity n, slots [0, n)


class PrefixStore:
    """Finished sequences' rows by their tokens, at most `max_tokens` rows in all."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"the prefix store's size must be >= 0 tokens (got {max_tokens})")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()  # (pool, id) -> entry, oldest first
        self._next = 0
        self.hits = 0  # lookups that found a prefix
        self.reused = 0  # rows copied instead of computed

    @property
    def tokens(self) -> int:
        """Rows held in all."""
        return sum(len(e.tokens) for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, pool: str, tokens: list[int]) -> tuple[KVCache, int] | None:
        """The entry of `pool` sharing the longest prefix with `tokens`, and that prefix's length
        (None when none shares MIN_TOKENS)."""
        query = np.asarray(tokens, dtype=np.int64)
        best: tuple[int, tuple[str, int] | None] = (0, None)
        for key, e in self._entries.items():
            if key[0] != pool:
                continue
            n = min(len(query), len(e.tokens))
            same = query[:n] == e.tokens[:n]
            m = n if same.all() else int(np.argmin(same))
            if m > best[0]:
                best = (m, key)
        m, key = best
        if key is None or m < MIN_TOKENS:
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        self.reused += m
        return self._entries[key].cache, m

    def put(self, pool: str, tokens: list[int], cache: KVCache) -> None:
        """Keep the rows of `tokens` (the first len(tokens) slots of `cache`, copied). An entry
        the new one extends is dropped; an entry that already holds these tokens is kept instead."""
        n = len(tokens)
        if n < MIN_TOKENS or n > self.max_tokens or n > cache.length:
            return
        new = np.asarray(tokens, dtype=np.int64)
        for key, e in list(self._entries.items()):
            if key[0] != pool:
                continue
            m = min(n, len(e.tokens))
            if not np.array_equal(new[:m], e.tokens[:m]):
                continue
            if len(e.tokens) >= n:  # held already (as this or a longer sequence)
                self._entries.move_to_end(key)
                return
            del self._entries[key]  # the new entry holds all of it
        held = self.tokens
        while self._entries and held + n > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            held -= len(old.tokens)
        self._entries[(pool, self._next)] = _Entry(new, cache.clone_prefix(n))
        self._next += 1
