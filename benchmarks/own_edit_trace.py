"""Build an edit trace of files the project does not ship, for checking the predicted-outputs
claim beside the bundled edit trace (`specdec bench serve --trace FILE --methods auto
auto+prediction`): a request asks the target to change a small Python file (hand-written here:
a config loader and a text utility, ~450 tokens each) and reply with the whole file; the file
itself goes as OpenAI's `prediction`. Nothing here runs a model; nothing was tuned on it.

    python benchmarks/own_edit_trace.py --out own_edit_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edit_trace import request_line  # (run from benchmarks/: the bundled edit trace's request format)

CONFIG = '''import json
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 2
    log_level: str = "info"
    allowed_origins: list[str] = field(default_factory=list)


def read_settings(path: str | Path) -> Settings:
    """Read settings from a JSON file; missing keys keep their defaults."""
    data = json.loads(Path(path).read_text())
    settings = Settings()
    for key, value in data.items():
        if not hasattr(settings, key):
            raise KeyError(f"unknown setting {key!r} in {path}")
        setattr(settings, key, value)
    return settings


def apply_environment(settings: Settings) -> Settings:
    """Environment variables APP_HOST, APP_PORT, APP_WORKERS override the file."""
    if "APP_HOST" in os.environ:
        settings.host = os.environ["APP_HOST"]
    if "APP_PORT" in os.environ:
        settings.port = int(os.environ["APP_PORT"])
    if "APP_WORKERS" in os.environ:
        settings.workers = int(os.environ["APP_WORKERS"])
    return settings


def validate(settings: Settings) -> None:
    if not 0 < settings.port < 65536:
        raise ValueError(f"port {settings.port} is out of range")
    if settings.workers < 1:
        raise ValueError("at least one worker is needed")
    if settings.log_level not in ("debug", "info", "warning", "error"):
        raise ValueError(f"unknown log level {settings.log_level!r}")


def load(path: str | Path) -> Settings:
    settings = apply_environment(read_settings(path))
    validate(settings)
    return settings
'''
TEXT = '''import re
import unicodedata

WORD = re.compile(r"[A-Za-z0-9]+")


def slugify(text: str, max_length: int = 60) -> str:
    """A lowercase, ASCII, dash-separated version of `text` for use in URLs."""
    normal = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    words = WORD.findall(normal.lower())
    slug = "-".join(words)
    if len(slug) > max_length:
        slug = slug[:max_length].rsplit("-", 1)[0]
    return slug


def word_count(text: str) -> int:
    return len(WORD.findall(text))


def truncate(text: str, limit: int, ellipsis: str = "...") -> str:
    """Cut `text` to at most `limit` characters at a word boundary."""
    if len(text) <= limit:
        return text
    cut = text[: limit - len(ellipsis)]
    if " " in cut:
        cut = cut.rsplit(" ", 1)[0]
    return cut + ellipsis


def title_case(text: str, small_words: tuple[str, ...] = ("a", "an", "the", "of", "and", "in")) -> str:
    words = text.split()
    out = []
    for i, word in enumerate(words):
        if i > 0 and word.lower() in small_words:
            out.append(word.lower())
        else:
            out.append(word[:1].upper() + word[1:].lower())
    return " ".join(out)


def initials(name: str) -> str:
    return "".join(part[0].upper() for part in name.split() if part)
'''
EDITS = {
    "config": (
        CONFIG,
        [
            ("rename", "Rename the function `read_settings` to `read_settings_file` everywhere in the file."),
            ("default", "Change the default port to 8000 and the default number of workers to 4."),
            ("env", "Also let an environment variable APP_LOG_LEVEL override the log level, like the others."),
        ],
    ),
    "text": (
        TEXT,
        [
            ("rename", "Rename the function `truncate` to `shorten` everywhere in the file."),
            ("docstrings", "Add a one-line docstring to `word_count`, `title_case` and `initials`."),
            ("parameter", "Give `initials` a keyword parameter `separator: str = ''` placed between the initials."),
        ],
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    lines = []
    for name, (code, asks) in EDITS.items():
        block = f"```python\n{code}```"
        for kind, ask in asks:
            lines.append(request_line(f"{name}-{kind}", ask, block, 160 + len(code) // 2))
    ns.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {ns.out}: {len(lines)} edit requests", file=sys.stderr)


if __name__ == "__main__":
    main()
