"""One copy of a model's weight blocks on disk: the packed q4k file, not also the GGUF.

The q4k mode runs the GGUF's own Q4_K/Q6_K blocks, repacked into the kernel's tiles
(`kquant.tiles`: a rearrangement, float16 scales widened to float32, 6-bit scales unpacked;
nothing rounded). Keeping the GGUF's copy of those blocks as well doubled the cache. So once a
model installed in the cache is packed, `sparsify` checks that every such tensor comes back
from its tiles byte for byte (`kquant.untiles`, `kquant.to_gguf`), writes a note beside the GGUF
(`<file>.gguf.blocks.json`: which tensors, which packed file), and punches holes where those
tensors' bytes were (`fallocate`; the file keeps its size, offsets and modification time).
What else the GGUF holds stays: header, tokenizer, norms, biases, the embedding table (the
q4k mode reads its rows from the GGUF) and tensors of other types (re-quantized when packed).

Everything that reads weight blocks from the GGUF goes through here: `tensor_data` gives one
tensor's bytes (from the tiles where they were punched), and `full` puts the whole file back
(for transformers' float conversion, llama.cpp, or repacking after a kernel change) and checks
it against the model's pinned sha256 before anything reads it. Files outside the cache (a
user's own .gguf) are never touched; where the file system cannot punch holes, nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
from filelock import FileLock

from . import kquant
from .families import gguf_linear, llama_rows
from .gguf_reader import open_gguf

SUFFIX = ".blocks.json"
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


class BlocksLostError(RuntimeError):
    """The packed file that holds a GGUF's punched blocks is gone or no longer fits."""


def note_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + SUFFIX)


def state(gguf: str | os.PathLike[str]) -> dict | None:
    """The note of a sparse GGUF (None for a whole file)."""
    p = note_path(Path(gguf))
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return None


def disk_bytes(path: Path) -> int:
    """Bytes a file takes on disk (holes not counted)."""
    st = path.stat()
    return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size


def _in_cache(gguf: Path) -> bool:
    from ..paths import cache_root

    return gguf.resolve().parent == (cache_root() / "gguf").resolve()


@cache
def _lock(path: str) -> FileLock:  # one object per file: re-entrant within a process
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path)


def lock(gguf: Path) -> FileLock:
    """Serializes sparsifying, restoring and repacking one cached GGUF across processes: the
    lock file is in that GGUF's cache (whatever SPECDEC_HOME says now)."""
    gguf = Path(gguf).resolve()
    return _lock(str(gguf.parent.parent / "locks" / f"{gguf.name}.blocks.lock"))


def managed(gguf: Path) -> bool:
    """Whether this GGUF is one `sparsify` may punch (it is in the cache) or has punched."""
    return state(gguf) is not None or _in_cache(Path(gguf))


# -- the blocks of one tensor -----------------------------------------------------------------


def _blocks_from_packed(packed: Path, entry: dict) -> np.ndarray:
    """The GGUF bytes [rows, bytes per row] of one punched tensor, rebuilt from its tiles."""
    from safetensors import safe_open

    if not packed.exists():
        raise BlocksLostError(f"{packed} is gone")
    with safe_open(str(packed), framework="pt") as f:
        kinds = f.metadata() or {}
        if entry["module"] not in kinds:
            raise BlocksLostError(f"{packed} has no {entry['module']}")
        tiles = f.get_tensor(entry["module"]).numpy()
    kind = int(kinds[entry["module"]])
    blocks = kquant.untiles(tiles, kind, entry["rows"])
    if entry.get("heads"):  # llama q/k rows were put in transformers' order when packed
        order = llama_rows(entry["rows"], entry["heads"])
        blocks = blocks.permute_rows(np.argsort(order))
    return kquant.to_gguf(blocks)


def tensor_data(gguf: Path, name: str, data: np.ndarray) -> np.ndarray:
    """A tensor's bytes as the GGUF file had them: `data` (its memory-mapped bytes) unless the
    tensor was punched, then rebuilt from the packed tiles."""
    info = state(gguf)
    entry = info and info["tensors"].get(name)
    if not entry:
        return data
    _check_format(Path(gguf), info)
    try:
        raw = _blocks_from_packed(Path(info["packed"]), entry)
    except BlocksLostError as exc:
        raise BlocksLostError(_lost(Path(gguf), str(exc))) from None
    return raw.reshape(data.shape)


def _lost(gguf: Path, why: str) -> str:
    name = (state(gguf) or {}).get("name", "NAME")
    return (
        f"{gguf.name}: its weight blocks were kept only in the q4k packed file, and {why}; install it "
        f"again (downloads it): specdec models install {name}"
    )


def held_packings() -> set[Path]:
    """The packed files that hold punched blocks of a GGUF in the cache."""
    from ..paths import cache_root

    held = set()
    for note in (cache_root() / "gguf").glob(f"*{SUFFIX}"):
        try:
            held.add(Path(json.loads(note.read_text())["packed"]).resolve())
        except (OSError, ValueError, KeyError):
            continue
    return held


def recoverable(gguf: Path) -> bool:
    """Whether the GGUF is whole or its punched blocks can be rebuilt (their packed file is
    there, in this version's tile layout)."""

    info = state(gguf)
    return info is None or (Path(info["packed"]).exists() and info.get("format") == kquant.tile_format())


def _check_format(gguf: Path, info: dict) -> None:

    if info.get("format") != kquant.tile_format():
        raise BlocksLostError(_lost(gguf, "that file's tile layout is not this version's"))


