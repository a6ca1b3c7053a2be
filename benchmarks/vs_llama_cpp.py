"""Our speculation against llama.cpp's own, on the same two GGUF files, the same prompts and
token counts, greedy, interleaved: the README command's settings (draft model, k = 4, 64 new
tokens) through `specdec`, and `llama-server -md DRAFT --spec-type draft-simple
--spec-draft-n-max 4` (built once by `specdec bench peers --build`).

Each prompt is read once, untimed, by every side (ours into its prefix store and the draft's
prefill; llama.cpp into its prompt cache), so both time generation alone. Per repeat the four
runs go in one order and, in the next repeat, the reverse (ABBA). Reports per prompt the
median tokens/s of each side with its lowest and highest repeat, both speedups over their own
plain decoding, acceptance, and every difference in text (first differing token).

    python benchmarks/vs_llama_cpp.py --repeats 3 --out bench-out/vs_llama_cpp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import specdec
from specdec import store
from specdec.api import load_draft, request, run_request
from specdec.bench import llama_server
from specdec.bench.grid import PREFIX_TOKENS, _prime, prompt_ids
from specdec.bench.suite import load_prompts
from specdec.registry import MODELS

HERE = Path(__file__).parent


def _band(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.1f} ({min(xs):.1f}-{max(xs):.1f})"


def _first_diff(a: list[int] | None, b: list[int] | None) -> int | None:
    if a is None or b is None:
        return None
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return n if n is not None else (None if len(a) == len(b) else min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=Path, default=HERE / "peer_prompts.jsonl")
    ap.add_argument("--out", type=Path, default=Path("bench-out/vs_llama_cpp.json"))
    a = ap.parse_args()
    why = llama_server.unavailable()
    if why:
        print(f"llama.cpp peer skipped: {why}", file=sys.stderr)
        return 2
    target, draft = specdec.load(a.target), load_draft(a.draft)
    gguf, dgguf = (store.gguf_path(MODELS[n]) for n in (a.target, a.draft))
    prompts = load_prompts(str(a.prompts))
    rows = []
    with llama_server.servers(gguf, dgguf, k=a.k, n_ctx=4096) as (lplain, lspec):
        for p in prompts:
            ids = prompt_ids(target, p)
            _prime(target, draft, ids)
            lplain.complete(ids, 1), lspec.complete(ids, 1)  # (untimed: each server reads the prompt)
            common = dict(max_new_tokens=a.max_new_tokens, temperature=0.0)

            def ours_plain(ids=ids, common=common):
                return run_request(target, request(target, ids, **common), prefix_tokens=PREFIX_TOKENS)

            def ours_spec(ids=ids, common=common):
                req = request(target, ids, assistant_model=draft, k=a.k, **common)
                return run_request(target, req, prefix_tokens=PREFIX_TOKENS)

            sides = {
                "ours-plain": ours_plain,
                "ours-spec": ours_spec,
                "llama-plain": lambda ids=ids: lplain.complete(ids, a.max_new_tokens),
                "llama-spec": lambda ids=ids: lspec.complete(ids, a.max_new_tokens),
            }
            got: dict[str, list] = {s: [] for s in sides}
            for rep in range(a.repeats):
                for s in list(sides) if rep % 2 == 0 else list(sides)[::-1]:
                    got[s].append(sides[s]())
            tps = {s: [len(r.token_ids) / (r.metrics.wall_time) for r in got[s]] for s in ("ours-plain", "ours-spec")}
            tps |= {s: [len(r.tokens) / r.seconds for r in got[s] if r.tokens] for s in ("llama-plain", "llama-spec")}
            ours_ratio = [x / y for x, y in zip(tps["ours-spec"], tps["ours-plain"], strict=True)]
            llama_ratio = [x / y for x, y in zip(tps["llama-spec"], tps["llama-plain"], strict=True)]
            sm = got["ours-spec"][0].metrics
            lr = got["llama-spec"][0]
            rows.append(
                {
                    "id": p.id,
                    "category": p.category,
                    "prompt_tokens": len(ids),
                    "tokens_per_second": {s: v for s, v in tps.items()},
                    "ours_speedup": ours_ratio,
                    "llama_speedup": llama_ratio,
                    "ours_acceptance": sm.acceptance_rate,
                    "llama_acceptance": lr.accepted / lr.drafted if lr.drafted else None,
                    "ours_identical": all(r.token_ids == got["ours-plain"][0].token_ids for r in got["ours-spec"]),
                    "llama_identical": all(r.tokens == got["llama-plain"][0].tokens for r in got["llama-spec"]),
                    "llama_plain_vs_ours_plain_first_diff": _first_diff(
                        got["llama-plain"][0].tokens, got["ours-plain"][0].token_ids
                    ),
                    "llama_spec_vs_ours_plain_first_diff": _first_diff(
                        got["llama-spec"][0].tokens, got["ours-plain"][0].token_ids
                    ),
                }
            )
            r = rows[-1]
            print(
                f"{p.id:12s} ours plain {_band(tps['ours-plain'])} spec {_band(tps['ours-spec'])} "
                f"x{statistics.median(ours_ratio):.2f} | llama plain {_band(tps['llama-plain'])} spec "
                f"{_band(tps['llama-spec'])} x{statistics.median(llama_ratio):.2f} | acc "
                f"{r['ours_acceptance'] or 0:.2f}/"
                f"{r['llama_acceptance'] or 0:.2f} identical {r['ours_identical']}/{r['llama_identical']} "
                f"llama-vs-ours first diff {r['llama_plain_vs_ours_plain_first_diff']}",
                flush=True,
            )

    def med(key):
        return statistics.median(statistics.median(r[key]) for r in rows)

    def tmed(side):
        return statistics.median(statistics.median(r["tokens_per_second"][side]) for r in rows)

    print(
        f"median over prompts: ours x{med('ours_speedup'):.2f} ({tmed('ours-spec'):.1f} tok/s), llama.cpp "
        f"x{med('llama_speedup'):.2f} ({tmed('llama-spec'):.1f} tok/s); plain {tmed('ours-plain'):.1f} / "
        f"{tmed('llama-plain'):.1f} tok/s"
    )
    from specdec.info import collect

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "settings": vars(a) | {"out": str(a.out), "prompts": str(a.prompts)},
                "machine": collect(bandwidth=False)["cpu"],
                "llama_cpp_python": llama_server.LLAMA_CPP_PYTHON,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
