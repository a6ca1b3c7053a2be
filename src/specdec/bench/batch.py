"""`specdec bench batch`: aggregate throughput with several sequences in flight.

For each batch size B, B different prompts of the suite (one per category in turn) are
decoded together by the engine (one target pass per step for all of them), greedy, once per
method, plain decoding among them, on the same prompts (the order reversed every other
repeat), so each speedup is a ratio measured side by side. Aggregate tokens/s is every
sequence's new tokens over the wall time of the whole batch (prefills included). Every
method's output is checked against plain decoding, sequence by sequence.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import registry
from ..api import LoadedModel, build_drafter, load, load_draft
from ..config import DEFAULT_K, GenerationConfig, SamplingParams
from ..drafters.base import uses_draft_model
from ..engine import Engine
from . import save_figure, write_page
from .grid import machine, pool_of, prompt_ids
from .suite import load_prompts

PLAIN = "plain"
METHODS = (PLAIN, "draft-model", "prompt-lookup")


@dataclass(frozen=True)
class BatchSettings:
    target: str = registry.DEFAULT_TARGET
    draft: str | None = None  # None: the registry's pair for the target, else the target itself
    batches: tuple[int, ...] = (1, 2, 4, 8)
    methods: tuple[str, ...] = METHODS
    k: int = DEFAULT_K
    max_new_tokens: int = 64
    max_prompt_tokens: int = 512  # prompts longer than this are skipped (prefill would dominate)
    repeats: int = 1
    dtype: str = "auto"
    prompts_file: str | None = None

    def __post_init__(self) -> None:
        from ..drafters import DRAFTERS

        bad = [m for m in self.methods if m != PLAIN and m not in DRAFTERS]
        if bad or not self.methods:
            raise ValueError(f"unknown methods {bad}; choose from {PLAIN}, {', '.join(DRAFTERS)}")
        if not self.batches or min(self.batches) < 1:
            raise ValueError("batch sizes must be >= 1")
        if min(self.k, self.max_new_tokens, self.repeats, self.max_prompt_tokens) < 1:
            raise ValueError("k, max_new_tokens, repeats and max_prompt_tokens must be >= 1")


@dataclass
class BatchRun:
    method: str
    batch: int
    tokens: int  # new tokens, all sequences
    seconds: float  # wall time of the whole batch
    steps: int  # engine steps
    identical: bool | None  # every sequence equals plain decoding (None for plain itself)
    acceptance_rate: float | None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


@dataclass
class BatchResult:
    settings: BatchSettings
    machine: dict[str, Any]
    mode: str
    draft: str | None
    prompt_ids: list[str]
    runs: list[BatchRun] = field(default_factory=list)

    def summary(self) -> list[dict[str, Any]]:
        """Per batch size and method: median aggregate tokens/s over repeats, speedup over
        plain decoding at that batch size (median of the per-repeat ratios, and their band)."""
        rows = []
        for b in self.settings.batches:
            plain = [r for r in self.runs if r.batch == b and r.method == PLAIN]
            for m in self.settings.methods:
                rs = [r for r in self.runs if r.batch == b and r.method == m]
                if not rs:
                    continue
                ratios = [r.tokens_per_second / p.tokens_per_second for r, p in zip(rs, plain, strict=False)]
                alphas = [r.acceptance_rate for r in rs if r.acceptance_rate is not None]
                same = [r.identical for r in rs if r.identical is not None]
                rows.append(
                    {
                        "batch": b,
                        "method": m,
                        "tokens_per_second": statistics.median(r.tokens_per_second for r in rs),
                        "speedup": statistics.median(ratios) if ratios else None,
                        "speedup_band": [min(ratios), max(ratios)] if ratios else None,
                        "acceptance_rate": statistics.median(alphas) if alphas else None,
                        "steps": statistics.median(r.steps for r in rs),
                        "identical": all(same) if same else None,
                    }
                )
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "machine": self.machine,
            "mode": self.mode,
            "draft": self.draft,
            "prompts": self.prompt_ids,
            "summary": self.summary(),
            "runs": [asdict(r) | {"tokens_per_second": r.tokens_per_second} for r in self.runs],
        }


def default_draft(target: str) -> str:
    """The registered draft for a target, else the target itself (a same-tokenizer draft that
    exercises the mechanics; it accepts everything and costs a full target pass)."""
    return registry.DEFAULT_DRAFT if target == registry.DEFAULT_TARGET else target


def run_batch(settings: BatchSettings, progress: Callable[[str], None] | None = None) -> BatchResult:
    say = progress or (lambda s: None)
    target = load(settings.target, dtype=settings.dtype)
    draft_name = settings.draft or default_draft(settings.target)
    draft = None
    if any(map(uses_draft_model, settings.methods)):
        draft = target if draft_name == settings.target else load_draft(draft_name, dtype=settings.dtype)
    suite = [p for p in load_prompts(settings.prompts_file) if len(prompt_ids(target, p)) <= settings.max_prompt_tokens]
    if not suite:
        raise ValueError(
            f"no prompt of the suite has at most {settings.max_prompt_tokens} tokens; raise --max-prompt-tokens"
        )
    # one per category in turn, so a batch mixes task kinds (and prompt lengths)
    cats: dict[str, list] = {}
    for p in suite:
        cats.setdefault(p.category, []).append(p)
    order = [ps[i] for i in range(max(map(len, cats.values()))) for ps in cats.values() if i < len(ps)]
    need = max(settings.batches)
    chosen = [order[i % len(order)] for i in range(need)]
    ids = [prompt_ids(target, p) for p in chosen]
    result = BatchResult(
        settings, machine(), target.model.mode, draft_name if draft is not None else None, [p.id for p in chosen]
    )
    cfg = GenerationConfig(max_new_tokens=settings.max_new_tokens, k=settings.k, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, seed=0)
    # warm-up: first-call costs, each method's own (a drafter's first build reads the draft's
    # vocabulary and tokenizer once per process), in memory no timed run shares
    for m in dict.fromkeys((PLAIN, *settings.methods)):
        _timed(target, [ids[0][:8]], replace(cfg, max_new_tokens=8), greedy, m, draft, pool_of("warm-up", 0))
    for rep in range(settings.repeats):
        for b in settings.batches:
            outs: dict[str, list[list[int]]] = {}
            # (every other repeat in the reverse order, A B B A: a machine that drifts within a
            # repeat favours no method)
            for m in settings.methods if rep % 2 == 0 else settings.methods[::-1]:
                say(f"batch {b}, {m}" + (f", repeat {rep + 1}" if settings.repeats > 1 else ""))
                # (each run's drafters start from memory of their own: a repeat must not copy what the
                # last one wrote, suffix decoding would)
                run, outs[m] = _timed(target, ids[:b], cfg, greedy, m, draft, pool_of(f"batch-{b}-{m}", rep))
                result.runs.append(run)
            for run in result.runs[-len(outs) :]:
                if run.method != PLAIN and PLAIN in outs:
                    run.identical = outs[run.method] == outs[PLAIN]
    return result


def _timed(
    target: LoadedModel,
    ids: list[list[int]],
    cfg: GenerationConfig,
    sampling: SamplingParams,
    method: str,
    draft: LoadedModel | None,
    pool: str = "",
) -> tuple[BatchRun, list[list[int]]]:
    engine = Engine(target.model, target.tokenizer)
    t0 = time.perf_counter()
    sids = [
        engine.add(
            p,
            cfg,
            sampling,
            None if method == PLAIN else build_drafter(target, draft if uses_draft_model(method) else None, method),
            drafter_pool=pool,
        )
        for p in ids
    ]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - t0
    results = [engine.result(s) for s in sids]
    proposed = sum(r.metrics.proposed for r in results)
    alpha = sum(r.metrics.accepted for r in results) / proposed if proposed else None
    run = BatchRun(method, len(ids), sum(len(r.token_ids) for r in results), seconds, steps, None, alpha)
    return run, [r.token_ids for r in results]


def table(result: BatchResult) -> str:
    cols = f"{'tok/s':>8s} {'speedup':>8s} {'band':>11s} {'alpha':>6s} {'steps':>6s}"
    head = f"{'batch':>5s} {'method':14s} {cols} identical"
    lines = [
        f"{result.settings.target} ({result.mode})" + (f", draft {result.draft}" if result.draft else ""),
        head,
        "-" * len(head),
    ]
    for r in result.summary():
        sp = "–" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        band = "–" if r["speedup_band"] is None else "{:.2f}-{:.2f}".format(*r["speedup_band"])
        al = "–" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        same = "–" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        lines.append(
            f"{r['batch']:5d} {r['method']:14s} {r['tokens_per_second']:8.1f} {sp:>8s} {band:>11s} {al:>6s} "
            f"{r['steps']:6.0f} {same}"
        )
    return "\n".join(lines)


def write(result: BatchResult, out_dir: Path) -> list[Path]:
    """batch.json, batch.png (aggregate tokens/s and speedup by batch size) and batch.html (the
    table and the plot as one page)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "batch.json"
    path.write_text(json.dumps(result.to_dict(), indent=1))
    rows = result.summary()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for n, m in enumerate(result.settings.methods):
        rs = [r for r in rows if r["method"] == m]
        style = {"marker": "o", "label": m, "color": f"C{n}"}  # one colour per method in both panels
        ax1.plot([r["batch"] for r in rs], [r["tokens_per_second"] for r in rs], **style)
        if m != PLAIN:
            ax2.plot([r["batch"] for r in rs], [r["speedup"] for r in rs], **style)
    ax1.set(xlabel="batch size (sequences in flight)", ylabel="aggregate tokens/s", title="throughput")
    ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax2.set(
        xlabel="batch size (sequences in flight)",
        ylabel="speedup over plain decoding",
        title="speculative / plain, same batch size",
    )
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(result.settings.batches), [str(b) for b in result.settings.batches])
        ax.legend()
    fig.suptitle(f"{result.settings.target} ({result.mode}), {result.machine.get('cpu', '')}", fontsize=9)
    png = save_figure(fig, out_dir / "batch.png")
    page = write_page(out_dir, "batch.html", f"specdec bench batch: {result.settings.target}", table(result), png)
    print(f"wrote {path}\nwrote {png}\nwrote {page}", file=sys.stderr)
    return [path, png, page]
