"""What speculation would give on a bigger target: real runs re-priced with another pass table.

A PROJECTION, and labelled so. Its inputs, each from a measurement:
- the runs (`specdec bench` results.json, greedy, every output checked identical to plain): per
  run, how many target passes of how many rows it took, how long its drafting took, how many
  tokens it produced, and the same for plain decoding of the same prompt. These come from a
  real pair (the default: qwen2.5-coder-1.5b with the 0.5B draft): their acceptance, not the
  bigger target's, is what is borrowed;
- the pass table of the bigger target (`specdec bench forward --json`, the q4k mode's median ms
  of a pass over k = 1..16 rows on this machine; a SYNTHETIC file at a real shape stands in for
  weights that cannot be fetched here).

Each run's decoding is priced again: the target's passes from the bigger target's table
(rows past the table's last measured count extrapolated along its last segment), plus the
run's own measured drafting time (the draft is the same model), against plain decoding's passes
priced the same way. Prefill is left out on both sides (it is the same work with or without
speculation): the figure is the decoding phase's speedup. Where the runs hold several k for a
method and category, the best priced k is taken, as a tuned `-k` would.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def pass_table(forward: dict[str, Any]) -> dict[int, float]:
    """rows -> ms of the q4k mode's passes from a `bench forward --json` result."""
    ms = forward["modes"]["q4k"]["ms"]
    return {int(k): float(v) for k, v in ms.items()}


def price(table: dict[int, float], rows: int) -> float:
    xs = sorted(table)
    if rows <= xs[0]:
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:], strict=False):
        if rows <= hi:
            w = (rows - lo) / (hi - lo)
            return table[lo] * (1 - w) + table[hi] * w
    lo, hi = xs[-2], xs[-1]  # past the table: along its last segment
    return table[hi] + (rows - hi) * (table[hi] - table[lo]) / (hi - lo)


def _ms_per_token(passes: dict[str, int], draft_s: float, tokens: int, table: dict[int, float]) -> float:
    return (sum(n * price(table, int(rows)) for rows, n in passes.items()) + 1e3 * draft_s) / tokens


def project(runs: list[dict[str, Any]], table: dict[int, float], source_table: dict[int, float] | None = None) -> dict:
    """Per method and category: the projected decoding speedup under `table` (best k over the
    runs' files: each file one k, its settings' `k`, 0 = the method's own), with the runs'
    acceptance and tokens per pass, and the same runs priced with `source_table` (the real
    target's own pass table, where given: the model's check against the runs' measured speedup)."""
    cells: dict[tuple[str, str, int], list[dict]] = {}
    for run in runs:
        k = int(run.get("settings", {}).get("k") or 0)
        for r in run["records"]:
            if (
                r.get("temperature") == 0
                and r.get("identical")
                and r.get("passes")
                and not r["method"].startswith("peer:")
            ):
                cells.setdefault((r["method"], r["category"], k), []).append(r)
    if not cells:
        raise ValueError("the runs hold no greedy run checked identical to plain (run `specdec bench` with -T 0)")
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for (method, category, k), rs in cells.items():
        projected = [
            _ms_per_token(r["plain_passes"], 0.0, r["plain_new_tokens"], table)
            / _ms_per_token(r["passes"], r["draft_seconds"], r["new_tokens"], table)
            for r in rs
        ]
        row = {
            "method": method,
            "category": category,
            "k": k,
            "runs": len(rs),
            "projected_speedup": statistics.median(projected),
            "measured_speedup": statistics.median(r["decode_speedup"] or r["speedup"] for r in rs),
            "acceptance": statistics.median(r["acceptance_rate"] or 0.0 for r in rs),
            "tokens_per_pass": statistics.median(r["new_tokens"] / max(1, r["steps"]) for r in rs),
            "draft_ms_per_token": statistics.median(1e3 * r["draft_seconds"] / r["new_tokens"] for r in rs),
        }
        if source_table:
            row["modelled_source_speedup"] = statistics.median(
                _ms_per_token(r["plain_passes"], 0.0, r["plain_new_tokens"], source_table)
                / _ms_per_token(r["passes"], r["draft_seconds"], r["new_tokens"], source_table)
                for r in rs
            )
        key = (method, category)
        if key not in best or row["projected_speedup"] > best[key]["projected_speedup"]:
            best[key] = row
    rows = sorted(best.values(), key=lambda r: (r["method"], r["category"]))
    medians = {
        m: statistics.median(r["projected_speedup"] for r in rows if r["method"] == m)
        for m in sorted({r["method"] for r in rows})
    }
    return {"rows": rows, "median_over_categories": medians, "table_ms": {str(k): v for k, v in table.items()}}


def table(result: dict[str, Any], name: str) -> str:
    lines = [
        f"PROJECTION for {name}: decoding speedup over plain, the real pair's runs re-priced with its pass table",
        f"{'method':14s}{'category':16s}{'k':>3s}{'alpha':>7s}{'tok/pass':>9s}{'draft ms/tok':>13s}"
        f"{'real: measured':>15s}{'modelled':>9s}{'projected':>10s}",
    ]
    for r in result["rows"]:
        modelled = r.get("modelled_source_speedup")
        lines.append(
            f"{r['method']:14s}{r['category']:16s}{r['k']:3d}{r['acceptance']:7.2f}{r['tokens_per_pass']:9.2f}"
            f"{r['draft_ms_per_token']:13.2f}{r['measured_speedup']:14.2f}x"
            + (f"{modelled:8.2f}x" if modelled else f"{'-':>9s}")
            + f"{r['projected_speedup']:9.2f}x"
        )
    lines.append(
        "median over categories: " + ", ".join(f"{m} {v:.2f}x" for m, v in result["median_over_categories"].items())
    )
    table_ms = ", ".join(f"k={k} {v:.0f}" for k, v in result["table_ms"].items())
    lines.append(
        f"(pass table, ms: {table_ms}; acceptance and drafting time: the real pair's runs; real: the runs' "
        "own decoding speedup, measured and modelled from their own pass table, the check of the pricing)"
    )
    return "\n".join(lines)


def source_table(runs: dict[str, Any]) -> dict[int, float] | None:
    """The real target's own pass table, as the runs measured it between them."""
    ms = runs.get("modelled_pass_ms") or (runs.get("costs") or {}).get("target_ms")
    return {int(k): float(v) for k, v in ms.items()} if ms else None


def load(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if "pairs" in data:
        raise ValueError(f"{path} holds several pairs; project one pair's results.json")
    return data