# -- whole files -------------------------------------------------------------------------------


@cache
def _fallocate() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def _punch(fd: int, offset: int, length: int) -> bool:
    fn = _fallocate()
    if fn is None:
        return False
    if fn(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def _same_mtime(path: Path) -> Iterator[None]:
    """The file's content means the same before and after: keep its modification time (the
    packed file's cache key and open_gguf's parse cache use it)."""
    st = path.stat()
    try:
        yield
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _write_note(gguf: Path, info: dict) -> None:
    note = note_path(gguf)
    tmp = note.with_name(f"{note.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, note)


def _regions(gguf: Path, names: list[str]) -> list[tuple[int, int]]:

    tensors = {t.name: t for t in open_gguf(gguf).tensors}
    return [(int(tensors[n].data_offset), int(tensors[n].n_bytes)) for n in names]


def _punch_with_note(gguf: Path, info: dict) -> bool:
    """Write the note, then punch its tensors (a crash in between leaves a file `restore`
    mends); where the file system cannot punch, the note goes and nothing changed."""
    _write_note(gguf, info)
    with _same_mtime(gguf), open(gguf, "r+b") as f:
        for offset, length in _regions(gguf, list(info["tensors"])):
            if not _punch(f.fileno(), offset, length):
                note_path(gguf).unlink(missing_ok=True)
                return False
    return True


def sparsify(gguf: Path, packed: Path, *, pin: tuple[str, str] | None, args) -> int:
    """Punch out of a cached GGUF the tensors `packed` holds losslessly (checked byte for byte).
    `pin`: the registered model's (name, pinned sha256), which the file is checked against when
    it is made whole again; None (a file of one's own) leaves it alone. Returns the bytes freed
    (0 where nothing could be or was done)."""
    from gguf import GGMLQuantizationType

    gguf = Path(gguf)
    if pin is None or not _in_cache(gguf) or not packed.exists() or _fallocate() is None:
        return 0
    from safetensors import safe_open

    with lock(gguf):
        if state(gguf) is not None:
            return 0
        with safe_open(str(packed), framework="pt") as f:
            modules = set(f.keys())
        tensors = {t.name: t for t in open_gguf(gguf).tensors}
        info = {
            "name": pin[0],
            "sha256": pin[1],
            "packed": str(packed.resolve()),
            "format": kquant.tile_format(),
            "tensors": {},
        }
        candidates = {}
        for module in sorted(modules):
            where = gguf_linear(module, args)
            t = tensors.get(where.tensor) if where is not None else None
            if (
                t is None
                or where.tensor == "token_embd.weight"  # the q4k mode reads embedding rows from the GGUF
                or where.first_row is not None  # a stacked tensor (several layers' rows) stays whole
                or t.tensor_type not in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)
            ):
                continue
            candidates[where.tensor] = {"module": module, "rows": int(t.shape[1]), "heads": where.interleaved_heads}

        def comes_back(name: str) -> bool:
            entry = candidates[name]
            try:
                rebuilt = _blocks_from_packed(packed, entry)
            except (BlocksLostError, ValueError):
                return False
            return np.array_equal(rebuilt, np.asarray(tensors[name].data).reshape(entry["rows"], -1))

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:  # numpy releases the GIL
            same = dict(zip(candidates, pool.map(comes_back, candidates), strict=True))
        info["tensors"] = {name: entry for name, entry in candidates.items() if same[name]}
        if not info["tensors"]:
            return 0
        before = disk_bytes(gguf)
        if not _punch_with_note(gguf, info):
            return 0
        return max(0, before - disk_bytes(gguf))


def restore(gguf: Path) -> bool:
    """Write a sparse GGUF's punched blocks back from the packed tiles and check the whole file
    against its pinned sha256. Returns whether anything was written."""
    from ..paths import sha256_file

    gguf = Path(gguf)
    if state(gguf) is None:  # (a whole file needs no lock: nothing here makes a file sparse but sparsify)
        return False
    with lock(gguf):
        info = state(gguf)
        if info is None:
            return False
        _check_format(gguf, info)
        names = list(info["tensors"])
        with _same_mtime(gguf), open(gguf, "r+b") as f:
            for name, (offset, length) in zip(names, _regions(gguf, names), strict=True):
                try:
                    raw = _blocks_from_packed(Path(info["packed"]), info["tensors"][name])
                except BlocksLostError as exc:
                    raise BlocksLostError(_lost(gguf, str(exc))) from None
                if raw.nbytes != length:
                    raise BlocksLostError(_lost(gguf, f"{name} does not come back at its size"))
                f.seek(offset)
                f.write(raw.tobytes())
            f.flush()
            os.fsync(f.fileno())
        if sha256_file(gguf) != info["sha256"]:
            raise BlocksLostError(_lost(gguf, "the file rebuilt from it does not match its pinned sha256"))
        note_path(gguf).unlink()
        return True


@contextlib.contextmanager
def full(gguf: Path | None, *, punch_again: bool = True) -> Iterator[None]:
    """The whole GGUF for the duration (for readers of every weight: transformers, llama.cpp,
    the packer). With `punch_again`, a file that was sparse is made sparse again afterwards
    (the same tensors: `restore` just proved they come back byte for byte)."""
    if gguf is None or state(gguf) is None:
        yield
        return
    with lock(gguf):
        info = state(gguf)
        restore(gguf)
        try:
            yield
        finally:
            if punch_again and info is not None and Path(info["packed"]).exists():
                _punch_with_note(gguf, info)
