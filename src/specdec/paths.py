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


# What stands for a file's whole sha256 once it was hashed: its size, modification time and the
# sha256 of three 1 MiB samples (start, middle, end). A file changed in place keeps its size
# only by chance and its modification time almost never, and an edit the samples miss needs
# both to hold; a command given a 9 GB model file then starts in milliseconds, not 30 s.
_SAMPLE = 1 << 20


def partial_identity(path: Path) -> str:
    """Size, modification time and a hash of three samples of the file."""
    st = path.stat()
    digest = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        for at in (0, max(0, st.st_size // 2 - _SAMPLE // 2), max(0, st.st_size - _SAMPLE)):
            f.seek(at)
            digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """A file's sha256, hashed in full the first time and then recalled while its partial
    identity (`partial_identity`) holds (the record: `file-ids.json` in the cache)."""
    path = Path(path).resolve()
    index = cache_root() / "file-ids.json"
    key = f"{path}:{partial_identity(path)}"
    try:
        known = json.loads(index.read_text())
    except (FileNotFoundError, ValueError):
        known = {}
    if key in known:
        return known[key]
    sha = sha256_file(path)
    known = {k: v for k, v in known.items() if not k.startswith(f"{path}:")} | {key: sha}
    write_json(index, known)
    return sha


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
