"""Speedup of the draft-model method over plain decoding on a few prompts of different kinds.

Loads the models once, then for each prompt and temperature runs plain and speculative
decoding side by side (`specdec.compare`), repeated; prints a table and writes JSON.

    python benchmarks/qwen_pair.py --out bench-out/qwen_pair.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import specdec
from specdec.config import DEFAULT_K

PROMPTS = {
    "code": "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "code-edit": "Rewrite this function to use a list comprehension:\n\ndef squares(xs):\n    out = []\n"
    "    for x in xs:\n        out.append(x * x)\n    return out\n",
    "explain": "Explain what a hash table is and when to use one.",
    "math": "A train travels 120 km in 1.5 hours. What is its average speed? Show your steps.",
    "chat": "Give me three tips for writing readable code.",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("-k", type=int, default=DEFAULT_K)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("bench-out/qwen_pair.json"))
    ap.add_argument(
        "--peers",
        action="store_true",
        help="also run transformers generate (plain and assistant_model, bf16, greedy) on the same prompts",
    )
    a = ap.parse_args()
    target = specdec.load(a.target, dtype=a.dtype)
    draft = specdec.load(a.draft, dtype=a.dtype)
    rows = []
    print(
        f"{'prompt':10s} {'T':>4s} {'speedup':>8s} {'alpha':>6s} {'tau':>5s} {'spec tok/s':>10s} "
        f"{'plain tok/s':>11s} identical",
        flush=True,
    )
    for temp in a.temperatures:
        for kind, prompt in PROMPTS.items():
            runs = [
                specdec.compare(
                    target,
                    prompt,
                    assistant_model=draft,
                    k=a.k,
                    max_new_tokens=a.max_new_tokens,
                    temperature=temp,
                    seed=i,
                )
                for i in range(a.repeats)
            ]
            row = {
                "prompt": kind,
                "temperature": temp,
                "k": a.k,
                "dtype": target.model.mode,
                "speedup": statistics.median(r.speedup for r in runs),
                "acceptance_rate": statistics.median(r.speculative.metrics.acceptance_rate for r in runs),
                "mean_accepted_tokens": statistics.median(r.speculative.metrics.mean_accepted_tokens for r in runs),
                "tokens_per_second": statistics.median(r.speculative.metrics.tokens_per_second for r in runs),
                "plain_tokens_per_second": statistics.median(r.plain.metrics.tokens_per_second for r in runs),
                "identical": [r.identical for r in runs],
                "new_tokens": [r.speculative.metrics.new_tokens for r in runs],
            }
            rows.append(row)
            print(
                f"{kind:10s} {temp:4.1f} {row['speedup']:8.2f} {row['acceptance_rate']:6.2f} "
                f"{row['mean_accepted_tokens']:5.2f} {row['tokens_per_second']:10.2f} "
                f"{row['plain_tokens_per_second']:11.2f} {row['identical']}",
                flush=True,
            )
    peers = run_transformers_peers(target, draft, a.max_new_tokens, a.k) if a.peers else []
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows, "peers": peers}, indent=1
        )
    )
    print(f"wrote {a.out}")


def run_transformers_peers(
    target: specdec.LoadedModel, draft: specdec.LoadedModel, max_new_tokens: int, k: int = DEFAULT_K
) -> list:
    """transformers' own greedy decoding and assisted generation (the same draft), bf16."""
    from specdec.bench.peers import TransformersPeers

    tp = TransformersPeers(target.path, draft.path, k=k)
    out = []
    print(f"{'peer':28s} {'prompt':10s} {'tok/s':>6s}", flush=True)
    for kind, prompt in PROMPTS.items():
        ids = specdec.encode_prompt(target.tokenizer, prompt)
        results = {}
        for name, peer in (
            ("transformers bf16", "transformers"),
            ("transformers bf16 assisted", "transformers-assisted"),
        ):
            run = tp.run(peer, ids, max_new_tokens)
            new = run.tokens or []
            results[name] = new
            out.append(
                {
                    "peer": name,
                    "prompt": kind,
                    "tokens_per_second": len(new) / run.seconds,
                    "new_tokens": len(new),
                    "error": run.error,
                }
            )
            print(f"{name:28s} {kind:10s} {len(new) / run.seconds:6.2f}", flush=True)
        out[-1]["identical_to_its_plain"] = results["transformers bf16"] == results["transformers bf16 assisted"]
    return out


if __name__ == "__main__":
    main()
