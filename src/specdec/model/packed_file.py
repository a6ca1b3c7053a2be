"""The q4k mode's packed-weight file: safetensors, written layer by layer.

A packed file holds one uint8 tensor of kernel tiles per linear layer (`kquant.tiles`). It is a
plain safetensors file (`safe_open` reads it), written as the layers are packed (`Writer`: a
model's tiles are never all in memory at once while it is made), with the data on a 64-byte
boundary (the header padded with spaces, as the format allows; every tile is whole cache lines).

A load reads each layer into memory of its own rather than mapping the file: the kernels then
run on anonymous pages, which can be huge pages (numpy asks for them for large arrays), where a
mapping of the file gives 4 KB pages, and the mapped passes measured slower (docs/results.md,
2026-12-06 third entry). The file's pages the read leaves in the page cache are the kernel's to
reclaim; the process holds one copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

ALIGN = 64


def save(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str]) -> None:
    """Write uint8 tensors (each a whole number of 64-byte lines) to `path`, whole or not at all."""
    with Writer(path, list(tensors), metadata) as writer:
        for name, t in tensors.items():
            writer.add(name, t)


class Writer:
    """A packed file written layer by layer (so that a 9 GB model is never whole in memory): the
    tensors go to the file as they come, the header last, into space kept for it at the start
    (padded with spaces, as the format allows). Whole or not at all: written beside `path`,
    renamed over it when the `with` block ends (with `metadata` as it is then: a caller may add
    to it as the tensors come), deleted if it raises."""

    def __init__(self, path: Path, names: list[str], metadata: dict[str, str]) -> None:
        self.path, self.metadata = path, metadata
        self.entries: dict[str, object] = {}
        entry = 120 + max((len(n) for n in names), default=0)  # one tensor's header entry, generously
        meta = len(json.dumps(metadata)) + 64 * len(names)  # (the metadata may still grow by a kind per name)
        self.room = -(-(8 + 4096 + len(names) * entry + meta) // ALIGN) * ALIGN - 8
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = path.with_suffix(f".{os.getpid()}.tmp")
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - closed when the `with` block ends
        self.f.seek(8 + self.room)
        self.at = 0

    def add(self, name: str, t: np.ndarray) -> None:
        if t.dtype != np.uint8 or t.nbytes % ALIGN:
            raise ValueError(f"{name}: packed tensors are uint8 whole cache lines ({t.dtype}, {t.nbytes} bytes)")
        np.ascontiguousarray(t).tofile(self.f)
        self.entries[name] = {"dtype": "U8", "shape": list(t.shape), "data_offsets": [self.at, self.at + t.nbytes]}
        self.at += t.nbytes

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self._abort()
            return
        text = json.dumps({"__metadata__": self.metadata, **self.entries}, separators=(",", ":")).encode()
        if len(text) > self.room:
            self._abort()
            raise ValueError(f"the packed file's header ({len(text)} bytes) outgrew its room ({self.room})")
        self.f.seek(0)
        self.f.write(self.room.to_bytes(8, "little"))
        self.f.write(text + b" " * (self.room - len(text)))
        self.f.close()
        os.replace(self.tmp, self.path)

    def _abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a packed file, read into memory of this process (each on its own pages),
    and its metadata."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        meta = header.pop("__metadata__", {}) or {}
        out: dict[str, torch.Tensor] = {}
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if info["dtype"] != "U8":
                raise ValueError(f"{path}: {name} is {info['dtype']}, not a packed uint8 tensor")
            lo, hi = info["data_offsets"]
            buf = np.empty(hi - lo + ALIGN, np.uint8)  # (numpy asks for huge pages for a large one)
            arr = buf[-buf.ctypes.data % ALIGN :][: hi - lo]  # on a cache line
            f.seek(8 + n + lo)
            if f.readinto(memoryview(arr)) != hi - lo:
                raise ValueError(f"{path} is cut short ({name})")
            out[name] = torch.from_numpy(arr.reshape(info["shape"]))
    return out, meta
