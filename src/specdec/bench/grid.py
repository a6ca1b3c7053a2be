"""`specdec bench`: every method over a prompt suite, side by side with plain decoding.

Each prompt is read once, untimed, and every timed run of it starts from its cached rows
(`_prime`): what is timed is generation. For each prompt, temperature and repeat (a block),
plain decoding runs first and last, and every method between, in one order in one block and
the reverse in the next (ABBA over the repeats); each run is timed against the mean of the
block's two plain runs, and plain decoding runs once more among the methods (`plain-again`,
timed like one): the spread of its ratios is what noise alone does to a speedup in this run.
Between the blocks one round of the target's pass over every row count is timed
(`costs.PassClock`), and each run's passes by rows are priced from that table plus its
measured drafting time: its modelled speedup, which does not move with the neighbours.
Before the timed runs each method runs once, short and untimed, so what it does once per
process or machine (early exit's calibration, loading a head, first calls of new row counts)
is reported as its first-use time instead of landing in the first category's speedup.
Results are kept per run (`records`) and summarised per method, temperature and category:
median speedup with its band, pooled acceptance α, tokens per pass τ, acceptance by draft
position and, for greedy runs, whether every output equalled plain decoding.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import registry
from ..adaptive import REPORT
from ..api import LoadedModel, build_drafter, encode_prompt, generate, load, load_draft, request, run_request
from ..config import DEFAULT_K
from ..costs import PRICED_K, Costs, PassClock, pass_costs
from ..drafters import DRAFTERS, heads, make_drafter, uses_draft_model
from ..drafters.base import draft_model_method, method_default_k, needs_draft_model
from ..engine import PREFIXES, GenerationResult
from ..version import __version__
from .costmodel import Acceptance, Recommendation, recommend
from .suite import Prompt, load_prompts, select

METHODS = tuple(DRAFTERS)  # every registered drafter
TRAINED = tuple(m for m in METHODS if DRAFTERS[m].head)  # drafters that need heads trained for the target
# the default: every drafter that needs nothing trained for the target (the CLI adds the
# trained ones where heads ship for the target: `shipped`)
DEFAULT_METHODS = tuple(m for m in METHODS if m not in TRAINED)


def shipped(method: str, target: str) -> bool:
    """Whether `method` runs on `target` without a head given: it needs none, or one ships."""
    kind = DRAFTERS[method].head
    return kind is None or heads.shipped(kind, name=target) is not None


NOISE = "plain-again"  # the noise control: plain decoding again, timed against the first plain run
WARM_UP_TOKENS = 8


@dataclass(frozen=True)
class GridSettings:
    target: str = registry.DEFAULT_TARGET
    draft: str | None = registry.DEFAULT_DRAFT  # for the draft-model method
    methods: tuple[str, ...] = DEFAULT_METHODS
    temperatures: tuple[float, ...] = (0.0, 1.0)
    k: int | None = None  # None: each method's default (`DrafterSpec.default_k`, else DEFAULT_K)
    max_new_tokens: int = 128
    repeats: int = 3
    seed: int = 0
    per_category: int | None = None  # None: every prompt
    categories: tuple[str, ...] | None = None
    prompts_file: str | None = None  # None: the bundled suite
    dtype: str = "auto"
    peers: bool = True  # where installed: transformers and llama.cpp on the same prompts (greedy)
    adaptive_k: bool = True  # the methods as shipped (never-slower guard on); False: k drafts every step
    noise_control: bool = True  # plain decoding again after the methods (NOISE): the run's noise floor
    draft_bits: int | None | str = "default"  # the draft's packing (`api.load_draft`)
    draft_vocab: int | None = None  # the draft's vocabulary (draft-model, auto); None: the drafter's default

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
        if any(map(needs_draft_model, self.methods)) and not self.draft:
            raise ValueError("the draft-model method needs a draft model (--draft NAME)")
        if (self.k is not None and self.k < 1) or self.max_new_tokens < 1 or self.repeats < 1:
            raise ValueError("k, max_new_tokens and repeats must be >= 1")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError("temperatures must be >= 0 (0 = greedy)")
        if self.per_category is not None and self.per_category < 1:
            raise ValueError("per_category must be >= 1")

    @property
    def chain_k(self) -> int:
        """k of the chain drafters, the peers and the cost model's predictions."""
        return self.k if self.k is not None else DEFAULT_K

    def k_for(self, method: str) -> int:
        """The k `method` runs with: the one given, else the method's own default."""
        return self.k if self.k is not None else method_default_k(method)


