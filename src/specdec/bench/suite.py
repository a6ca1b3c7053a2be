"""The benchmark's prompt suite: JSONL, one prompt per line.

Each line is ``{"id": str, "category": str, "turns": [{"role": ..., "content": ...}, ...]}``;
roles are "system", "user" and "assistant", and the last turn is the user's (the model
answers it). The bundled suite (`prompts/suite.jsonl`, written for specdec, no copied
datasets) has ten prompts in each of eight categories, from a few dozen tokens to ~4,300
for the input-grounded ones (summarisation, answering from retrieved passages); a user's
file in the same format replaces it (`specdec bench --prompts FILE`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUITE = Path(__file__).parent / "prompts" / "suite.jsonl"
CATEGORIES = ("chat", "translation", "summarisation", "qa", "math", "rag", "code-generation", "code-editing")
INPUT_GROUNDED = frozenset({"summarisation", "rag", "code-editing"})  # outputs copy spans of the input
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: tuple[dict[str, str], ...]  # chat messages, the last one the user's


def _parse(line: str, where: str, answered: bool = False) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply; each line must be one flat prompt object") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with id, category and turns")
    missing = [key for key in ("id", "category", "turns") if key not in obj]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; each prompt needs id, category and turns")
    pid, category, turns = obj["id"], obj["category"], obj["turns"]
    if not isinstance(pid, str) or not pid or not isinstance(category, str) or not category:
        raise ValueError(f"{where}: id and category must be non-empty strings")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where} ({pid}): turns must be a non-empty list of {{role, content}} messages")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise ValueError(f'{where} ({pid}): turn {i} must be {{"role": one of {"/".join(ROLES)}, "content": text}}')
    if turns[-1]["role"] != "user" and not answered:
        raise ValueError(f"{where} ({pid}): the last turn must be the user's (the model answers it)")
    return Prompt(pid, category, tuple(turns))


def load_prompts(path: str | Path | None = None, *, answered: bool = False) -> list[Prompt]:
    """Read and check a prompt file (default: the bundled suite). Errors name the line. With
    `answered` (training data), a conversation may end with the assistant's answer."""
    path = Path(path) if path is not None else SUITE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the prompt file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"the prompt file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        p = _parse(line, f"{path.name} line {n}", answered)
        if p.id in seen:
            raise ValueError(f"{path.name} line {n}: duplicate id {p.id!r}; ids must be unique")
        seen.add(p.id)
        prompts.append(p)
    if not prompts:
        raise ValueError(f"the prompt file {path} holds no prompts; write one JSON object per line")
    return prompts


def select(prompts: list[Prompt], categories: list[str] | None = None, per_category: int | None = None) -> list[Prompt]:
    """The first `per_category` prompts of each wanted category, in file order."""
    if categories is not None:
        known = {p.category for p in prompts}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ValueError(f"no prompts in categories {unknown}; the file has {sorted(known)}")
    out: list[Prompt] = []
    counts: dict[str, int] = {}
    for p in prompts:
        if categories is not None and p.category not in categories:
            continue
        if per_category is not None and counts.get(p.category, 0) >= per_category:
            continue
        counts[p.category] = counts.get(p.category, 0) + 1
        out.append(p)
    return out
