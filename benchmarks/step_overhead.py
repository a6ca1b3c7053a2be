"""Python overhead of the decode loop per step, batch 1.

On a tiny random model (2 layers, 64 wide) the kernels cost next to nothing, so the wall
time of one decode step after the prefill (``step_ms``, median over repeats) is what the
engine, the model's Python and the drafter cost per step.

    python benchmarks/step_overhead.py [--tokens 200] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import specdec
from specdec.testing import make_tiny_model

PROMPT = "the quick brown fox jumps over the lazy dog. " * 4


def measure(target, method: str | None, tokens: int, repeats: int) -> dict[str, float]:
    steps = []
    for _ in range(repeats + 1):  # the first run warms up
        out = specdec.generate(
            target, PROMPT, drafter=method, k=4 if method else None, max_new_tokens=tokens, ignore_eos=True, chat=False
        )
        m = out.metrics
        n = m.steps or m.target_forwards or 1
        decode = m.wall_time - m.prefill_time
        steps.append(1e3 * decode / n)
    return {"step_ms": round(statistics.median(steps[1:]), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="q4k")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = specdec.load(make_tiny_model(Path(tmp) / "t", "qwen2", seed=1), dtype=ns.dtype, device="cpu")
        result = {name or "plain": measure(target, name, ns.tokens, ns.repeats) for name in (None, "prompt-lookup")}
    print(json.dumps(result, indent=1))
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