# one prompt per category, short outputs, three repeats in alternating order
QUICK = {"per_category": 1, "max_new_tokens": 40, "repeats": 3}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    from ..model.native import cpu_info

    cpu = cpu_info().get("model name") or platform.processor()
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    import transformers

    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdec": __version__,
        "git_commit": commit,
    }


def prompt_ids(model: LoadedModel, prompt: Prompt) -> list[int]:
    """The chat template when the model has one; else the turns' texts joined as plain text."""
    if model.tokenizer.has_chat_template:
        return encode_prompt(model.tokenizer, list(prompt.turns))
    text = "\n\n".join(f"{t['role']}: {t['content']}" for t in prompt.turns) + "\n\nassistant:"
    return model.tokenizer.encode(text)


def _per_token(m: Any, decode: bool = False) -> float:
    """Seconds per generated token (`decode`: after the prefill)."""
    return (m.wall_time - (m.prefill_time if decode else 0.0)) / max(m.new_tokens, 1)


def _record(
    prompt: Prompt,
    method: str,
    temp: float,
    repeat: int,
    seed: int,
    res: GenerationResult,
    plains: tuple[GenerationResult, GenerationResult],
    position: int,
) -> dict[str, Any]:
    """One timed run against the plain runs that bracket its block (`plains`: the first and the
    last run of the block; their mean time per token is the reference, so a machine that drifts
    during the block moves both sides alike)."""
    m, p = res.metrics, plains[0].metrics
    ref = statistics.fmean(_per_token(x.metrics) for x in plains)
    ref_decode = statistics.fmean(_per_token(x.metrics, decode=True) for x in plains)
    mine, mine_decode = _per_token(m), _per_token(m, decode=True)

    def passes(mm: Any) -> dict[str, int]:
        return {str(r): len(ms) for r, ms in sorted(mm.pass_ms.items())}

    return {
        "prompt_id": prompt.id,
        "category": prompt.category,
        "method": method,
        "temperature": temp,
        "repeat": repeat,
        "seed": seed,
        "position": position,
        "prompt_tokens": m.prompt_tokens,
        "cached_tokens": m.cached_tokens,
        "new_tokens": m.new_tokens,
        "tokens_per_second": m.tokens_per_second,
        "plain_tokens_per_second": 1.0 / ref if ref > 0 else None,
        "speedup": ref / mine if mine > 0 else None,
        "decode_speedup": ref_decode / mine_decode if mine_decode > 0 else None,
        "acceptance_rate": m.acceptance_rate,
        "mean_accepted_tokens": m.mean_accepted_tokens,
        "steps": m.steps,
        "proposed": m.proposed,
        "accepted": m.accepted,
        "step_tokens": m.step_tokens,
        "scored_rows": m.scored_rows,
        "proposed_per_position": m.proposed_per_position,
        "accepted_per_position": m.accepted_per_position,
        "identical": res.token_ids == plains[0].token_ids if temp == 0 else None,
        "drafter_info": m.drafter_info,
        "draft_ms_per_token": m.draft_ms_per_token,
        "target_ms_by_rows": m.target_ms_by_rows,
        # what the modelled speedup prices (`model_speedups`): the passes by rows, the drafting
        # time, the prefill (the plain reference's, the same rows on both sides)
        "passes": passes(m),
        "draft_seconds": m.draft_time,
        "plain_passes": passes(p),
        "plain_new_tokens": p.new_tokens,
        "prefill_seconds": statistics.fmean(x.metrics.prefill_time for x in plains),
        # the block's one-row pass at this prompt's context (the plain runs' median pass, ~2 x
        # new_tokens of them): what a row costs after this prompt, against the table's context
        "plain_pass_ms": statistics.median(ms)
        if (ms := [t for x in plains for t in x.metrics.pass_ms.get(1, [])])
        else None,
        "modelled_speedup": None,
    }


