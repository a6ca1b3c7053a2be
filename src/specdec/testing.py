"""Tiny random models with a byte tokenizer, for tests and examples that must run in seconds.

`make_tiny_model` writes an ordinary Hugging Face directory (config.json, safetensors,
tokenizer), so tiny models go through exactly the loader real models use, and transformers
can load the same directory as a reference oracle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

N_BYTES = 256
SPECIALS = ("<eos>", "<bos>")


def byte_tokenizer(vocab_size: int = N_BYTES + len(SPECIALS)):
    """A byte-level tokenizer: one token per byte, then <eos>, <bos>; padded to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i, s in enumerate(SPECIALS):
        vocab[s] = N_BYTES + i
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")
    fast.add_special_tokens({"additional_special_tokens": [t for t in vocab if t.startswith("<unused")]})
    return fast


def _special_ids(vocab_size: int) -> dict[str, int | None]:
    if vocab_size < N_BYTES + len(SPECIALS):  # too small for bytes: ids only, no specials
        return {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
    return {"eos_token_id": N_BYTES, "bos_token_id": N_BYTES + 1, "pad_token_id": N_BYTES}


def tiny_config(
    arch: str = "llama",
    *,
    vocab_size: int = 264,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_pos: int = 512,
    sliding_window: int = 8,
):
    """transformers' config of a tiny random model: `arch` is a family's model_type (or "gemma3",
    or "llama3": Llama with Llama 3's rotary scaling); see `specdec.model.families`."""
    from .model.families import tiny_config as family_config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        **_special_ids(vocab_size),
        initializer_range=0.2,
        sliding_window=sliding_window,
    )
    return family_config(arch, common)


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    base: str | Path | None = None,
    noise: float = 0.0,
    tokenizer: bool = True,
    **config_kwargs,
) -> Path:
    """Write a random model. With `base`, start from that model's weights and add Gaussian
    noise of relative size `noise` (a draft that agrees with its target only sometimes)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if base is not None:
        gen = torch.Generator().manual_seed(seed)
        state = load_file(str(Path(base) / "model.safetensors"))
        for name, p in model.named_parameters():
            src = state.get(name)
            if src is None:  # tied lm_head
                continue
            p.data.copy_(src + noise * src.std() * torch.randn(src.shape, generator=gen))
    model.save_pretrained(out)
    if tokenizer:  # a vocabulary smaller than the bytes (statistical tests) has no tokenizer
        byte_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out


def write_tiny_gguf(
    model_dir: str | Path, out: str | Path, *, name: str = "tiny", q4k: bool = False, kind: int | None = None
) -> Path:
    """A tiny model's directory written as llama.cpp writes its family into a GGUF file (with the
    gguf package): its metadata, its byte tokenizer, and float32 tensors under GGUF names — llama's
    q/k rows interleaved for rotary, Gemma's norms stored as 1 + w, Phi-3's stacked layers kept
    stacked, Llama 3's rotary scaling as `rope_freqs`. With `q4k`, the layers' weights whose rows
    are whole 256-weight blocks are written in Q4_K blocks; with `kind` (a `kquant` kind of the
    file's own: Q5_K, Q8_0, Q4_0, F16...), the layers' weights whose rows are whole blocks of
    that type are written in it. specdec's GGUF reader is tested on it."""
    import json

    from gguf import GGUFWriter, TokenType, get_tensor_name_map
    from gguf.constants import MODEL_ARCH_NAMES
    from safetensors.torch import load_file

    from .model.families import family, llama3_factors, rope_parameters

    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    fam = family(cfg["model_type"])
    arch = fam.gguf_arch
    n_layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = rope_parameters(cfg)
    w = GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(rope.get("rope_theta", 10_000.0)))
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == cfg["vocab_size"], "the tokenizer must cover the vocabulary"
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    w.add_token_merges([])
    w.add_token_scores([0.0] * len(tokens))  # (an empty merges list reads back as none: transformers derives them)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])
    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), n_layers)
    state = load_file(str(model_dir / "model.safetensors"))
    for key, value in state.items():
        stem, _, leaf = key.rpartition(".")
        t = value.float().numpy()
        gguf_name = names.get_name(stem)
        if gguf_name is None:
            raise KeyError(f"no GGUF tensor for {key}")
        if fam.gguf_qk_interleaved and stem.endswith(("q_proj", "k_proj")):
            n = heads if stem.endswith("q_proj") else kv_heads
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        if fam.gguf_norm_plus_one and stem.endswith("norm"):
            t = t + 1
        if q4k and gguf_name.startswith("blk.") and t.ndim == 2 and t.shape[1] % 256 == 0:
            from gguf import GGMLQuantizationType

            from .model import kquant

            blocks = kquant.to_gguf(kquant.quantize(np.ascontiguousarray(t, np.float32), kquant.Q4K))
            w.add_tensor(f"{gguf_name}.{leaf}", blocks, raw_dtype=GGMLQuantizationType.Q4_K)
            continue
        if kind is not None and gguf_name.startswith("blk.") and t.ndim == 2:
            from gguf import GGML_QUANT_SIZES

            from .model import kquant

            qtype = kquant.GGML_TYPES[kind]
            if t.shape[1] % GGML_QUANT_SIZES[qtype][0] == 0:
                raw = kquant.quantize_raw(np.ascontiguousarray(t, np.float32), kind).data.reshape(t.shape[0], -1)
                w.add_tensor(f"{gguf_name}.{leaf}", raw, raw_dtype=qtype)
                continue
        w.add_tensor(f"{gguf_name}.{leaf}", np.ascontiguousarray(t))
    if rope.get("rope_type") == "llama3":
        scaling = [
            rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        ]
        factors = llama3_factors(head_dim, float(rope["rope_theta"]), *scaling)
        w.add_tensor("rope_freqs.weight", np.array(factors, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
