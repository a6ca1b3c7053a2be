"""Where specdec keeps what it makes (the cache root), and the file helpers every layer uses:
a leaf module, so the model layer can place its kernels and packed weights without the install
layer."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_root() -> Path:
    if env := os.environ.get("SPECDEC_HOME"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def lock_path(key: str) -> Path:
    """The lock file serializing installs and conversions of one model (key: its sha256)."""
    path = cache_root() / "locks" / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, value: object, indent: int = 1) -> None:
    """Write JSON whole or not at all: to a file of this process beside `path`, then renamed
    over it (a reader, or a writer in another process, never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=indent) + "\n")
    tmp.replace(path)