def model_speedups(records: list[dict[str, Any]], costs: Costs) -> None:
    """Each record's modelled speedup: both sides' passes by rows priced from `costs` (the pass
    table measured interleaved with the runs, at a context of 128 tokens, not pooled), scaled to the
    prompt's context by the block's median one-row plain pass, plus the method's measured
    drafting time, plus the same prefill. Greedy counts are deterministic, so this figure does
    not move with the neighbours the way a run's clock does. (Unscaled, the passes after a long
    prompt were priced as after 128 tokens, too cheap against the drafting time, and the model
    read below the clock for the draft model: docs/results.md.)"""
    for r in records:
        if not r.get("passes") or r["method"].startswith("peer:"):
            continue
        scale = r["plain_pass_ms"] / costs.rows(1) if r.get("plain_pass_ms") else 1.0

        def price(passes: dict[str, int], scale: float = scale) -> float:
            return scale * sum(n * costs.rows(int(rows)) for rows, n in passes.items())

        prefill = 1e3 * r["prefill_seconds"]
        mine = prefill + price(r["passes"]) + 1e3 * r["draft_seconds"]
        plain = prefill + price(r["plain_passes"])
        if mine > 0 and r["new_tokens"] and r["plain_new_tokens"]:
            r["modelled_speedup"] = (plain / r["plain_new_tokens"]) / (mine / r["new_tokens"])


@dataclass
class GridResult:
    settings: GridSettings
    machine: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    wall_time: float = 0.0
    costs: Costs | None = None  # measured pass times (the cost model's input), monotone in rows
    priced: Costs | None = None  # the same rounds as measured, not pooled: what the modelled speedups price
    peers_skipped: dict[str, str] = field(default_factory=dict)  # peer -> why it did not run
    mode: str = ""  # the precision/kernel mode the target ran in ("auto" resolved)
    first_use: dict[str, float] = field(default_factory=dict)  # method -> seconds of its untimed warm-up runs

    def recommendations(self) -> list[Recommendation]:
        """Cost-model predictions vs measurements and the best k, per method, temperature and
        category (plus "all"). Early exit is left out: its drafter predicts and picks its own
        layer from its calibration."""
        if self.costs is None:
            return []
        out = []
        for r in self.summary():
            if r["method"] in ("early-exit", NOISE) or r["method"].startswith("peer:"):
                continue
            rs = [
                x
                for x in self.records
                if x["method"] == r["method"]
                and x["temperature"] == r["temperature"]
                and (r["category"] == "all" or x["category"] == r["category"])
            ]
            out.append(recommend(r["method"], r["temperature"], r["category"], rs, self.costs, self.settings.chain_k))
        return out

    def auto_choices(self) -> list[dict[str, Any]]:
        """How often `auto` chose each drafter (and k) or a plain step, per temperature and
        category (plus "all"): shares of its steps, summed over the runs."""
        rows = []
        auto = [r for r in self.records if r["method"] == "auto" and REPORT in (r.get("drafter_info") or {})]
        for temp in sorted({r["temperature"] for r in auto}):
            cats = sorted({r["category"] for r in auto if r["temperature"] == temp})
            for cat in [*cats, "all"]:
                steps: dict[str, dict[str, int]] = {}
                for r in auto:
                    if r["temperature"] == temp and cat in (r["category"], "all"):
                        for m, ks in r["drafter_info"][REPORT]["steps"].items():
                            for k, n in ks.items():
                                steps.setdefault(m, {}).setdefault(k, 0)
                                steps[m][k] += n
                total = sum(n for ks in steps.values() for n in ks.values())
                share = {m: sum(ks.values()) / total for m, ks in steps.items()} if total else {}
                rows.append({"temperature": temp, "category": cat, "steps": total, "share": share, "by_k": steps})
        return rows

    def summary(self) -> list[dict[str, Any]]:
        """One row per (method, temperature, category), plus category "all"."""
        rows = []
        keys = sorted(
            {(r["method"], r["temperature"], r["category"]) for r in self.records},
            key=lambda k: (_order(k[0]), k[1], k[2]),
        )
        groups = [
            (m, t, c, [r for r in self.records if (r["method"], r["temperature"], r["category"]) == (m, t, c)])
            for m, t, c in keys
        ]
        for m, t in sorted({(m, t) for m, t, _ in keys}, key=lambda k: (_order(k[0]), k[1])):
            groups.append((m, t, "all", [r for r in self.records if (r["method"], r["temperature"]) == (m, t)]))
        for method, temp, cat, rs in groups:
            rows.append(summarise(rs, cells=cat == "all") | {"method": method, "temperature": temp, "category": cat})
        return rows

    def to_dict(self) -> dict[str, Any]:
        recs = [asdict(r) for r in self.recommendations()]
        costs = None if self.costs is None else asdict(self.costs)
        priced = None if self.priced is None else self.priced.target_ms
        return {
            "settings": asdict(self.settings),
            "mode": self.mode,
            "machine": self.machine,
            "wall_time": self.wall_time,
            "costs": costs,
            "modelled_pass_ms": priced,
            "peers_skipped": self.peers_skipped,
            "first_use_seconds": self.first_use,
            "summary": self.summary(),
            "cost_model": recs,
            "auto_choices": self.auto_choices(),
            "records": self.records,
        }


