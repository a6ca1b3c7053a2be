"""Measured costs of the target (and a draft model): the cost model's inputs, shared by the
benchmark's predictions (`specdec.bench.costmodel`) and drafters that size their proposals
from them (EAGLE-3's trees)."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from .model.transformer import Transformer

K_MAX = 8  # largest k the benchmark's recommendations consider


@dataclass
class Costs:
    target_ms: dict[int, float]  # rows in one pass -> median ms
    draft_ms: float | None = None  # one-token step of the draft model, ms

    def target(self, rows: float) -> float:
        """Pass time for a (possibly fractional, mean) number of rows, linearly interpolated."""
        xs = sorted(self.target_ms)
        rows = min(max(rows, xs[0]), xs[-1])
        for lo, hi in itertools.pairwise(xs):
            if lo <= rows <= hi:
                w = (rows - lo) / (hi - lo)
                return self.target_ms[lo] * (1 - w) + self.target_ms[hi] * w
        return self.target_ms[xs[0]]


def _time_rows(model: Transformer, rows: list[int], context: int, repeats: int) -> dict[int, float]:
    gen = torch.Generator().manual_seed(0)
    vocab = min(model.args.vocab_size, 30000)
    cache = model.new_cache(context + max(rows))
    model(torch.randint(0, vocab, (1, context), generator=gen).to(model.device), cache, last_only=True)
    new = torch.randint(0, vocab, (1, max(rows)), generator=gen).to(model.device)
    out = {}
    for r in rows:
        times = []
        for i in range(repeats + 1):  # the first call warms up this shape
            cache.truncate(context)
            t0 = time.perf_counter()
            model(new[:, :r], cache)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
        out[r] = statistics.median(times)
    return out


def measure_costs(target: Transformer, draft: Transformer | None = None, *, max_rows: int = 2 * K_MAX + 1,
                  context: int = 128, repeats: int = 5) -> Costs:  # fmt: skip
    """Time the target's pass over 1..max_rows rows (and the draft's one-token step)."""
    rows = sorted({1, 2, 3, 4, 5, 6, 8, 10, 12, 16, max_rows} & set(range(1, max_rows + 1)))
    costs = Costs(_time_rows(target, rows, context, repeats))
    if draft is not None:
        costs.draft_ms = _time_rows(draft, [1], context, repeats)[1]
    return costs
