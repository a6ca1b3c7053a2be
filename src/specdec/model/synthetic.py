"""SYNTHETIC model files: the shapes people run, with random weights, written as llama.cpp writes them.

No 7-14B weights can be fetched here, but what a pass costs does not depend on the weights'
values: only on the architecture, the shapes and each tensor's block type. `write` makes a GGUF
at a real model's exact shape (the table `SHAPES`, from the models' published configurations)
in one of the file types people download (`FILE_TYPES`), with the tensor-type mix llama.cpp's
quantizer (`llama-quant.cpp`, `llama_tensor_get_type`) gives that type: Q4_K_M puts `attn_v`
and `ffn_down` of the layers `use_more_bits` picks in Q6_K and the output in Q6_K; Q5_K_M the
same over Q5_K; Q8_0 everything in Q8_0; Q4_0 everything in Q4_0 but the output (Q6_K). The
blocks' codes are random bytes; their float16 scales are set so that weights are of the size a
trained model's are (a few hundredths) and no scale is a NaN or an infinity.

The files are named SYNTHETIC (file name, `general.name`) wherever they appear; their text is
noise. They measure cost (`specdec bench forward`, side by side with llama.cpp on the same file);
acceptance comes from a real pair and is labelled a projection where it is combined with them.
The tokenizer is Qwen2.5's (copied from the registered Qwen GGUF, padded as llama.cpp pads it)
for the Qwen shapes, so a real Qwen2.5 draft can run against them; the others get a byte-level
tokenizer padded to their vocabulary (their vocabulary size is what the cost depends on).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType

T = GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    """A model's architecture and sizes, as its published config.json gives them."""

    arch: str  # the GGUF architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    eps: float
    context: int
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low, high, original context
    qwen_tokenizer: bool = False

    def parameters(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.ffn) + 2 * self.vocab * self.hidden


_QWEN = {"rope_theta": 1e6, "context": 32768, "qwen_tokenizer": True}
SHAPES: dict[str, Shape] = {
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, eps=1e-6, qkv_bias=True, **_QWEN),
    "qwen2.5-14b": Shape("qwen2", 5120, 48, 40, 8, 128, 13824, 152064, eps=1e-5, qkv_bias=True, **_QWEN),
    "qwen3-8b": Shape(
        "qwen3", 4096, 36, 32, 8, 128, 12288, 151936, eps=1e-6, qk_norm=True, **{**_QWEN, "context": 40960}
    ),
    "llama-3.1-8b": Shape(
        "llama", 4096, 32, 32, 8, 128, 14336, 128256, 500000.0, 1e-5, 131072, llama3_rope=(8.0, 1.0, 4.0, 8192)
    ),
    "mistral-7b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 32768, 1e6, 1e-5, 32768),
}

# file type -> (GGUF general.file_type, the type of most tensors)
FILE_TYPES: dict[str, tuple[int, GGMLQuantizationType]] = {
    "Q4_K_M": (15, T.Q4_K),
    "Q5_K_M": (17, T.Q5_K),
    "Q8_0": (7, T.Q8_0),
    "Q4_0": (2, T.Q4_0),
}

# Where each type keeps its float16 scales (byte offsets in a block) and the value they get.
_SCALES: dict[GGMLQuantizationType, tuple[tuple[int, ...], float]] = {
    T.Q4_K: ((0, 2), 1e-4),  # d, dmin: w = d sc q - dmin mn, sc, mn < 64, q < 16
    T.Q5_K: ((0, 2), 5e-5),
    T.Q6_K: ((208,), 2e-5),  # d: w = d sc (q - 32), |sc| <= 128
    T.Q8_0: ((0,), 2e-4),  # w = d q, |q| <= 128
    T.Q4_0: ((0,), 5e-3),  # w = d (q - 8)
}


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, file_type: str, layer: int, layers: int) -> GGMLQuantizationType:
    """The type llama.cpp's quantizer gives a 2-D tensor of a dense model in `file_type`."""
    base = FILE_TYPES[file_type][1]
    if name == "output.weight":
        return T.Q8_0 if base == T.Q8_0 else T.Q6_K
    more_bits = file_type in ("Q4_K_M", "Q5_K_M") and _use_more_bits(layer, layers)
    if (".attn_v." in name or ".ffn_down." in name) and more_bits:
        return T.Q6_K
    return base