def _order(method: str) -> int:
    """Our methods in METHODS order, the noise control, then the peers in theirs."""
    from .peers import PEERS

    if method in METHODS:
        return METHODS.index(method)
    if method == NOISE:
        return len(METHODS)
    return len(METHODS) + 1 + PEERS.index(method.removeprefix("peer:"))


def summarise(rs: list[dict[str, Any]], cells: bool = False) -> dict[str, Any]:
    """Median speedups with their band; α, τ and per-position acceptance pooled over the runs.
    One cell (a category's runs): the band is the lowest and highest run's ratio. `cells`
    (a method over several categories): the median is that of the categories' medians, and
    its band a bootstrap 90% interval (runs resampled within their category, seeded)."""
    proposed, accepted = sum(r["proposed"] for r in rs), sum(r["accepted"] for r in rs)
    steps, step_tokens = sum(r["steps"] for r in rs), sum(r["step_tokens"] for r in rs)
    pooled = Acceptance.pool(rs)  # per-position counts, summed over the runs
    greedy = [r["identical"] for r in rs if r["identical"] is not None]
    speed, band = _median_band(rs, "speedup", cells)
    modelled, _ = _median_band(rs, "modelled_speedup", cells)
    decode, _ = _median_band(rs, "decode_speedup", cells)
    return {
        "runs": len(rs),
        "speedup": speed,
        "speedup_band": band,
        # the band holds 1.0: this run cannot tell the method from plain decoding
        "no_difference": band is not None and band[0] <= 1.0 <= band[1],
        "modelled_speedup": modelled,
        "measured_over_modelled": speed / modelled if speed and modelled else None,
        "decode_speedup": decode,
        "tokens_per_second": statistics.median(tps)
        if (tps := [r["tokens_per_second"] for r in rs if r["tokens_per_second"] is not None])
        else None,
        "errors": sum(1 for r in rs if r.get("error")),
        "plain_tokens_per_second": statistics.median(x)
        if (x := [r["plain_tokens_per_second"] for r in rs if r["plain_tokens_per_second"]])
        else None,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_tokens": step_tokens / steps if steps else None,
        "acceptance_by_position": [a / p if p else None for a, p in zip(pooled.accepted, pooled.proposed, strict=True)],
        "identical": all(greedy) if greedy else None,
    }


BOOTSTRAP = 1000  # resamples of a method's band over categories


def _median_band(rs: list[dict[str, Any]], key: str, cells: bool) -> tuple[float | None, list[float] | None]:
    """The median of `key` over `rs` and its band (None: no value; the band also None for a
    single run, which has none)."""
    if not cells:
        xs = [r[key] for r in rs if r.get(key) is not None]
        if not xs:
            return None, None
        return statistics.median(xs), ([min(xs), max(xs)] if len(xs) > 1 else None)
    groups: dict[tuple, list[float]] = {}
    for r in rs:
        if r.get(key) is not None:
            groups.setdefault((r["category"], r["prompt_id"]), []).append(r[key])
    if not groups:
        return None, None
    values = list(groups.values())
    mid = statistics.median(statistics.median(g) for g in values)
    if all(len(g) == 1 for g in values):  # (single runs: nothing to resample)
        return mid, None
    rng = np.random.default_rng(0)
    # every resample at once: per cell, BOOTSTRAP draws of its runs with replacement and their
    # medians (one call per cell: drawn one resample at a time in Python, a grid's summary took
    # tens of seconds); then each resample's median over the cells
    cell_medians = [np.median(np.asarray(g)[rng.integers(0, len(g), size=(BOOTSTRAP, len(g)))], axis=1) for g in values]
    boot = np.median(np.stack(cell_medians), axis=0)  # [BOOTSTRAP]
    return mid, [float(np.quantile(boot, 0.05)), float(np.quantile(boot, 0.95))]


