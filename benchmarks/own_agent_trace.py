"""Build an agent trace of tasks the project does not ship, for checking server claims beside the
bundled trace (`specdec bench serve --trace FILE`): coding sessions in which every request
resends the growing conversation — a task, the agent's code, a refactor asked for ("reply with
the whole file"), then docstrings and tests — with the agent's turns written by the target
itself (greedy, in process, through the server's own route).

The tasks are written here (small utilities: parsing, caching, text, dates), unlike the bundled
trace's HumanEval functions; nothing in the chooser was tuned on them.

    python benchmarks/own_agent_trace.py --out own_trace.jsonl
    specdec bench serve --trace own_trace.jsonl --draft qwen2.5-coder-0.5b --methods suffix prompt-lookup auto
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import specdec

SYSTEM = "You are a coding agent. You write and revise Python code. Reply with code in one ```python block."
TASKS = {
    "csv-line": "Write a function split_csv_line(line) that splits one CSV line into fields, honouring double "
    "quotes (a quoted field may contain commas, and two double quotes inside one stand for a quote).",
    "lru-cache": "Write a class LRUCache with get(key) and put(key, value) and a capacity given to the "
    "constructor; the least recently used entry is evicted when it is full.",
    "roman": "Write a function roman_to_int(s) that converts a Roman numeral such as 'MCMXCIV' to an integer, "
    "and int_to_roman(n) for the other direction.",
    "durations": "Write a function parse_duration(text) that turns strings like '1h30m', '45s' or '2h 5m 10s' "
    "into a number of seconds.",
}
FOLLOW_UPS = [
    "Rename the main function's parameters to clearer names and use f-strings where it formats text. Reply with "
    "the whole file.",
    "Add a docstring to every function and pytest tests for normal and edge cases. Reply with the whole file.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    from fastapi.testclient import TestClient

    from specdec.server import ServeSettings, create_app

    target = specdec.load(ns.target)
    app = create_app(target, None, ServeSettings(target.name, "suffix", {}, prefix_tokens=0))
    lines, t0 = [], time.perf_counter()
    with TestClient(app) as client:
        for name, task in TASKS.items():
            messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
            for turn in range(1 + len(FOLLOW_UPS)):
                body = {"model": target.name, "messages": messages, "max_tokens": ns.max_tokens, "temperature": 0.0}
                r = client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                answer = {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
                lines.append(
                    {"conversation": name, "turn": turn, "messages": list(messages), "max_tokens": ns.max_tokens}
                )
                print(
                    f"{name} turn {turn}: {r.json()['usage']['completion_tokens']} tokens "
                    f"({time.perf_counter() - t0:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                if turn < len(FOLLOW_UPS):
                    messages = [*messages, answer, {"role": "user", "content": FOLLOW_UPS[turn]}]
    ns.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{len(lines)} requests in {len(TASKS)} conversations -> {ns.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
