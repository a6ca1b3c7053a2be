"""Reading a model's weights straight from its GGUF file, as transformers would convert them.

The default (q4k) mode needs no float copy of a model: its linear layers run the file's own
K-quant blocks, its norms and biases are a few megabytes, and its embedding rows are
de-quantized when a token is looked up. This module gives those pieces, bit for bit what
transformers' GGUF conversion produces (the same de-quantizer, the same llama q/k row order,
the same Gemma norm offset), so a model loaded from the GGUF computes exactly what one loaded
from a converted float directory computes (tested).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, get_tensor_name_map
from gguf.constants import MODEL_ARCH_NAMES
from gguf.quants import dequantize as gguf_dequantize

from . import kquant, native
from .families import family, gguf_linear, llama_rows
from .gguf_reader import GGUFFile, open_gguf
from .sparse import tensor_data


def _name_map(model_type: str, n_layers: int):  # noqa: ANN202
    arch = family(model_type).gguf_arch
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
    data = tensor_data(Path(reader.data.filename), name, t.data)  # rebuilt from the q4k tiles if punched
    return t if data is t.data else t._replace(data=data)


# GGML's legacy 32-weight types: type -> bytes per block (csrc/kquant.c de-quantizes them)
_LEGACY = {
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
    GGMLQuantizationType.Q5_0: 22,
    GGMLQuantizationType.Q5_1: 24,
    GGMLQuantizationType.Q8_0: 34,
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's `dequantize` (what transformers uses), as a new float32 array: the legacy types
    in the native library where it is built (the same bits, tested; it matters for the LM
    heads an install re-quantizes), the rest by gguf."""
    size = _LEGACY.get(qtype)
    if size is not None:
        lib = native.library_or_none()
        raw = np.ascontiguousarray(data, np.uint8)
        if lib is not None and raw.ndim >= 1 and raw.shape[-1] % size == 0:
            out = np.empty((*raw.shape[:-1], raw.shape[-1] // size * 32), np.float32)
            if (
                lib.specdec_dequantize_legacy(
                    int(qtype), raw.ctypes.data, raw.size // size, out.ctypes.data, torch.get_num_threads()
                )
                == 0
            ):
                return out
    return np.array(gguf_dequantize(data, qtype), dtype=np.float32)  # a copy: F32 tensors come back memory-mapped


def float_tensor(reader: GGUFReader, name: str, args) -> np.ndarray:  # noqa: ANN001 - ModelArgs
    """One tensor de-quantized to float32 and transformed as transformers' GGUF loader does."""
    t = _tensor(reader, name)
    w = dequantize(t.data, t.tensor_type)
    fam = family(args.model_type)
    if fam.gguf_qk_interleaved and (".attn_q." in name or ".attn_k." in name):
        heads = args.n_heads if ".attn_q." in name else args.n_kv_heads
        w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
    if fam.gguf_norm_plus_one and "norm.weight" in name:
        w = w - 1  # transformers stores Gemma's (1 + w) norms as w
    return w


def linear_weight(path: str | os.PathLike[str], module: str, args) -> np.ndarray:  # noqa: ANN001 - ModelArgs
    """One of our linear layers' weights [out, in] in float32, from the GGUF (its rows of a
    stacked tensor where the family stacks them)."""
    where = gguf_linear(module, args)
    if where is None:
        raise KeyError(f"{module} is not a linear layer of a {args.model_type} decoder")
    w = float_tensor(open_gguf(path), where.tensor, args)
    if where.first_row is None:
        return w
    return np.ascontiguousarray(w[where.first_row : where.first_row + where.rows])


def small_state(reader: GGUFReader, keys: list[str], args) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The tensors a decoder keeps in float in every mode (norms, biases), by state-dict key."""
    return {
        k: torch.from_numpy(
            np.ascontiguousarray(float_tensor(reader, tensor_name(k, args.model_type, args.n_layers), args))
        )
        for k in keys
    }


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


# -- what a file says it is ----------------------------------------------------------------
class UnsupportedArchitectureError(ValueError):
    pass


def gguf_truncation(path: Path) -> str | None:
    """'truncated: N bytes, its tensor table needs M' when a GGUF file ends before the tensor
    data its header describes (a download or copy cut short); None when it does not, or when
    the header itself cannot be read. Reads the header and tensor table with the gguf
    package's reader, stopping before it maps the tensors (where a short file fails with a
    reshape error that names neither size)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class _Header(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:  # the tensor table only
            self.table = (start_offs, fields)

    class _FastHeader(_Header, GGUFFile):
        pass

    try:
        start, fields = _FastHeader(str(path), "r").table
        need = 0
        for f in fields:  # parts: name length, name, n_dims, dims, type, offset (gguf's layout)
            _, _, _, dims, raw_type, offset = f.parts
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            need = max(need, int(start + offset[0]) + int(np.prod(dims)) * size // block)
    except Exception:  # a header the reader cannot parse: no size to compare
        return None
    have = path.stat().st_size
    return f"truncated: {have} bytes, its tensor table needs {need}" if have < need else None


def gguf_architecture(path: Path) -> str:
    try:
        reader = open_gguf(path)
    except Exception as exc:  # the gguf reader raises plain ValueError/struct errors on junk
        short = gguf_truncation(path)
        if short is not None:
            raise UnsupportedArchitectureError(
                f"{path} is {short} (a download or copy cut short; fetch it again)"
            ) from None
        raise UnsupportedArchitectureError(f"{path} is not a readable GGUF file: {exc}") from exc
    field = reader.fields.get("general.architecture")
    if field is None:
        raise UnsupportedArchitectureError(f"{path} has no general.architecture field")
    try:
        return bytes(field.parts[field.data[0]]).decode()
    except (UnicodeDecodeError, IndexError) as exc:
        raise UnsupportedArchitectureError(
            f"{path} is not a readable GGUF file: its architecture field is damaged ({exc})"
        ) from None


def _field(reader: GGUFReader, key: str):  # noqa: ANN202 - a scalar or a string
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0] == GGUFValueType.STRING else value.tolist()[0]


def config_fixes(reader: GGUFReader, model_type: str, config: dict) -> dict:
    """What transformers' GGUF reading leaves out of a config that llama.cpp reads from the same
    file: the head size (`attention.key_length`, which Qwen3 sets apart from hidden / heads), a
    sliding window (Phi-3), and Llama 3's rotary scaling (llama.cpp keeps it as the divisors in
    `rope_freqs.weight`; transformers needs its parameters). Returns the config keys to set."""
    from .families import llama3_from_factors

    arch = family(model_type).gguf_arch
    out: dict = {}
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None and head_dim != config.get("head_dim"):
        out["head_dim"] = int(head_dim)
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window and not config.get("sliding_window"):
        out["sliding_window"] = int(window)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        rope = dict(config.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
        dim = out.get("head_dim") or config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        context = _field(reader, f"{arch}.rope.scaling.original_context_length")
        scaling = llama3_from_factors([float(f) for f in np.asarray(freqs.data)], dim, theta, context)
        if scaling is None:
            raise UnsupportedArchitectureError(
                "its rope_freqs (per-frequency rotary divisors) are not Llama 3's scaling, the only one read"
            )
        out["rope_parameters"] = {**rope, "rope_theta": theta, **scaling}
    return out


class UnsupportedBlockTypeError(ValueError):
    """A linear layer's tensor is stored in a type the kernel does not run (IQ*, Q2_K, Q3_K...)."""


def block_types(path: str | os.PathLike[str]) -> dict[str, int]:
    """The block types of a GGUF's two-dimensional tensors (the linear layers and the
    embedding): type name -> tensor count."""
    out: dict[str, int] = {}
    for t in open_gguf(path).tensors:
        if len(t.shape) == 2:
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def unsupported_type(path: Path, tensor: str, qtype: GGMLQuantizationType) -> UnsupportedBlockTypeError:
    runs = ", ".join(t.name for t in kquant.GGML_TYPES.values())
    return UnsupportedBlockTypeError(
        f"{Path(path).name}: {tensor} is stored as {qtype.name}, a block type specdec does not run (it runs "
        f"{runs}); use a file quantized to one of those (e.g. Q4_K_M), or install it with --requantize "
        "to run such tensors re-quantized to Q6_K"
    )


def gguf_blocks(path: Path, modules: dict[str, int], args) -> dict[str, kquant.Blocks]:  # noqa: ANN001 - ModelArgs
    """The file's own blocks for the linear layers (module name -> output rows), in every type the
    kernel runs (`kquant.KIND_OF_TYPE`); layers of other types are left out (the caller refuses
    or, asked to, re-quantizes them). Where the family stacks layers in one tensor (Phi-3's qkv),
    a layer's blocks are its rows of it."""
    tensors = {t.name: t for t in open_gguf(path).tensors}
    out: dict[str, kquant.Blocks] = {}
    for module, n in modules.items():
        where = gguf_linear(module, args)
        t = tensors.get(where.tensor) if where is not None else None
        if t is None or t.tensor_type not in kquant.KIND_OF_TYPE or len(t.shape) != 2:
            continue
        first, rows = where.first_row or 0, int(t.shape[1])
        if first + n > rows or (where.first_row is None and rows != n):
            continue
        data = tensor_data(Path(path), t.name, t.data)
        blocks = kquant.from_gguf(np.asarray(data), t.tensor_type, rows, int(t.shape[0]))
        if where.first_row is not None:
            blocks = kquant.Blocks(blocks.kind, np.ascontiguousarray(blocks.data[first : first + n]))
        if where.interleaved_heads:
            blocks = blocks.permute_rows(llama_rows(n, where.interleaved_heads))
        out[module] = blocks
    return out