def _draft_options(settings: GridSettings, method: str) -> dict[str, Any]:
    return {"vocab": settings.draft_vocab} if settings.draft_vocab is not None and uses_draft_model(method) else {}


def run_grid(
    settings: GridSettings,
    target: LoadedModel | None = None,
    draft: LoadedModel | None = None,
    progress: Callable[[str], None] | None = None,
) -> GridResult:
    """Run the grid. `target`/`draft` may be passed already loaded (else loaded by name)."""
    from tqdm import tqdm

    prompts = select(
        load_prompts(settings.prompts_file),
        list(settings.categories) if settings.categories else None,
        settings.per_category,
    )
    target = target or load(settings.target, dtype=settings.dtype)
    if any(map(needs_draft_model, settings.methods)) or (
        settings.draft and any(map(uses_draft_model, settings.methods))
    ):
        draft = draft or load_draft(settings.draft, dtype=settings.dtype, bits=settings.draft_bits)  # type: ignore[arg-type]
    result = GridResult(settings, machine(), mode=target.model.mode)
    generate(target, [1, 2, 3, 4], max_new_tokens=2, ignore_eos=True)  # warm-up: first-call costs
    _warm_up(settings, target, draft, prompts, result)
    order = [*settings.methods, *([NOISE] if settings.noise_control else [])]
    total = len(prompts) * len(settings.temperatures) * settings.repeats * (2 + len(order))
    clock = PassClock(target.model, CLOCK_ROWS)
    clock.round(keep=False)
    t0 = time.perf_counter()
    plains: dict[tuple[str, int], GenerationResult] = {}  # greedy plain runs, the peers' reference
    with tqdm(total=total, desc="specdec bench", unit="run", file=sys.stderr, disable=progress is None) as bar:
        for rep in range(settings.repeats):
            for i, prompt in enumerate(prompts):
                ids = prompt_ids(target, prompt)
                _prime(target, draft, ids)
                for temp in settings.temperatures:
                    seed = settings.seed + 1000 * rep + i
                    common = dict(
                        max_new_tokens=settings.max_new_tokens, temperature=temp, seed=seed, context_overflow="truncate"
                    )

                    # (bound as defaults: the closure must see this iteration's values)
                    def run(
                        method: str | None, prompt=prompt, temp=temp, ids=ids, common=common, rep=rep
                    ) -> GenerationResult:
                        bar.set_postfix_str(f"{prompt.id} T={temp} {method or 'plain'}")
                        if method is None or method == NOISE:
                            out = run_request(target, request(target, ids, **common), prefix_tokens=PREFIX_TOKENS)
                        else:
                            # a fresh drafter per run, with its default options (early exit's
                            # calibration is kept per target: done in the warm-up)
                            drafter = build_drafter(
                                target,
                                draft if uses_draft_model(method) else None,
                                method,
                                **_draft_options(settings, method),
                            )
                            # what a drafter learns from earlier requests (suffix decoding's
                            # outputs) comes from this method's runs on this repeat's earlier
                            # prompts, never from this prompt's answer by another method (auto's
                            # suffix member runs the same prompt too)
                            req = request(
                                target,
                                ids,
                                drafter=drafter,
                                k=settings.k_for(method),
                                adaptive_k=settings.adaptive_k,
                                **common,
                            )
                            req = dataclasses.replace(req, drafter_pool=pool_of(method, rep))
                            out = run_request(target, req, prefix_tokens=PREFIX_TOKENS)
                        bar.update()
                        return out

                    # plain decoding brackets the block; the methods run between, in one order on
                    # even blocks and the reverse on odd ones (ABBA over the repeats), so that no
                    # method always runs nearest the reference or furthest from it
                    block = order if (rep + i) % 2 == 0 else order[::-1]
                    first = run(None)
                    runs = [(m, run(m)) for m in block]
                    last = run(None)
                    if temp == 0.0:
                        plains[(prompt.id, rep)] = first
                    for pos, (m, res) in enumerate(runs):
                        result.records.append(_record(prompt, m, temp, rep, seed, res, (first, last), pos + 1))
                    clock.round()  # the pass table, measured between the blocks it prices
    result.costs = Costs(clock.table())
    result.priced = Costs(clock.table(pooled=False))
    PREFIXES.pop(target.model, None)  # (the prompts' rows: not kept past the suite)
    model_speedups(result.records, result.priced)
    drafting = draft_model_method()
    draft_ms = (
        make_drafter(drafting, draft=draft.model, **_draft_options(settings, drafting)).cost_ms()
        if draft is not None
        else None
    )
    if draft_ms:  # (timed once per machine, at another moment: moved as the target's pass moved since)
        result.costs.draft_ms = draft_ms * result.costs.target_ms[1] / pass_costs(target.model, 2).target_ms[1]
    if settings.peers and 0.0 in settings.temperatures:
        _run_peers(settings, target, draft, prompts, plains, result, bar_progress=progress)
    result.wall_time = time.perf_counter() - t0
    return result