def _tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], int]]:
    """(GGUF name, numpy shape [rows, cols] or [n], layer) of every tensor, in llama.cpp's order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (shape.vocab, h), -1)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), i)]
        out += [(b + "attn_q.weight", (q, h), i), (b + "attn_k.weight", (kv, h), i), (b + "attn_v.weight", (kv, h), i)]
        if shape.qkv_bias:
            out += [(b + "attn_q.bias", (q,), i), (b + "attn_k.bias", (kv,), i), (b + "attn_v.bias", (kv,), i)]
        if shape.qk_norm:
            out += [(b + "attn_q_norm.weight", (shape.head_dim,), i), (b + "attn_k_norm.weight", (shape.head_dim,), i)]
        out += [(b + "attn_output.weight", (h, q), i), (b + "ffn_norm.weight", (h,), i)]
        out += [(b + "ffn_gate.weight", (shape.ffn, h), i), (b + "ffn_up.weight", (shape.ffn, h), i)]
        out += [(b + "ffn_down.weight", (h, shape.ffn), i)]
    out += [("output_norm.weight", (h,), -1), ("output.weight", (shape.vocab, h), -1)]
    return out


def _random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: GGMLQuantizationType) -> np.ndarray:
    per, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    offsets, value = _SCALES[qtype]
    scale = np.array([value], np.float16).view(np.uint8)
    for at in offsets:
        raw[..., at : at + 2] = scale
    return raw.reshape(rows, -1)


def path_for(name: str, file_type: str) -> Path:
    from ..paths import cache_root

    return cache_root() / "synthetic" / f"{name}-{file_type}.SYNTHETIC.gguf"


def _tokenizer(w: GGUFWriter, shape: Shape, qwen_gguf: Path | None) -> None:
    """Qwen2.5's tokenizer (read from `qwen_gguf`, a Qwen2.5 GGUF), or a byte-level one, padded
    to the vocabulary with unused [PADn] tokens as llama.cpp's converter pads it."""
    if shape.qwen_tokenizer:
        if qwen_gguf is None or not Path(qwen_gguf).exists():
            raise FileNotFoundError(
                "the synthetic Qwen shapes borrow the tokenizer of qwen2.5-coder-0.5b; "
                "run `specdec models install qwen2.5-coder-0.5b` first"
            )
        fields = GGUFReader(qwen_gguf).fields
        tokens = list(fields["tokenizer.ggml.tokens"].contents())
        types = list(fields["tokenizer.ggml.token_type"].contents())
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
        w.add_token_merges(list(fields["tokenizer.ggml.merges"].contents()))
        w.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"].contents())
        w.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"].contents())
        w.add_pad_token_id(fields["tokenizer.ggml.padding_token_id"].contents())
        w.add_add_bos_token(False)
        w.add_chat_template(fields["tokenizer.chat_template"].contents())
    else:
        from tokenizers import pre_tokenizers

        tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
        types = [int(TokenType.NORMAL)] * len(tokens)
        tokens += ["<|endoftext|>"]
        types += [int(TokenType.CONTROL)]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_merges([])
        w.add_bos_token_id(len(tokens) - 1)
        w.add_eos_token_id(len(tokens) - 1)
    pad = shape.vocab - len(tokens)
    if pad < 0:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than the vocabulary of {shape.vocab}")
    w.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), shape.vocab)])
    w.add_token_types(types + [int(TokenType.UNUSED)] * pad)
    w.add_token_scores([0.0] * shape.vocab)


def write(
    name: str,
    file_type: str,
    *,
    qwen_gguf: Path | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Path:
    """The SYNTHETIC GGUF of `name` (a key of `SHAPES`) in `file_type`, written once into the
    cache (to a temporary file, renamed when whole); returns its path. `qwen_gguf`: a Qwen2.5
    GGUF whose tokenizer the Qwen shapes carry (the registered 0.5B's)."""
    if name not in SHAPES:
        raise ValueError(f"no synthetic shape {name!r}; choose one of {', '.join(SHAPES)}")
    if file_type not in FILE_TYPES:
        raise ValueError(f"no file type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    out = path_for(name, file_type)
    if out.exists():
        log(f"{out.name}: written already ({out.stat().st_size / 1e9:.1f} GB)")
        return out
    shape = SHAPES[name]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(tmp), shape.arch)
    w.add_name(f"SYNTHETIC random weights at {name}'s shape, {file_type}")
    w.add_type("model")
    w.add_file_type(FILE_TYPES[file_type][0])
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_quantization_version(2)
    _tokenizer(w, shape, qwen_gguf)
    tensors = _tensors(shape)
    if shape.llama3_rope is not None:
        from .families import llama3_factors

        tensors.append(("rope_freqs.weight", (shape.head_dim // 2,), -1))
    types: dict[str, GGMLQuantizationType] = {}
    for tname, dims, layer in tensors:
        if len(dims) == 1:
            types[tname] = T.F32
            w.add_tensor_info(tname, dims, np.dtype(np.float32), 4 * dims[0])
            continue
        qtype = types[tname] = tensor_type(tname, file_type, layer, shape.layers)
        per, size = GGML_QUANT_SIZES[qtype]
        nbytes = dims[0] * dims[1] // per * size
        w.add_tensor_info(tname, (dims[0], dims[1] // per * size), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    log(f"writing {out.name}: {shape.parameters() / 1e9:.1f}B parameters in random {file_type} blocks")
    for tname, dims, _ in tensors:
        if tname == "rope_freqs.weight":
            data = np.array(llama3_factors(shape.head_dim, shape.rope_theta, *shape.llama3_rope), np.float32)
        elif len(dims) == 1:  # norms near one, biases near zero
            noise = rng.standard_normal(dims).astype(np.float32)
            data = (0.02 * noise) if tname.endswith(".bias") else (1.0 + 0.05 * noise).astype(np.float32)
        else:
            data = _random_blocks(rng, dims[0], dims[1], types[tname])
        w.write_tensor_data(data)
    w.close()
    tmp.replace(out)
    log(f"{out.name}: {out.stat().st_size / 1e9:.2f} GB")
    return out
