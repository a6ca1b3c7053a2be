"""Outputs of `specdec bench`: a terminal table, results.json, report.md (and report.html, the
same with its plots inside) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..drafters.base import needs_draft_model
from . import html, save_figure
from .grid import NOISE, GridResult


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _same(rows: list[dict[str, Any]]) -> str:
    flags = [r["identical"] for r in rows if r["identical"] is not None]
    return "–" if not flags else ("yes" if all(flags) else "NO")


def _band(r: dict[str, Any]) -> str:
    """'0.95-1.31' (the lowest and highest run; over categories a bootstrap interval), '–' for one run."""
    b = r.get("speedup_band")
    return "–" if not b else f"{b[0]:.2f}-{b[1]:.2f}"


NO_DIFFERENCE = "no measurable difference"  # a cell whose band holds 1.0


def table(result: GridResult) -> str:
    """Terminal table: one line per method, temperature and category; `~` marks a speedup whose
    band holds 1.0 (no measurable difference from plain decoding in this run)."""
    head = (
        f"{'method':13s} {'T':>4s} {'category':15s} {'runs':>4s} {'speedup':>9s} {'band':>10s} {'modelled':>8s} "
        f"{'alpha':>6s} {'tau':>5s} {'tok/s':>7s} {'plain':>7s} identical"
    )
    lines = [head, "-" * len(head)]
    for r in result.summary():
        mark = "~" if r.get("no_difference") else " "
        lines.append(
            f"{r['method']:13s} {r['temperature']:4.1f} {r['category']:15s} {r['runs']:4d} "
            f"{mark}{_fmt(r['speedup'], '.2f', 'x'):>8s} {_band(r):>10s} "
            f"{_fmt(r.get('modelled_speedup'), '.2f', 'x'):>8s} "
            f"{_fmt(r['acceptance_rate']):>6s} {_fmt(r['mean_accepted_tokens']):>5s} "
            f"{_fmt(r['tokens_per_second'], '.1f'):>7s} {_fmt(r['plain_tokens_per_second'], '.1f'):>7s} "
            f"{_same([r])}"
        )
    lines.append(
        f"~ : the band holds 1.0 ({NO_DIFFERENCE} from plain decoding in this run); band: lowest-highest "
        "run of a category, over all categories a bootstrap 90% interval of the median of the categories' "
        "medians; modelled: the runs' passes priced from the pass table measured between them, plus "
        "measured drafting time"
    )
    lines += _auto_lines(result) + _first_use_lines(result)
    recs = [r for r in result.recommendations() if r.category == "all"]
    if recs:
        lines += ["", "cost model (all categories): measured vs predicted speedup at k, and the best k"]
        for r in recs:
            lines.append(
                f"  {r.method:13s} T={r.temperature:<4g} measured {_fmt(r.measured_speedup, '.2f', 'x')}"
                f"  predicted {r.predicted_speedup:.2f}x  best k {r.best_k} ({r.best_predicted:.2f}x)"
            )
    return "\n".join(lines)


def _first_use_lines(result: GridResult) -> list[str]:
    if not result.first_use:
        return []
    return [
        "",
        "first use (untimed warm-up runs before the suite: calibrations, head loading, first calls): "
        + ", ".join(f"{m} {s:.1f} s" for m, s in result.first_use.items()),
    ]


def _noise_note(result: GridResult) -> str:
    """What the plain-again control says about this run's noise."""
    again = [r["speedup"] for r in result.records if r["method"] == NOISE and r["speedup"] is not None]
    if not again:
        return ""
    return (
        f" `{NOISE}` is plain decoding run once more among the methods and timed like one: "
        f"its ratios ({min(again):.2f}–{max(again):.2f}× over {len(again)} runs here) are what noise alone "
        "does to a speedup in this run."
    )


def _choice(row: dict[str, Any]) -> str:
    """'plain 40%, prompt-lookup 55% (k=2 30, k=4 12), draft-model 5% (k=1 3)'."""
    parts = []
    for m, share in sorted(row["share"].items(), key=lambda t: -t[1]):
        ks = "" if m == "plain" else " (" + ", ".join(f"{k} {n}" for k, n in sorted(row["by_k"][m].items())) + ")"
        parts.append(f"{m} {share:.0%}{ks}")
    return ", ".join(parts)


def _auto_lines(result: GridResult) -> list[str]:
    rows = result.auto_choices()
    if not rows:
        return []
    lines = ["", "auto's choices: share of its steps per drafter (steps per k)"]
    for r in rows:
        lines.append(f"  T={r['temperature']:<4g} {r['category']:15s} {_choice(r)}")
    return lines


