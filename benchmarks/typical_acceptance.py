"""Typical acceptance (lossy, opt-in) measured: its speed and how far its output strays.

For each prompt of the quick suite (one per category) and each temperature, side by side on
the same target: plain greedy decoding (the reference text), plain sampling, the heads drafter
verified exactly, and the same drafter with typical acceptance (Medusa's criterion). Reports
tokens/s of each sampled run relative to plain sampling, and how often each sampled output
differs from the greedy one — the sequence and the share of tokens up to the first difference
— so typical acceptance's departure from the target is measured next to what sampling itself
does. Prints a table, writes JSON.

    python benchmarks/typical_acceptance.py --method medusa --temperatures 0.3 0.7 --out bench-out/typical.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import specdec
from specdec.bench.grid import machine, prompt_ids
from specdec.bench.suite import load_prompts, select


def _agree(a: list[int], b: list[int]) -> float:
    """Share of `a` before its first difference from `b`."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n / max(len(a), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--method", default="medusa", help="drafter to verify both ways (medusa, hydra, eagle3, ...)")
    ap.add_argument("--head", help="heads directory (default: the shipped ones)")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.3, 0.7])
    ap.add_argument("--epsilon", type=float, default=0.09)
    ap.add_argument("--delta", type=float, default=0.3)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the JSON here")
    a = ap.parse_args()

    target = specdec.load(a.target)
    prompts = select(load_prompts(None), None, 1)
    opts = {"head": a.head} if a.head else {}
    common = {"max_new_tokens": a.max_new_tokens, "ignore_eos": True, "context_overflow": "truncate"}
    specdec.generate(target, [1, 2, 3], drafter=a.method, k=a.k, max_new_tokens=4, **opts)  # warm-up
    rows = []
    for p in prompts:
        ids = prompt_ids(target, p)
        greedy = specdec.generate(target, ids, **common)
        for t in a.temperatures:
            samp = {"temperature": t, "seed": a.seed}
            plain = specdec.generate(target, ids, **common, **samp)
            exact = specdec.generate(target, ids, drafter=a.method, k=a.k, **opts, **common, **samp)
            typical = specdec.generate(
                target,
                ids,
                drafter=a.method,
                k=a.k,
                acceptance="typical",
                epsilon=a.epsilon,
                delta=a.delta,
                **opts,
                **common,
                **samp,
            )
            row = {"category": p.category, "temperature": t}
            base = plain.metrics.tokens_per_second
            for name, res in (("plain", plain), ("exact", exact), ("typical", typical)):
                row[name] = {
                    "speedup": res.metrics.tokens_per_second / base,
                    "differs": res.token_ids != greedy.token_ids,
                    "agree_before_first_difference": _agree(res.token_ids, greedy.token_ids),
                    "tau": res.metrics.mean_accepted_tokens,
                    "exact": res.metrics.exact,
                }
            rows.append(row)
            print(
                f"{p.category:16s} T={t:<4g} "
                + "  ".join(
                    f"{n} {row[n]['speedup']:.2f}x differs={row[n]['differs']!s:5s} "
                    f"agree={row[n]['agree_before_first_difference']:.2f}"
                    for n in ("plain", "exact", "typical")
                ),
                flush=True,
            )
    summary = []
    for t in a.temperatures:
        rs = [r for r in rows if r["temperature"] == t]
        s = {"temperature": t}
        for n in ("plain", "exact", "typical"):
            s[n] = {
                "speedup_median": statistics.median(r[n]["speedup"] for r in rs),
                "differs_share": sum(r[n]["differs"] for r in rs) / len(rs),
                "agree_median": statistics.median(r[n]["agree_before_first_difference"] for r in rs),
            }
        summary.append(s)
        print(
            f"T={t:<4g} medians: "
            + "; ".join(
                f"{n}: {s[n]['speedup_median']:.2f}x, differs from greedy in {s[n]['differs_share']:.0%}, agrees "
                f"{s[n]['agree_median']:.0%} before the first difference"
                for n in ("plain", "exact", "typical")
            )
        )
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(
            json.dumps(
                {"settings": vars(a) | {"out": str(a.out)}, "machine": machine(), "rows": rows, "summary": summary},
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