# the row counts the interleaved pass table times (`PassClock`): every chain up to PRICED_K, then
# sparser up to the largest trees; past the last, `Costs.rows` extends the slope
CLOCK_ROWS = [*range(1, PRICED_K + 2), 12, 16, 24, 32, 48, 64]
# the prompts' rows a suite keeps (`model.prefix`): each prompt is read once, untimed (`_prime`),
# and every timed run of it copies those rows, so what is timed is generation alone
PREFIX_TOKENS = 8192


def _prime(target: LoadedModel, draft: LoadedModel | None, ids: list[int]) -> None:
    """Read a prompt once, untimed, before its timed runs: the target's rows go to its prefix
    store (where its rows are bitwise what a prefill computes: `Transformer.rows_bitwise`;
    elsewhere every run reads the prompt itself) and the draft model's prefill of it is kept
    (`state.prefilled`), so no timed run pays a prompt that another did not."""
    run_request(
        target, request(target, ids, max_new_tokens=1, context_overflow="truncate"), prefix_tokens=PREFIX_TOKENS
    )
    if draft is not None:
        run_request(
            target,
            request(
                target, ids, assistant_model=draft, max_new_tokens=2, k=1, adaptive_k=False, context_overflow="truncate"
            ),
            prefix_tokens=PREFIX_TOKENS,
        )


def _warm_up(
    settings: GridSettings, target: LoadedModel, draft: LoadedModel | None, prompts: list[Prompt], result: GridResult
) -> None:
    """Each method once per temperature, short and untimed, on the shortest prompt: what it does
    once per process or machine (early exit's calibration, a head's loading and quantizing,
    the kernels' first calls for its row counts) goes to `result.first_use` instead of into
    the first category's speedup. What the warm-up taught the acceptance memory is dropped."""
    from ..runtime import forget

    ids = min((prompt_ids(target, p) for p in prompts), key=len)
    for method in settings.methods:
        t0 = time.perf_counter()
        for temp in settings.temperatures:
            generate(
                target,
                ids,
                drafter=method,
                assistant_model=draft if uses_draft_model(method) else None,
                k=settings.k_for(method),
                max_new_tokens=WARM_UP_TOKENS,
                temperature=temp,
                seed=settings.seed,
                context_overflow="truncate",
                adaptive_k=settings.adaptive_k,
                **_draft_options(settings, method),
            )
        result.first_use[method] = time.perf_counter() - t0
    forget(target.model)


def _gguf_for(name: str) -> Path | None:
    if name in registry.MODELS:
        from .. import store

        return store.gguf_path(registry.MODELS[name])
    path = Path(name)
    return path if path.suffix == ".gguf" else None


