"""Preallocated KV cache written by slot.

New tokens of a forward call go to slots ``[length, length + T)``. Rejecting drafted tokens
is ``truncate(n)``: O(1), the stale slots are simply overwritten by the next call. Each slot
remembers its position id, so a token tree (many slots at one depth) and sliding-window
attention are both expressed by positions, not slot indices.
"""

from __future__ import annotations

import torch


class ContextOverflowError(ValueError):
    pass


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S, D]
        self.pos = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # [B, S]
        self.capacity = capacity
        self.length = 0  # slots [0, length) hold committed tokens

    def reserve(self, n: int) -> int:
        """Slot index where `n` new tokens go; refuses to overrun the buffer."""
        if self.length + n > self.capacity:
            raise ContextOverflowError(
                f"KV cache full: {self.length} tokens cached + {n} new > capacity {self.capacity}"
            )
        return self.length

    def copy_prefix(self, other: KVCache, n: int, start: int = 0) -> None:
        """Hold the first `n` slots of `other` (a sequence that prefilled the same prompt). With
        `start`, the first `start` slots are held already (copied before: a prompt read in
        chunks) and only the rest is copied."""
        if n > self.capacity or n > other.length:
            raise ValueError(
                f"cannot copy {n} slots from a cache of length {other.length} into capacity {self.capacity}"
            )
        if not 0 <= start <= min(n, self.length):
            raise ValueError(f"cannot copy from slot {start} into a cache of length {self.length}")
        self.k[:, :, :, start:n] = other.k[:, :, :, start:n]
        self.v[:, :, :, start:n] = other.v[:, :, :, start:n]
        self.pos[:, start:n] = other.pos[:, start:n]
        self.length = n

    def clone_prefix(self, n: int) -> KVCache:
        """A new cache of capacity `n` holding this one's first `n` slots."""
        if not 0 < n <= self.length:
            raise ValueError(f"cannot clone {n} slots of a cache of length {self.length}")
        L, B, H, _, D = self.k.shape
        out = KVCache(L, B, H, n, D, dtype=self.k.dtype, device=self.k.device)
        out.copy_prefix(self, n)
        return out

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` slots (rejected drafts are forgotten)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def keep(self, prefix: int, slots: torch.Tensor) -> None:
        """Keep slots ``[0, prefix)`` plus the listed `slots` (ascending, each >= prefix),
        moved to follow the prefix. For token trees: the accepted path's slots survive."""
        if not 0 <= prefix <= self.length:
            raise ValueError(f"prefix {prefix} outside a cache of length {self.length}")
        if slots.numel() and (int(slots.min()) < prefix or int(slots.max()) >= self.length):
            raise ValueError(f"slots must lie in [{prefix}, {self.length})")
        n = slots.numel()
        dst = torch.arange(prefix, prefix + n, device=slots.device)
        self.k[:, :, :, dst] = self.k[:, :, :, slots]
        self.v[:, :, :, dst] = self.v[:, :, :, slots]
        self.pos[:, dst] = self.pos[:, slots]
        self.length = prefix + n
