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
import random
from collections.abc import Callable, Iterable
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


# Words that nearly every English request of a few words holds (a prompt without one is taken for
# another language, or for code or data alone)
_ENGLISH = frozenset(
    "the a an and or to of in on for is are was be it this that what how why can you your i me my "
    "with from as do does write make give explain please".split()
)


def english(text: str) -> bool:
    """A rough test that `text` is an English request: nearly all its letters ASCII, and at least
    one of the commonest English words among its words."""
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < 0.97 * len(letters):
        return False
    return any(w.strip(".,:;!?()\"'").lower() in _ENGLISH for w in text.split())


def sharegpt_sample(
    n: int,
    seed: int,
    tokens: Callable[[str], int],
    conversations: Iterable[list[dict[str, str]]],
    max_tokens: int = 1500,
) -> list[Prompt]:
    """`n` first user turns drawn uniformly (seeded by `seed`) from `conversations` (the
    installed ShareGPT data: `data.conversations("sharegpt")`): English (`english`), at most
    `max_tokens` tokens as the target reads them (`tokens`: a turn's token count), no text twice.
    Each prompt is its own category (`sg-` and its place in the data), so a report gives each
    prompt's speedup and the median over them. Nothing of the bundled suite is among them (it
    was written for specdec)."""
    if n < 1:
        raise ValueError(f"a sample needs at least one prompt (got {n})")
    rng = random.Random(seed)
    drawn: list[tuple[float, int, str]] = []  # (random key, place, text): the n + spare smallest keys
    seen: set[str] = set()
    spare = n + 64  # (some drawn turns are longer than max_tokens once tokenized)
    for place, messages in enumerate(conversations):
        key = rng.random()  # (one draw per record, kept or not: the sample depends on the seed alone)
        first = next((m["content"].strip() for m in messages if m["role"] == "user"), "")
        if not first or first in seen or len(first) > 8 * max_tokens or not english(first):
            continue
        seen.add(first)
        if len(drawn) < spare or key < drawn[-1][0]:
            drawn.append((key, place, first))
            drawn.sort()
            del drawn[spare:]
    out = [
        Prompt(f"sg-{place}", f"sg-{place}", ({"role": "user", "content": text},))
        for _, place, text in drawn
        if tokens(text) <= max_tokens
    ][:n]
    if len(out) < n:
        raise ValueError(f"the ShareGPT data holds only {len(out)} English first turns of <= {max_tokens} tokens")
    return out


def write_prompts(prompts: list[Prompt], path: Path) -> Path:
    """`prompts` as a prompt file (`load_prompts` reads it back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"id": p.id, "category": p.category, "turns": list(p.turns)}) + "\n" for p in prompts),
        encoding="utf-8",
    )
    return path
