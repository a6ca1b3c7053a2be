"""Prompt lookup (no draft model) against plain decoding on input-grounded prompts.

Edit given code, answer from a given passage, summarise a given text: the kinds of task where
the output copies spans of the input. For each prompt and k, plain and speculative decoding
of the same target run side by side (`specdec.compare`), repeated; prints a table and writes
JSON. Speedup is end to end (prefill included) and decode-only.

    python benchmarks/prompt_lookup.py --out bench-out/prompt_lookup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import specdec
from specdec.drafters import PromptLookupDrafter

CODE = '''def load_records(path):
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
'''
PASSAGE = ("The Brennan Bridge opened in 1931 after four years of construction. It spans 1.2 kilometres across the "
  "Halden river and carried a tram line until 1968, when the trams were replaced by buses. The bridge was "
  "closed for repairs between 1994 and 1997 after inspectors found corrosion in the steel cables. Today it "
  "carries about 40,000 vehicles a day, and a separate lane for bicycles was added in 2015. The engineer who "
  "designed it, Margit Sand, also designed the railway station in the town of Ostby.")
PROMPTS = {
  "edit-code": "Rename the function `summarize` to `total_by_name` everywhere in this code and return the full updated code:\n\n" + CODE,
  "qa-passage": "Answer using only the passage, quoting the relevant sentence.\n\nPassage: " + PASSAGE + "\n\nQuestion: Why was the bridge closed between 1994 and 1997, and what was added in 2015?",
  "summarise": "Summarise this text in three sentences, reusing its wording where possible:\n\n" + PASSAGE,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("-k", type=int, nargs="+", default=[4])
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("bench-out/prompt_lookup.json"))
    a = ap.parse_args()
    target = specdec.load(a.target, dtype=a.dtype)
    rows = []
    print(f"{'prompt':11s} {'k':>2s} {'speedup':>8s} {'decode':>7s} {'alpha':>6s} {'tau':>5s} {'spec tok/s':>10s} "
          f"{'plain tok/s':>11s} identical", flush=True)  # fmt: skip
    for k in a.k:
        for kind, prompt in PROMPTS.items():
            runs = [specdec.compare(target, prompt, drafter=PromptLookupDrafter(a.ngram_max, a.ngram_min), k=k,
                                    max_new_tokens=a.max_new_tokens) for _ in range(a.repeats)]  # fmt: skip
            spec = [r.speculative.metrics for r in runs]
            plain = [r.plain.metrics for r in runs]
            row = {
                "prompt": kind, "k": k, "dtype": target.model.mode, "ngram": [a.ngram_min, a.ngram_max],
                "speedup": statistics.median(r.speedup for r in runs),
                "decode_speedup": statistics.median(s.decode_tokens_per_second / p.decode_tokens_per_second
                                                    for s, p in zip(spec, plain, strict=True)),
                "acceptance_rate": statistics.median(s.acceptance_rate or 0.0 for s in spec),
                "mean_accepted_tokens": statistics.median(s.mean_accepted_tokens or 0.0 for s in spec),
                "tokens_per_second": statistics.median(s.tokens_per_second for s in spec),
                "plain_tokens_per_second": statistics.median(p.tokens_per_second for p in plain),
                "identical": [r.identical for r in runs],
                "new_tokens": [s.new_tokens for s in spec],
            }  # fmt: skip
            rows.append(row)
            print(f"{kind:11s} {k:2d} {row['speedup']:8.2f} {row['decode_speedup']:7.2f} {row['acceptance_rate']:6.2f} "
                  f"{row['mean_accepted_tokens']:5.2f} {row['tokens_per_second']:10.2f} "
                  f"{row['plain_tokens_per_second']:11.2f} {row['identical']}", flush=True)  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