def markdown(result: GridResult, plots: list[str]) -> str:
    s, mach = result.settings, result.machine
    summary = result.summary()
    methods = list(dict.fromkeys(r["method"] for r in summary))
    cats = list(dict.fromkeys(r["category"] for r in summary if r["category"] != "all")) + ["all"]
    out = [
        f"# specdec benchmark: {s.target}" + (f" + {s.draft}" if any(map(needs_draft_model, s.methods)) else ""),
        "",
        f"Target `{s.target}`"
        + (f", draft `{s.draft}`" if any(map(needs_draft_model, s.methods)) else "")
        + f", mode `{result.mode}`, k = {s.chain_k} ("
        + ("adaptive: never-slower guard on" if s.adaptive_k else "fixed: k drafts every step")
        + f"), {s.max_new_tokens} new tokens, {s.repeats} repeat(s), seed {s.seed}.",
        f"Machine: {mach['cpu']} ({mach['cpu_count']} CPUs, {mach['torch_threads']} torch threads), "
        f"torch {mach['torch']}, transformers {mach['transformers']}, specdec {mach['specdec']}"
        + (f" @ {mach['git_commit'][:10]}" if mach.get("git_commit") else "")
        + f"; {result.wall_time / 60:.1f} min.",
        "",
        (
            "Speedup = specdec's plain decoding time per token / the method's, measured side by side in the same run:"
            " each prompt is read once, untimed, and every run of it starts from its cached rows (what is timed is"
            " generation); plain decoding runs first and last in each block of runs and the methods between, in"
            " alternating order over the repeats (ABBA), each timed against the mean of the two plain runs. A cell"
            " gives the median over its repeats and the band from the lowest to the highest; `all` the median of the"
            " categories' medians with a bootstrap 90% interval; a band that holds 1.0 is marked"
            f" *{NO_DIFFERENCE}* (≈). Modelled = the runs' target passes by rows priced from a pass table"
            " timed between the blocks of this run, plus the measured drafting time: it does not move with the"
            " neighbours as the clock does. α = accepted / proposed draft tokens; τ = tokens per target pass."
            " Peers (`peer:`, greedy only) are timed against the same plain decoding; their identity check is"
            " against their own plain decoding." + _noise_note(result)
        ),
        "",
    ]
    if result.first_use:
        out += [
            "Before the timed runs each method ran once per temperature, untimed, on the shortest prompt ("
            + ", ".join(f"{m} {s:.1f} s" for m, s in result.first_use.items())
            + "): what a method does once per process or machine (early exit's calibration, a head's loading,"
            " first calls of new row counts) is in these times, not in the speedups.",
            "",
        ]
    for temp in s.temperatures:
        rows = {(r["method"], r["category"]): r for r in summary if r["temperature"] == temp}
        out += [f"## Temperature {temp:g}" + (" (greedy)" if temp == 0 else ""), ""]
        out.append("| category | " + " | ".join(methods) + " |")
        out.append("|---|" + "---|" * len(methods))
        for c in cats:
            cells = []
            for m in methods:
                r = rows.get((m, c))
                if r is None:
                    cells.append("–")
                    continue
                if m.startswith("peer:"):
                    cell = f"{_fmt(r['speedup'], '.2f', '×')} ({_fmt(r['tokens_per_second'], '.1f')} tok/s)"
                    if r.get("errors"):
                        cell += f" {r['errors']} failed"
                else:
                    band = "" if not r.get("speedup_band") else f" [{_band(r)}]"
                    cell = (
                        f"{'≈' if r.get('no_difference') else ''}{_fmt(r['speedup'], '.2f', '×')}{band}, modelled "
                        f"{_fmt(r.get('modelled_speedup'), '.2f', '×')} (α {_fmt(r['acceptance_rate'])}, "
                        f"τ {_fmt(r['mean_accepted_tokens'])})"
                    )
                if temp == 0 and r["identical"] is False:
                    cell += " **not identical**"
                cells.append(cell)
            out.append(f"| {c} | " + " | ".join(cells) + " |")
        if temp == 0:
            ours = [r for (m, c), r in rows.items() if not m.startswith("peer:") and c != "all"]
            same = all(r["identical"] is not False for r in ours)
            out += [
                "",
                "specdec's greedy output identical to plain decoding in every run: " + ("yes." if same else "**no**."),
            ]
            diff = [
                f"{m.removeprefix('peer:')} ({c})"
                for (m, c), r in rows.items()
                if m.startswith("peer:") and c != "all" and r["identical"] is False
            ]
            if diff:
                out.append(
                    "Peers whose speculative greedy output differed from their own plain decoding: "
                    + ", ".join(diff)
                    + "."
                )
            if result.peers_skipped:
                out.append(
                    "Peers skipped: " + "; ".join(f"{p}: {why}" for p, why in result.peers_skipped.items()) + "."
                )
        out.append("")
    choices = result.auto_choices()
    if choices:
        out += [
            "## What auto chose",
            "",
            "Share of auto's steps that each drafter proposed (or were plain steps), "
            "with the number of steps per k, summed over the runs.",
            "",
            "| T | category | steps | choices |",
            "|---|---|---|---|",
        ]
        out += [f"| {r['temperature']:g} | {r['category']} | {r['steps']} | {_choice(r)} |" for r in choices]
        out.append("")
    recs = result.recommendations()
    if recs:
        out += [
            "## Cost model",
            "",
            (
                "Predicted from the measured pass times and per-position acceptance (expected-tokens formula,"
                " Leviathan et al.), against the measured median speedup; best k = the k in 1..8 with the"
                " highest predicted speedup."
            ),
            "",
            f"| method | T | category | measured (k = {s.chain_k}) | predicted | best k | predicted at best k |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in recs:
            out.append(
                f"| {r.method} | {r.temperature:g} | {r.category} | {_fmt(r.measured_speedup, '.2f', '×')} | "
                f"{r.predicted_speedup:.2f}× | {r.best_k} | {r.best_predicted:.2f}× |"
            )
        out.append("")
    for p in plots:
        out += [f"![{p}]({p})", ""]
    return "\n".join(out)


def plots(result: GridResult, out_dir: Path, suffix: str = "") -> list[str]:
    """speedup_by_category.png (greedy, or the first temperature) and acceptance_by_position.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result.summary()
    temp = 0.0 if 0.0 in result.settings.temperatures else result.settings.temperatures[0]
    rows = [r for r in summary if r["temperature"] == temp]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cats = list(dict.fromkeys(r["category"] for r in rows if r["category"] != "all")) + ["all"]
    by = {(r["method"], r["category"]): r for r in rows}
    names = []
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cats)), 4.0))
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        cells = [by.get((m, c)) for c in cats]
        ys = [(r["speedup"] or 0.0) if r else 0.0 for r in cells]
        bands = [(r or {}).get("speedup_band") for r in cells]
        err = [
            [y - b[0] if b else 0.0 for y, b in zip(ys, bands, strict=True)],
            [b[1] - y if b else 0.0 for y, b in zip(ys, bands, strict=True)],
        ]
        bars = ax.bar(
            [i + j * width for i in range(len(cats))],
            ys,
            width,
            label=m,
            yerr=err,
            capsize=2,
            error_kw={"linewidth": 0.8},
        )
        for bar, r in zip(bars, cells, strict=True):
            if r and r.get("no_difference"):  # the band holds 1.0: hatched, pale
                bar.set_hatch("//")
                bar.set_alpha(0.45)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.text(
        0.01,
        0.99,
        f"hatched: {NO_DIFFERENCE} (band holds 1.0); bars: lowest-highest run",
        fontsize=7,
        va="top",
        transform=ax.transAxes,
    )
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"{result.settings.target}, T = {temp:g}, k = {result.settings.chain_k}")
    ax.legend(fontsize=8)
    names.append(save_figure(fig, out_dir / f"speedup_by_category{suffix}.png").name)

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for m in methods:
        acc = by[(m, "all")]["acceptance_by_position"] if (m, "all") in by else []
        pts = [(i + 1, a) for i, a in enumerate(acc) if a is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"acceptance by draft position, T = {temp:g}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:  # no method drafted (e.g. every request fell back to plain decoding)
        ax.text(0.5, 0.5, "no drafted tokens", ha="center", va="center", transform=ax.transAxes)
    names.append(save_figure(fig, out_dir / f"acceptance_by_position{suffix}.png").name)
    return names


def write(results: GridResult | list[GridResult], out_dir: Path) -> list[Path]:
    """results.json, report.md and the plots in `out_dir`; returns the paths written. Several
    model pairs: results.json holds {"pairs": [...]}, report.md one section per pair, and the
    plots are numbered in pair order."""
    runs = [results] if isinstance(results, GridResult) else results
    out_dir.mkdir(parents=True, exist_ok=True)
    data = runs[0].to_dict() if len(runs) == 1 else {"pairs": [r.to_dict() for r in runs]}
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    sections, pngs = [], []
    for i, r in enumerate(runs):
        names = plots(r, out_dir, "" if len(runs) == 1 else f"-{i + 1}")
        sections.append(markdown(r, names))
        pngs += names
    text = "\n\n".join(sections)
    (out_dir / "report.md").write_text(text)
    (out_dir / "report.html").write_text(html(text, out_dir))
    return [out_dir / "results.json", out_dir / "report.md", out_dir / "report.html", *(out_dir / n for n in pngs)]
