"""Measured costs of the target (and a draft model): the cost model's inputs, shared by the
benchmark's predictions (`specdec.bench.costmodel`) and drafters that size their proposals
from them (EAGLE-3's trees)."""

from __future__ import annotations

import hashlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .model.transformer import Transformer
from .runtime import per_model

# the longest chain the cost model prices: the chooser sizes chains and the benchmark recommends
# k within it (`config.MAX_K` is the most any step may draft)
PRICED_K = 8
# the widest pass table anyone asks for (a server's batch guard: 64 rows); timed once at
# `specdec models install` (and by `api.prepare`), it serves every narrower request
TABLE_ROWS = 64


@dataclass
class Costs:
    target_ms: dict[int, float]  # rows in one pass -> median ms
    draft_ms: float | None = None  # one-token step of the draft model, ms
    # how this machine runs now against the table (load, a longer context): measured / tabled
    # pass time, followed online by `observe`; it scales every row count alike
    scale: float = 1.0

    def __post_init__(self) -> None:
        self._xs = sorted(self.target_ms)  # (the table's row counts: read on every offer of every step)

    def _table(self, rows: float) -> float:
        xs = self._xs
        rows = min(max(rows, xs[0]), xs[-1])
        for lo, hi in itertools.pairwise(xs):
            if lo <= rows <= hi:
                w = (rows - lo) / (hi - lo)
                return self.target_ms[lo] * (1 - w) + self.target_ms[hi] * w
        return self.target_ms[xs[0]]

    def target(self, rows: float) -> float:
        """Pass time for a (possibly fractional, mean) number of rows, linearly interpolated."""
        return self.scale * self._table(rows)

    def observe(self, rows: int, ms: float, weight: float = 0.1) -> None:
        """A measured pass over `rows` rows (within the table's range)."""
        if 0 < rows <= max(self.target_ms) and ms > 0:
            self.scale = (1 - weight) * self.scale + weight * ms / self._table(rows)

    def unscaled(self) -> Costs:
        """A copy at the stored table's scale that no later `observe` moves: the costs of a
        request whose choices must not depend on the clock (`reproducible`)."""
        return Costs(dict(self.target_ms), self.draft_ms)

    def rows(self, rows: int) -> float:
        """Pass time for any number of rows: interpolated, and past the largest measured count
        extended along the last measured slope (passes over many rows are compute-bound)."""
        xs = self._xs
        if rows <= xs[-1] or len(xs) < 2:
            return self.target(rows)
        lo, hi = xs[-2], xs[-1]
        slope = (self.target_ms[hi] - self.target_ms[lo]) / (hi - lo)
        return self.scale * (self.target_ms[hi] + slope * (rows - hi))


def reproducible(sampling: Any) -> bool:
    """A seeded sampled request (`SamplingParams`): its answer must be the same bit for bit
    every time, so the random numbers verification draws must be too, and with them every
    draft length and tree shape. Its controllers and drafters then decide from stored numbers
    alone (the pass table unscaled, draft costs timed once per machine), never from this
    moment's clock. (Greedy answers do not depend on the drafts at all.)"""
    return not sampling.greedy and sampling.seed is not None


# What each member's proposals were accepted at, per target, member scope (the draft model it
# drafts with; "" for a model-free member) and situation, over earlier greedy requests on this
# machine: the prior of a member a request has not measured yet (`Pricing.past`). v1: per
# situation [proposed, accepted] per draft position, discounted by HISTORY_DECAY per request.
ACCEPTANCE_FILE = "acceptance-v1.json"
HISTORY_DECAY = 0.7  # a stored count's weight when a request's counts join it (the last ~3 requests)
HISTORY_CAP = 64.0  # the most proposals a position's stored count holds (a prior, never a certainty)
HISTORY_KEYS = 256  # the most (target, scope) entries the table keeps, the least recently used dropped


def _history_key(target: Any, scope: str) -> str | None:
    """The acceptance table's key of `scope` on `target`: its directory and mode (what its
    logits depend on), not the CPU (acceptance is the models', not the machine's)."""
    src = getattr(target, "source_dir", None)
    return None if src is None else f"{src}|{target.mode}|{scope}"


