"""Tiny random models with a byte tokenizer, for tests and examples that must run in seconds.

`make_tiny_model` writes an ordinary Hugging Face directory (config.json, safetensors,
tokenizer), so tiny models go through exactly the loader real models use, and transformers
can load the same directory as a reference oracle.
"""

from __future__ import annotations

from pathlib import Path

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