def _run_peers(
    settings: GridSettings,
    target: LoadedModel,
    draft: LoadedModel | None,
    prompts: list[Prompt],
    plains: dict[tuple[str, int], GenerationResult],
    result: GridResult,
    bar_progress: Callable[[str], None] | None,
) -> None:
    """Peers, greedy, on the same prompts; speedups relative to specdec's plain decoding in this run."""
    from . import peers

    gguf = _gguf_for(settings.target)
    has_draft = draft is not None
    say = bar_progress or (lambda s: None)
    runs: dict[str, dict[tuple[str, int], peers.PeerRun]] = {}
    for peer in peers.PEERS:
        why = peers.unavailable(peer, has_draft=has_draft, gguf=gguf)
        if why is not None:
            result.peers_skipped[peer] = why
            say(f"peer {peer} skipped: {why}")
    wanted = [p for p in peers.PEERS if p not in result.peers_skipped]
    keys = [(p.id, rep) for rep in range(settings.repeats) for p in prompts]
    ids = {p.id: prompt_ids(target, p) for p in prompts}
    hf = [p for p in wanted if p.startswith("transformers")]
    if hf:
        say("peers: transformers (bf16)")
        tp = peers.TransformersPeers(target.path, draft.path if draft is not None else None, settings.chain_k)
        for peer in hf:
            runs[peer] = {key: tp.run(peer, ids[key[0]], settings.max_new_tokens) for key in keys}
        del tp
    for peer in [p for p in wanted if p.startswith("llama.cpp")]:
        say(f"peers: {peer}")
        eos = sorted(target.tokenizer.eos_ids)
        reqs = [
            {"id": f"{pid}#{rep}", "ids": ids[pid], "max_new_tokens": settings.max_new_tokens, "eos": eos}
            for pid, rep in keys
        ]
        got = peers.run_llama_cpp(gguf, peer.endswith("prompt-lookup"), reqs, settings.chain_k)  # type: ignore[arg-type]
        runs[peer] = {(pid, rep): got[f"{pid}#{rep}"] for pid, rep in keys}
    for peer in [p for p in wanted if p.startswith("llama-server")]:
        say(f"peers: {peer}")
        reqs = [{"id": f"{pid}#{rep}", "ids": ids[pid], "max_new_tokens": settings.max_new_tokens} for pid, rep in keys]
        draft_gguf = _gguf_for(settings.draft) if peer.endswith("speculative") and settings.draft else None
        got = peers.run_llama_server(gguf, draft_gguf, reqs, settings.chain_k)  # type: ignore[arg-type]
        runs[peer] = {(pid, rep): got[f"{pid}#{rep}"] for pid, rep in keys}
    by_id = {p.id: p for p in prompts}
    own = ("transformers", "llama.cpp", "llama-server")  # each family's plain decoding
    for peer, table in runs.items():
        own_plain = runs.get(next(k for k in own if peer.startswith(k)), {})
        for (pid, rep), run in table.items():
            plain = plains[(pid, rep)].metrics
            plain_tokens = plains[(pid, rep)].token_ids
            n = len(run.tokens) if run.tokens else 0
            tps = n / run.seconds if run.tokens and run.seconds > 0 else None
            base = own_plain.get((pid, rep))
            same = None
            if peer not in own and base is not None and base.tokens and run.tokens:
                same = run.tokens == base.tokens
            result.records.append(
                {
                    "prompt_id": pid,
                    "category": by_id[pid].category,
                    "method": "peer:" + peer,
                    "temperature": 0.0,
                    "repeat": rep,
                    "seed": None,
                    "prompt_tokens": len(ids[pid]),
                    "new_tokens": n,
                    "tokens_per_second": tps,
                    "plain_tokens_per_second": plain.tokens_per_second,
                    "speedup": tps / plain.tokens_per_second if tps and plain.tokens_per_second else None,
                    "decode_speedup": None,
                    "acceptance_rate": run.accepted / run.drafted if run.drafted else None,
                    "mean_accepted_tokens": None,
                    "identical_to_ours": run.tokens == plain_tokens if run.tokens else None,
                    "steps": 0,
                    "proposed": 0,
                    "accepted": 0,
                    "step_tokens": 0,
                    "scored_rows": 0,
                    "proposed_per_position": [],
                    "accepted_per_position": [],
                    "identical": same,
                    "drafter_info": {},
                    "error": run.error,
                }
            )


def pool_of(method: str, rep: int) -> str:
    """The memory a method's runs of one repeat share (`DraftSession.pool`)."""
    return f"{method}-repeat-{rep}"