def _counts(entry: Any) -> dict[str, list[list[float]]]:
    """A stored history entry's situations that are well formed: [proposed, accepted] each."""
    if not isinstance(entry, dict):
        return {}
    out = {}
    for sit, c in entry.items():
        if (
            isinstance(c, list)
            and len(c) == 2
            and all(isinstance(x, list) and all(isinstance(v, (int, float)) and v >= 0 for v in x) for x in c)
            and len(c[0]) == len(c[1])
        ):
            out[sit] = [list(map(float, c[0])), list(map(float, c[1]))]
    return out


def merge_counts(old: Any, new: dict[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    """`old` (a history entry) discounted by HISTORY_DECAY with a request's `new` counts added,
    each position capped at HISTORY_CAP proposals."""
    out = _counts(old)
    for sit, (p_new, a_new) in new.items():
        p_old, a_old = out.get(sit, [[], []])
        n = max(len(p_old), len(p_new))
        p = [
            HISTORY_DECAY * (p_old[j] if j < len(p_old) else 0.0) + (p_new[j] if j < len(p_new) else 0.0)
            for j in range(n)
        ]
        a = [
            HISTORY_DECAY * (a_old[j] if j < len(a_old) else 0.0) + (a_new[j] if j < len(a_new) else 0.0)
            for j in range(n)
        ]
        scale = [min(1.0, HISTORY_CAP / pj) if pj > 0 else 1.0 for pj in p]
        out[sit] = [
            [round(x * f, 4) for x, f in zip(p, scale, strict=True)],
            [round(x * f, 4) for x, f in zip(a, scale, strict=True)],
        ]
    return out


@dataclass(frozen=True)
class Pricing:
    """What one sequence's choices (k, tree sizes, which drafter) are priced by: the target's
    pass table on this machine, and whether the choices may follow the clock. A `reproducible`
    sequence (a seeded sampled request) decides from stored numbers alone: `passes` gives it the
    stored table unscaled, and drafters read `reproducible` to keep their own timings out. The
    engine makes one per sequence and hands it to the drafter in its `DraftSession`; `tables`
    replaces the measured tables (tests)."""

    target: Any  # the target Transformer
    reproducible: bool = False
    tables: Callable[[Any, int], Costs] | None = None  # (target, rows) -> table; None: `pass_costs`
    # what stands for the cache's acceptance table (`ACCEPTANCE_FILE`), {key: entry}: a test's
    # own; None: the cache's file
    history: dict[str, Any] | None = None

    @classmethod
    def of(
        cls,
        target: Any,
        sampling: Any,
        tables: Callable[[Any, int], Costs] | None = None,
        history: dict[str, Any] | None = None,
    ) -> Pricing:
        return cls(target, reproducible(sampling), tables, history)

    def live(self, rows: int) -> Costs:
        """This machine's table (at least `rows` rows), shared by the target's sequences and
        followed online (`Costs.observe`)."""
        return (self.tables or pass_costs)(self.target, rows)

    def passes(self, rows: int) -> Costs:
        """The table this sequence decides by: the live one, or for a reproducible sequence a
        copy at the stored scale that no clock moves."""
        table = self.live(rows)
        return table.unscaled() if self.reproducible else table

    def past(self, scope: str) -> dict[str, list[list[float]]]:
        """What `scope`'s proposals were accepted at on this target in earlier greedy requests,
        by situation ({situation: [proposed, accepted]}, `ACCEPTANCE_FILE`); nothing for a
        reproducible sequence (its choices come from fixed numbers) or a model without a
        directory."""
        key = _history_key(self.target, scope)
        if key is None or self.reproducible:
            return {}
        return _counts(self.history.get(key) if self.history is not None else stored(ACCEPTANCE_FILE, key))

    def keep(self, scope: str, counts: dict[str, list[list[float]]]) -> None:
        """A greedy request's counts of `scope` join the history (`past`)."""
        key = _history_key(self.target, scope)
        if key is None or self.reproducible or not counts:
            return
        if self.history is not None:
            self.history[key] = merge_counts(self.history.get(key), counts)
        else:
            update_measurement(ACCEPTANCE_FILE, key, lambda old: merge_counts(old, counts), limit=HISTORY_KEYS)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step commits with k drafts each accepted with probability alpha, independently
    (Leviathan et al.): 1 + alpha + ... + alpha^k, the target's own token included."""
    return sum(alpha**j for j in range(k + 1))


class PassClock:
    """Times the target's pass over each of `rows` row counts after a context of `context`
    tokens, one round over all the counts at a time: a benchmark calls `round` between its
    runs, so the table is measured interleaved with what it prices (the same minutes, the
    same neighbours).

    Each count's cost is the median over rounds of its time relative to the one-row pass of
    the same round (passes a few hundred ms apart see the same machine), times the median
    one-row pass: the machine's usual speed, not its best moment. (The fastest round of each
    count, kept before, made whichever count caught a quiet moment look cheap against the
    others, and drafting then never paid; a plain median of a few rounds let one slow moment
    make 1 row look dearer than 2: docs/results.md.) The engine's online `scale` follows the
    load of the moment."""

    def __init__(self, model: Transformer, rows: list[int], context: int = 128) -> None:
        gen = torch.Generator().manual_seed(0)
        self.model, self.rows = model, sorted({r for r in rows if r < model.args.max_seq_len} or {1})
        self.context = max(1, min(context, model.args.max_seq_len - max(self.rows)))  # (a model with a short context)
        vocab = min(model.args.vocab_size, 30000)
        self.cache = model.new_cache(self.context + max(self.rows))
        model(torch.randint(0, vocab, (1, self.context), generator=gen).to(model.device), self.cache, last_only=True)
        self.new = torch.randint(0, vocab, (1, max(self.rows)), generator=gen).to(model.device)
        self.times: dict[int, list[float]] = {r: [] for r in self.rows}

    def round(self, keep: bool = True) -> None:
        """One pass per row count; `keep=False`: a warm-up round (first calls of new shapes)."""
        for r in self.rows:
            self.cache.truncate(self.context)
            t0 = time.perf_counter()
            self.model(self.new[:, :r], self.cache)
            if self.model.device.type == "cuda":
                torch.cuda.synchronize()
            if keep:
                self.times[r].append((time.perf_counter() - t0) * 1e3)

    def table(self, pooled: bool = True) -> dict[int, float]:
        """ms per row count; `pooled`: made monotone in rows (`monotone`), what a cost model
        deciding k reads; else as measured (a benchmark pricing the passes that ran: on some
        CPUs the one-row pass costs more than the two-row one, and pooling would price both at
        their mean)."""
        one = self.times[self.rows[0]]
        if not one:
            raise RuntimeError("PassClock.table() before any kept round")
        base = statistics.median(one)
        ms = {r: base * statistics.median(a / b for a, b in zip(t, one, strict=True)) for r, t in self.times.items()}
        return monotone(ms) if pooled else ms


def _time_rows(model: Transformer, rows: list[int], context: int, repeats: int) -> dict[int, float]:
    clock = PassClock(model, rows, context)
    clock.round(keep=False)  # warms up every shape
    for _ in range(repeats):
        clock.round()
    return clock.table()


def monotone(ms: dict[int, float]) -> dict[int, float]:
    """The closest table (least squares) in which more rows never cost less: adjacent counts
    that violate it are pooled to their mean (pool adjacent violators). A pass over r + 1 rows
    does all the work of one over r, so a smaller time is noise, and a cost model reading it
    would price an extra row below zero."""
    blocks: list[list[float]] = []  # [mean, weight] per pooled run of counts, in row order
    for r in sorted(ms):
        blocks.append([ms[r], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    out, it = {}, iter(sorted(ms))
    for mean, w in blocks:
        for _ in range(int(w)):
            out[next(it)] = mean
    return out


def machine_key(target: Transformer) -> str | None:
    """What a measurement of `target` on this machine depends on: model directory, mode (and
    packing), kernel build, CPU, threads, device (None for a model without a directory)."""
    from .model.native import build_id, cpu_info

    src = getattr(target, "source_dir", None)
    if src is None:
        return None
    mode = target.mode + (f"-b{target.bits}" if getattr(target, "bits", None) else "")
    return "|".join(
        [
            str(src),
            mode,
            build_id(),
            cpu_info().get("model name", "?"),
            str(torch.get_num_threads()),
            str(target.device),
        ]
    )


def stored(name: str, key: str) -> Any:
    """A measurement kept in the specdec cache's `name` table (None when absent)."""
    import json

    from . import store

    try:
        return json.loads((store.cache_root() / name).read_text()).get(key)
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def store_measurement(name: str, key: str, value: Any) -> None:
    """Keep a measurement in the specdec cache's `name` table (written atomically; one writer at
    a time, so that two processes storing different keys at once both keep theirs)."""
    update_measurement(name, key, lambda _old: value)


def update_measurement(name: str, key: str, change: Callable[[Any], Any], limit: int | None = None) -> None:
    """Replace the entry under `key` in the cache's `name` table by `change(entry)` (entry None
    where absent), read and written under the table's lock: two processes adding to one entry
    at once both count. `limit`: the most entries the table keeps, the least recently changed
    dropped first."""
    import json

    from filelock import FileLock

    from . import store

    path = store.cache_root() / name
    with FileLock(store.lock_path(f"table-{name}")):
        try:
            table = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            table = {}
        if not isinstance(table, dict):
            table = {}
        table[key] = change(table.pop(key, None))  # (last: the most recently changed)
        while limit is not None and len(table) > limit:
            del table[next(iter(table))]
        store.write_json(path, table)


def measured(name: str, key: str | None, usable: Callable[[Any], bool], measure: Callable[[], Any]) -> Any:
    """The measurement kept under `key` in the cache's `name` table, or `measure()` now where none
    is `usable` (then kept; `key` None: a model without a directory, measured and not kept). One
    process measures a key at a time: another that needs it meanwhile waits and reads what the
    first kept, instead of timing the same passes beside it, each slowed by the other."""
    if key is None:
        return measure()
    entry = stored(name, key)
    if usable(entry):
        return entry
    from filelock import FileLock

    from . import store

    with FileLock(store.lock_path("measure-" + hashlib.sha256(f"{name}|{key}".encode()).hexdigest()[:24])):
        entry = stored(name, key)  # (kept by the process this one waited for)
        if not usable(entry):
            entry = measure()
            store_measurement(name, key, entry)
    return entry


# v3: per row count the median of its time relative to the same round's one-row pass, times
# the median one-row pass, monotone in rows (`_time_rows`); earlier versions' tables (the
# fastest round, v2; medians, v1) are not read
PASS_COSTS_FILE = "pass_costs-v3.json"
PASS_TABLES = per_model(memory=False)  # the table this process decides by, per target


def pass_costs(target: Transformer, max_rows: int) -> Costs:
    """The target's pass time per row count on this machine, timed once and kept in the
    specdec cache (`PASS_COSTS_FILE`), keyed by `machine_key`: a drafter that sizes its
    proposals by it pays the timing (a few seconds) once per machine, not once per process.
    Re-timed where the key or the row range is new."""
    max_rows = max(1, min(max_rows, target.args.max_seq_len - 1))  # (a pass and its context fit the model's)
    known = PASS_TABLES.get(target)
    if known is not None and max(known.target_ms) >= max_rows:
        return known
    # every row count a chain of up to PRICED_K drafts can bring (the pass time is not linear in
    # the rows: the q4k kernel's cost jumps between some counts), then sparser
    rows = sorted(r for r in {*range(1, PRICED_K + 2), 12, 16, 24, 32, max_rows} if r <= max_rows)

    def timed() -> dict[str, float]:  # (rounded as stored: this process decides on the numbers later ones read)
        return {str(r): round(ms, 3) for r, ms in _time_rows(target, rows, context=128, repeats=7).items()}

    # (a wider table serves a narrower request: it is interpolated past PRICED_K + 1)
    entry = measured(PASS_COSTS_FILE, machine_key(target), lambda e: _covers(e, rows), timed)
    costs = Costs({int(r): float(ms) for r, ms in entry.items()})
    PASS_TABLES[target] = costs
    return costs


def _covers(entry: Any, rows: list[int]) -> bool:
    """Whether a stored table holds every row count up to PRICED_K + 1 that `rows` asks for and
    reaches at least as far as `rows` does."""
    if not isinstance(entry, dict) or not entry:
        return False
    try:
        have = {int(r) for r in entry}
    except ValueError:
        return False
    return {r for r in rows if r <= PRICED_K + 1} <= have and max(have) >= max(rows)


DRAFT_STEP_FILE = "draft_step-v1.json"
DRAFT_STEPS = per_model(memory=False)  # drafting steps run on a model: ms by what they depend on


def draft_step_ms(model: Transformer, key: str, step: Callable[[], None], reset: Callable[[], None]) -> float:
    """A drafter's own step as it runs (`step`, after `reset` puts its state back), timed like
    the pass table (the median of a few rounds, after a warm-up) once per machine and kept in
    the specdec cache (`DRAFT_STEP_FILE`) under `machine_key(model)` and `key` (what else the
    step depends on: a draft vocabulary's size)."""
    known: dict[str, float] = DRAFT_STEPS.of(model, dict)
    if key in known:
        return known[key]
    mk = machine_key(model)

    def timed() -> float:
        times = []
        for i in range(8):
            reset()
            t0 = time.perf_counter()
            step()
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(times), 3)  # (as stored: see pass_costs)

    ms = measured(
        DRAFT_STEP_FILE, f"{mk}|{key}" if mk is not None else None, lambda e: isinstance(e, (int, float)), timed
    )
    known[key] = float(ms)
    return known[key]


def head_call_ms(target: Transformer, what: str, weights: Iterable[torch.Tensor], call: Callable[[], None]) -> float:
    """One call of a drafter's own network over one row (`call`: a trained head's), timed like
    `draft_step_ms`, once per machine, keyed by `what` and a fingerprint of the network's
    `weights` (shapes and a sample of values: another training run is another network)."""
    h = hashlib.sha256()
    for w in weights:
        flat = w.detach().reshape(-1)
        h.update(str(tuple(w.shape)).encode())
        h.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    return draft_step_ms(target, f"{what}:{h.hexdigest()[:16]}", call, lambda: None)


def observe_pass(target: Transformer, rows: int, ms: float) -> None:
    """The engine's measured pass time for `rows` decode rows of `target`: followed by the cost
    table this process uses for it (`pass_costs`), if any."""
    costs = PASS_TABLES.get(target)
    if costs is not None:
        costs.observe(rows, ms)


def batch_drafting_pays(costs: Costs, batch: int, k: float, alpha: float, draft_ms_per_token: float = 0.0) -> bool:
    """Several sequences decoding in one target pass (a server's continuous batch): does
    drafting `k` tokens each, accepted at rate `alpha` each, commit more tokens per ms than a
    plain step for all of them? A plain step commits `batch` tokens in a pass over `batch`
    rows; a drafting step batch * E(alpha, k) in a pass over batch * (1 + k) rows plus the
    drafting. One row costs about as much as a few (the pass is memory-bound), so drafting
    pays for a small batch; a large batch already fills the pass with rows, and each drafted
    row then costs its full compute. With one sequence its own chooser decides (True here)."""
    if batch <= 1 or k <= 0:
        return True
    alpha = min(max(alpha, 0.0), 1.0)
    expected = expected_tokens(alpha, int(round(k)))
    plain = batch / costs.rows(batch)
    drafting = batch * expected / (costs.rows(int(round(batch * (1 + k)))) + batch * k * draft_ms_per_token)
    return drafting > plain
