"""Suffix decoding's parameters (factor, minimum share, most nodes per step) measured on the
bundled suite's prompts *after* the quick suite's (the quick suite runs each category's first
prompt; these are its 2nd..(1+N)th), so the defaults are not tuned on what the quick suite then
reports. Every variant runs side by side with plain decoding on the same prompt (greedy, the
output checked identical); each prompt's store of earlier outputs is emptied first, so a
variant drafts from the prompt and its own output only. Prints a table (median decode-only
and end-to-end speedup, tokens per pass) and writes JSON.

    python benchmarks/suffix_params.py --out bench-out/suffix_params.json
    python benchmarks/suffix_params.py --factor 1 2 4 8 --max-nodes 16 24 --per-category 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import specdec
from specdec.bench.grid import prompt_ids
from specdec.bench.suite import load_prompts
from specdec.drafters import SuffixDrafter
from specdec.runtime import forget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--factor", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--min-prob", type=float, nargs="+", default=[0.1])
    ap.add_argument("--max-nodes", type=int, nargs="+", default=[24])
    ap.add_argument(
        "--categories", nargs="+", default=["code-editing", "summarisation", "rag", "code-generation", "math", "chat"]
    )
    ap.add_argument("--per-category", type=int, default=1, help="prompts per category, after the quick suite's")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    ns = ap.parse_args()
    target = specdec.load(ns.target)
    prompts = [
        p for c in ns.categories for p in [q for q in load_prompts() if q.category == c][1 : 1 + ns.per_category]
    ]
    variants = list(itertools.product(ns.factor, ns.min_prob, ns.max_nodes))
    specdec.generate(target, [1, 2, 3, 4], max_new_tokens=2, ignore_eos=True)  # first calls
    rows = []
    for p in prompts:
        ids = prompt_ids(target, p)
        for factor, min_prob, max_nodes in variants:
            plain = specdec.generate(target, ids, max_new_tokens=ns.max_new_tokens)  # (beside each: drift)
            forget(target.model)
            d = SuffixDrafter(factor=factor, min_prob=min_prob, max_nodes=max_nodes)
            out = specdec.generate(target, ids, drafter=d, max_new_tokens=ns.max_new_tokens)
            m, pm = out.metrics, plain.metrics
            rows.append(
                {
                    "prompt": p.id,
                    "category": p.category,
                    "factor": factor,
                    "min_prob": min_prob,
                    "max_nodes": max_nodes,
                    "identical": out.token_ids == plain.token_ids,
                    "speedup": pm.wall_time / pm.new_tokens / (m.wall_time / m.new_tokens),
                    "decode_speedup": (pm.wall_time - pm.prefill_time)
                    / (m.wall_time - m.prefill_time)
                    * m.new_tokens
                    / pm.new_tokens,
                    "tokens_per_pass": m.new_tokens / max(1, m.target_forwards + 1),
                    "info": m.drafter_info,
                }
            )
            print(
                f"{p.id:18} factor {factor:4g} min_prob {min_prob:4g} max_nodes {max_nodes:3} "
                f"decode {rows[-1]['decode_speedup']:.2f}x  e2e {rows[-1]['speedup']:.2f}x  "
                f"tau {rows[-1]['tokens_per_pass']:.2f}  identical {rows[-1]['identical']}",
                flush=True,
            )
    print("\nmedians over prompts:")
    for v in variants:
        rs = [r for r in rows if (r["factor"], r["min_prob"], r["max_nodes"]) == v]
        print(
            f"factor {v[0]:4g} min_prob {v[1]:4g} max_nodes {v[2]:3}: decode "
            f"{statistics.median(r['decode_speedup'] for r in rs):.2f}x  e2e "
            f"{statistics.median(r['speedup'] for r in rs):.2f}x  tau "
            f"{statistics.median(r['tokens_per_pass'] for r in rs):.2f}  all identical "
            f"{all(r['identical'] for r in rs)}"
        )
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps({"target": ns.target, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
