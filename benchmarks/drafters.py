"""Drafters that need no second model (prompt lookup, early-exit self-speculation, lookahead,
EAGLE-3 heads) against plain decoding of the same target, per task kind.

Input-grounded tasks (edit given code, answer from a given passage, summarise a given text)
copy spans of their input; open-ended ones (chat, translation, math, code generation) do
not. For each task, method and repeat, plain and speculative decoding run side by side
(`specdec.compare`); medians over repeats. Prints a table and writes JSON. Speedup is end to
end (prefill included) and decode-only.

    python benchmarks/drafters.py --out bench-out/drafters.json
    python benchmarks/drafters.py --methods prompt-lookup --tasks edit-code qa-passage summarise -k 4 8
    python benchmarks/drafters.py --methods eagle3 -k 3 4 5 --tree-topk 4
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import specdec
from specdec.cli import add_drafter_options, drafter_options
from specdec.drafters import DRAFTERS

CODE = """def load_records(path):
    records = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, value = line.split("=", 1)
            records.append((name.strip(), value.strip()))
    return records


def summarize(records):
    totals = {}
    for name, value in records:
        totals[name] = totals.get(name, 0) + float(value)
    return totals


def report(totals):
    for name in sorted(totals):
        print(f"{name}: {totals[name]:.2f}")
"""
PASSAGE = (
    "The Brennan Bridge opened in 1931 after four years of construction. It spans 1.2 kilometres across the "
    "Halden river and carried a tram line until 1968, when the trams were replaced by buses. The bridge was "
    "closed for repairs between 1994 and 1997 after inspectors found corrosion in the steel cables. Today it "
    "carries about 40,000 vehicles a day, and a separate lane for bicycles was added in 2015. The engineer who "
    "designed it, Margit Sand, also designed the railway station in the town of Ostby."
)
PROMPTS = {
    "chat": (
        "I have a job interview next week for a junior data analyst role. How should I prepare? Give me a short plan."
    ),
    "translation": (
        "Translate into German: The museum will be closed on Monday for maintenance, but the garden stays "
        "open from nine in the morning until six in the evening."
    ),
    "math": (
        "A shop sells pencils at 3 for 45 cents and erasers at 2 for 70 cents. How much do 12 pencils and 5 "
        "erasers cost? Think step by step."
    ),
    "code": (
        "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals, with a "
        "docstring and a few asserts as tests."
    ),
    "edit-code": (
        "Rename the function `summarize` to `total_by_name` everywhere in this code and return the full "
        "updated code:\n\n"
    )
    + CODE,
    "qa-passage": "Answer using only the passage, quoting the relevant sentence.\n\nPassage: "
    + PASSAGE
    + "\n\nQuestion: Why was the bridge closed between 1994 and 1997, and what was added in 2015?",
    "summarise": "Summarise this text in three sentences, reusing its wording where possible:\n\n" + PASSAGE,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["prompt-lookup", "early-exit", "lookahead"],
        choices=[m for m in DRAFTERS if m != "draft-model"],
    )
    ap.add_argument("--tasks", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    ap.add_argument("-k", type=int, nargs="+", default=[4])
    add_drafter_options(ap)  # the drafters' own options, as the CLI has them
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("bench-out/drafters.json"))
    a = ap.parse_args()
    target = specdec.load(a.target, dtype=a.dtype)
    rows = []
    print(
        f"{'task':11s} {'method':13s} {'k':>2s} {'speedup':>8s} {'decode':>7s} {'alpha':>6s} {'tau':>5s} "
        f"{'spec tok/s':>10s} {'plain tok/s':>11s} identical",
        flush=True,
    )
    for method in a.methods:
        for k in a.k:
            options = drafter_options(a, method, strict=False)
            for kind in a.tasks:
                runs = [
                    specdec.compare(
                        target, PROMPTS[kind], drafter=method, k=k, max_new_tokens=a.max_new_tokens, **options
                    )
                    for _ in range(a.repeats)
                ]
                spec = [r.speculative.metrics for r in runs]
                plain = [r.plain.metrics for r in runs]
                row = {
                    "task": kind,
                    "method": method,
                    "k": k,
                    "dtype": target.model.mode,
                    "speedup": statistics.median(r.speedup for r in runs),
                    "decode_speedup": statistics.median(
                        s.decode_tokens_per_second / p.decode_tokens_per_second
                        for s, p in zip(spec, plain, strict=True)
                    ),
                    "acceptance_rate": statistics.median(s.acceptance_rate or 0.0 for s in spec),
                    "mean_accepted_tokens": statistics.median(s.mean_accepted_tokens or 0.0 for s in spec),
                    "rows_per_pass": statistics.median(s.scored_rows / max(s.steps, 1) for s in spec),
                    "tokens_per_second": statistics.median(s.tokens_per_second for s in spec),
                    "plain_tokens_per_second": statistics.median(p.tokens_per_second for p in plain),
                    "identical": [r.identical for r in runs],
                    "new_tokens": [s.new_tokens for s in spec],
                    "drafter_info": spec[-1].drafter_info,
                }
                rows.append(row)
                print(
                    f"{kind:11s} {method:13s} {k:2d} {row['speedup']:8.2f} {row['decode_speedup']:7.2f} "
                    f"{row['acceptance_rate']:6.2f} {row['mean_accepted_tokens']:5.2f} "
                    f"{row['tokens_per_second']:10.2f} "
                    f"{row['plain_tokens_per_second']:11.2f} {row['identical']}",
                    flush=True,
                )
    print("\nmedian speedup per method (end to end / decode-only):")
    for method in a.methods:
        mine = [r for r in rows if r["method"] == method]
        print(
            f"  {method:13s} {statistics.median(r['speedup'] for r in mine):.2f} / "
            f"{statistics.median(r['decode_speedup'] for r in mine):.2f}"
        )
    settings = {k: v for k, v in vars(a).items() if k != "out" and v is not None}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {"threads": torch.get_num_threads(), "torch": torch.__version__, "settings": settings, "rows": rows},
            indent=1,
        )
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
