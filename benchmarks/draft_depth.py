"""How deep and how wide the draft model drafts: its chain at a fixed k (the old behaviour),
its chain as deep as its confidence pays (the default), its token tree (`--draft-tree 1`) and
auto, each against plain decoding of the same target, interleaved, on a prompt file.

Each prompt is read once, untimed (the target's rows into the prefix store, the draft's prefill
kept), so every run times generation. Per repeat plain decoding runs first and last and the
variants between, in one order and in the next repeat the reverse (ABBA); each run is timed
against the mean of its two plain runs. Reports per prompt and variant the median speedup with
its lowest and highest repeat, τ (tokens per target pass), the target's rows per pass and the
modelled speedup (the runs' passes priced from the stored pass table, plus the measured
drafting time), and whether greedy output equalled plain decoding's.

    python benchmarks/draft_depth.py --prompts benchmarks/open_text_prompts.jsonl --repeats 3 \\
        --out bench-out/draft_depth.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import specdec
from specdec.api import load_draft, request, run_request
from specdec.bench.grid import PREFIX_TOKENS, _prime, prompt_ids
from specdec.bench.suite import load_prompts, select
from specdec.costs import pass_costs
from specdec.drafters.suffix import STORE
from specdec.memory import pools_of

HERE = Path(__file__).parent
VARIANTS: dict[str, dict] = {
    "chain k=4": {"k": 4, "drafter_options": {"confidence": 0}},
    "chain": {},
    "tree": {"drafter_options": {"tree": 1}},
    "auto": {"drafter": "auto"},
}


def _modelled(m, plain_ms: float, table) -> float:
    """The run's decode time priced: its passes by rows from the table (scaled to this prompt by
    its plain pass), plus its measured drafting."""
    scale = plain_ms / table.rows(1)
    passes = sum(len(ms) * table.rows(int(r)) for r, ms in m.pass_ms.items())
    return scale * passes + 1e3 * m.draft_time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=Path, default=HERE / "open_text_prompts.jsonl")
    ap.add_argument("--categories", nargs="*", default=None)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-out/draft_depth.json"))
    a = ap.parse_args()
    target, draft = specdec.load(a.target), load_draft(a.draft)
    table = pass_costs(target.model, 64).unscaled()
    prompts = select(load_prompts(a.prompts), a.categories, a.per_category)
    rows: list[dict] = []
    print(
        f"{'prompt':20s} {'variant':10s} {'speedup':>20s} {'modelled':>8s} {'tau':>5s} {'rows':>5s} "
        f"{'draft':>6s} {'pass':>6s}  same  (draft, pass: ms per step)"
    )
    for p in prompts:
        ids = prompt_ids(target, p)
        _prime(target, draft, ids)
        runs: dict[str, list[dict]] = {v: [] for v in a.variants}
        for rep in range(a.repeats):
            common = {"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "seed": rep}

            def plain(ids=ids, common=common):  # noqa: ANN202
                return run_request(target, request(target, ids, **common), prefix_tokens=PREFIX_TOKENS)

            first = plain()
            outs = {}
            for v in a.variants if rep % 2 == 0 else list(reversed(a.variants)):
                # (suffix decoding, under auto, must not draft from this prompt's own earlier answer)
                pools_of(target.model).of("").forget(STORE)
                outs[v] = run_request(
                    target,
                    request(target, ids, assistant_model=draft, **common, **VARIANTS[v]),
                    prefix_tokens=PREFIX_TOKENS,
                )
            last = plain()
            decode = [o.metrics.wall_time - o.metrics.prefill_time for o in (first, last)]
            base = sum(decode) / 2
            plain_ms = (
                1e3
                * sum(o.metrics.target_time for o in (first, last))
                / sum(o.metrics.target_forwards for o in (first, last))
            )
            for v, o in outs.items():
                m = o.metrics
                runs[v].append(
                    {
                        "speedup": base / (m.wall_time - m.prefill_time),
                        "modelled": plain_ms * m.new_tokens / _modelled(m, plain_ms, table),
                        "tau": m.new_tokens / max(m.target_forwards, 1),
                        "rows": m.scored_rows / max(m.target_forwards, 1),
                        "draft_ms": 1e3 * m.draft_time / max(m.target_forwards, 1),
                        "pass_ms": 1e3 * m.target_time / max(m.target_forwards, 1),
                        "identical": o.token_ids == first.token_ids if a.temperature == 0 else None,
                    }
                )
        for v in a.variants:
            xs = [r["speedup"] for r in runs[v]]
            row = {
                "prompt": p.id,
                "category": p.category,
                "variant": v,
                "speedup": statistics.median(xs),
                "band": [min(xs), max(xs)],
                "modelled": statistics.median(r["modelled"] for r in runs[v]),
                "tau": statistics.mean(r["tau"] for r in runs[v]),
                "rows": statistics.mean(r["rows"] for r in runs[v]),
                "draft_ms": statistics.mean(r["draft_ms"] for r in runs[v]),
                "pass_ms": statistics.mean(r["pass_ms"] for r in runs[v]),
                "identical": None if a.temperature else all(r["identical"] for r in runs[v]),
            }
            rows.append(row)
            print(
                f"{p.id:20s} {v:10s} {row['speedup']:5.2f}x ({row['band'][0]:.2f}-{row['band'][1]:.2f})  "
                f"{row['modelled']:7.2f}x {row['tau']:5.2f} {row['rows']:5.2f} {row['draft_ms']:6.1f} "
                f"{row['pass_ms']:6.1f}  "
                f"{row['identical']}",
                flush=True,
            )
    summary = {}
    for v in a.variants:
        mine = [r for r in rows if r["variant"] == v]
        summary[v] = {
            "median": statistics.median(r["speedup"] for r in mine),
            "lowest": min(r["band"][0] for r in mine),
            "modelled_median": statistics.median(r["modelled"] for r in mine),
            "tau_mean": statistics.mean(r["tau"] for r in mine),
            "rows_mean": statistics.mean(r["rows"] for r in mine),
            "draft_ms_per_step": statistics.mean(r["draft_ms"] for r in mine),
            "pass_ms_per_step": statistics.mean(r["pass_ms"] for r in mine),
        }
        s = summary[v]
        print(
            f"{'median':20s} {v:10s} {s['median']:5.2f}x (lowest run {s['lowest']:.2f})  {s['modelled_median']:7.2f}x "
            f"{s['tau_mean']:5.2f} {s['rows_mean']:5.2f} {s['draft_ms_per_step']:6.1f} {s['pass_ms_per_step']:6.1f}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps({"settings": {k: str(v) for k, v in vars(a).items()}, "rows": rows, "summary": summary}, indent=1)
    )
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
