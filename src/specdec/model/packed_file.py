"""The q4k mode's packed-weight file: safetensors, laid out to be memory-mapped.

A packed file holds one uint8 tensor of kernel tiles per linear layer (`kquant.tiles`). It is a
plain safetensors file (`safe_open` reads it), written so that the data starts on a 64-byte
boundary (the header padded with spaces, as the format allows); every tile is a whole number of
cache lines, so every tensor starts on one too. A load then maps the file instead of copying
it: the weights are the page cache's pages, shared by every process that runs the model (a
server and a benchmark beside it), read in as the first pass touches them, and a 9 GB model
costs 9 GB of memory, not a copy on top of the file's cached pages.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch

ALIGN = 64


def save(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str]) -> None:
    """Write uint8 tensors (each a whole number of 64-byte lines) to `path`, whole or not at all
    (a file of this process beside it, renamed over it)."""
    header: dict[str, object] = {"__metadata__": metadata}
    at = 0
    for name, t in tensors.items():
        if t.dtype != np.uint8 or t.nbytes % ALIGN:
            raise ValueError(f"{name}: packed tensors are uint8 whole cache lines ({t.dtype}, {t.nbytes} bytes)")
        header[name] = {"dtype": "U8", "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t in tensors.values():
            np.ascontiguousarray(t).tofile(f)
    os.replace(tmp, path)  # atomic: a concurrent load never reads half a file


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a packed file, mapped read-only (copied only where a tensor is not on a
    64-byte boundary: a file written by an earlier version), and its metadata."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {}) or {}
    start = 8 + n
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # the mapping is read-only; nothing writes the weights
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, info in header.items():
            if info["dtype"] != "U8":
                raise ValueError(f"{path}: {name} is {info['dtype']}, not a packed uint8 tensor")
            lo, hi = (start + o for o in info["data_offsets"])
            arr = mapped[lo:hi].reshape(info["shape"])
            out[name] = torch.from_numpy(arr if lo % ALIGN == 0 else np.array(arr))
    return out, meta
