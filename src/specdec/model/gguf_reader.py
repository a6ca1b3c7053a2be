"""Parsing a GGUF file, once per process: gguf's reader, made fast on large vocabularies.

Below everything else that reads GGUF files (the weights reader `gguf_file`, the file puncher
`sparse`, the converter), so each of them opens a file through the same parse.
"""

from __future__ import annotations

import functools
import os
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType


class GGUFFile(GGUFReader):
    """gguf's reader, made fast on files with large vocabularies: it reads the header through a
    plain array instead of `np.memmap` slices, and walks an array field (the Qwen tokenizer's
    150k tokens and 150k merges) in one loop instead of one recursive call per element. Fields
    and tensors are the same objects the base class builds (tested part for part)."""

    _plain: np.ndarray | None = None

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:  # noqa: ANN001
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        count = int(count)
        arr = self._plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list]:
        """An array of strings or of scalars in one pass, with the parts, indices and types
        gguf's recursive walk produces; anything else (and swapped byte order) goes to it."""
        head = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or min(len(head[0]), len(head[1])) < 1:
            return super()._get_field_parts(orig_offs, raw_type)
        item, n = int(head[0][0]), int(head[1][0])
        scalar = self.gguf_scalar_to_np.get(item) if item in GGUFValueType._value2member_map_ else None
        if item != GGUFValueType.STRING and scalar is None:
            return super()._get_field_parts(orig_offs, raw_type)
        plain = self._plain
        assert plain is not None  # set by _get
        offs = orig_offs + 12
        parts: list[np.ndarray] = [*head]
        if scalar is not None:
            values = self._get(offs, scalar, n)
            if len(values) < n:
                raise ValueError(f"GGUF array at offset {orig_offs} runs past the end of the file")
            parts += [values[i : i + 1] for i in range(n)]
            offs += values.nbytes
            idxs = list(range(2, 2 + n))
        else:
            size, unpack = len(plain), struct.Struct("<Q").unpack_from
            for _ in range(n):  # each string: uint64 length, then its bytes
                if offs + 8 > size:
                    raise ValueError(f"GGUF array at offset {orig_offs} runs past the end of the file")
                end = offs + 8 + unpack(plain, offs)[0]
                if end > size:
                    raise ValueError(f"GGUF string at offset {offs} runs past the end of the file")
                parts += [plain[offs : offs + 8].view(np.uint64), plain[offs + 8 : end]]
                offs = end
            idxs = list(range(3, 3 + 2 * n, 2))
        types = [GGUFValueType.ARRAY] + ([GGUFValueType(item)] if n else [])
        return offs - orig_offs, parts, idxs, types


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path, "r")


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """A parsed GGUF file, parsed once per process (per path, size and modification time)."""
    st = os.stat(path)
    return _open(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def release_pages(path: str | os.PathLike[str]) -> None:
    """Drop a parsed GGUF's pages from this process's mapping (they stay in the page cache, and
    are read back if touched again): after its blocks were repacked, the file's pages this
    process read would otherwise count as its resident memory beside the packed copy."""
    import mmap

    mm = getattr(open_gguf(path).data, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):  # (a mapping the kernel will not advise: nothing lost)
            pass
