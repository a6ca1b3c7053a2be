"""Reading a model's weights straight from its GGUF file, as transformers would convert them.

The default (q4k) mode needs no float copy of a model: its linear layers run the file's own
K-quant blocks, its norms and biases are a few megabytes, and its embedding rows are
de-quantized when a token is looked up. This module gives those pieces, bit for bit what
transformers' GGUF conversion produces (the same de-quantizer, the same llama q/k row order,
the same Gemma norm offset), so a model loaded from the GGUF computes exactly what one loaded
from a converted float directory computes (tested).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, get_tensor_name_map
from gguf.constants import MODEL_ARCH_NAMES
from gguf.quants import dequantize

# model_type (config.json) -> GGUF architecture
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}


class GGUFFile(GGUFReader):
    """gguf's reader, 4x faster on files with large vocabularies: it reads the header through a
    plain array instead of one `np.memmap` slice per token string (the Qwen tokenizer's 300k
    strings took 11 s). Fields and tensors are the same objects the base class builds."""

    _plain: np.ndarray | None = None

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:  # noqa: ANN001
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        count = int(count)
        arr = self._plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path, "r")


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """A parsed GGUF file, parsed once per process (per path, size and modification time)."""
    st = os.stat(path)
    return _open(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def _name_map(model_type: str, n_layers: int):  # noqa: ANN202
    arch = GGUF_ARCH[model_type]
    return get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), n_layers)


def tensor_name(key: str, model_type: str, n_layers: int) -> str:
    """The GGUF tensor behind a Hugging Face state-dict key (gguf's own name table, as
    transformers uses it)."""
    stem, _, suffix = key.rpartition(".")
    name = _name_map(model_type, n_layers).get_name(stem)
    if name is None:
        raise KeyError(f"no GGUF tensor for {key}")
    return f"{name}.{suffix}"


def _tensor(reader: GGUFReader, name: str):  # noqa: ANN202 - gguf's ReaderTensor
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        raise KeyError(f"{reader.data.filename}: no tensor {name}")
    return t


def float_tensor(reader: GGUFReader, name: str, args) -> np.ndarray:  # noqa: ANN001 - ModelArgs
    """One tensor de-quantized to float32 and transformed as transformers' GGUF loader does."""
    t = _tensor(reader, name)
    w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy: F32 tensors come back memory-mapped
    if args.model_type == "llama" and (".attn_q." in name or ".attn_k." in name):
        heads = args.n_heads if ".attn_q." in name else args.n_kv_heads
        w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
    if args.model_type == "gemma3_text" and "norm.weight" in name:
        w = w - 1  # transformers stores Gemma's (1 + w) norms as w
    return w


def small_state(reader: GGUFReader, keys: list[str], args) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The tensors a decoder keeps in float in every mode (norms, biases), by state-dict key."""
    return {k: torch.from_numpy(np.ascontiguousarray(float_tensor(reader, tensor_name(k, args.model_type, args.n_layers), args)))
            for k in keys}  # fmt: skip


class GGUFEmbedding(torch.nn.Module):
    """An embedding table left in the GGUF file's blocks: rows are de-quantized when looked up
    (a few per decoding step), so the table costs no float memory or disk. `weight`, the whole
    table in float32, is built on first use (drafters with trained heads read it)."""

    def __init__(self, path: str | os.PathLike[str], name: str, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        t = _tensor(open_gguf(path), name)
        self.path, self.name = Path(path), name
        self.rows = t.data  # [V, bytes per row] (quantized) or [V, dim] (float types), memory-mapped
        self.qtype = t.tensor_type
        self.num_embeddings, self.embedding_dim = int(t.shape[1]), int(t.shape[0])
        self.out_dtype = dtype
        self._table: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        rows = dequantize(np.asarray(self.rows[flat]), self.qtype)  # [N, dim]
        out = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(self.out_dtype)
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    @property
    def weight(self) -> torch.Tensor:
        if self._table is None:
            table = dequantize(np.asarray(self.rows), self.qtype)
            self._table = torch.from_numpy(np.ascontiguousarray(table, dtype=np.float32)).to(self.out_dtype)
        return self._table

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} rows from {self.path.name}"
