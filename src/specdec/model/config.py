"""One config dataclass for every supported decoder, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .families import FAMILIES, UnsupportedModelError, family, rope_parameters

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArgs", "UnsupportedModelError"]


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_seq_len: int
    tie_embeddings: bool
    rope_theta: float  # global (full-attention) layers
    # Architecture switches (Llama defaults); Qwen2 and Gemma 3 flip some of them.
    qkv_bias: bool = False
    o_bias: bool = False
    activation: str = "silu"  # "silu" or "gelu_tanh"
    norm_offset: bool = False  # Gemma: RMSNorm multiplies by (1 + w)
    qk_norm: bool = False  # Gemma 3: RMSNorm on each query/key head
    sandwich_norm: bool = False  # Gemma 3: norms after attention and after the MLP too
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(dim)
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    sliding_window: int | None = None
    layer_sliding: tuple[bool, ...] = ()  # per layer: uses the sliding window
    rope_theta_local: float | None = None  # sliding layers (Gemma 3)
    final_logit_softcap: float | None = None
    # Llama 3's frequency-dependent rotary scaling: (factor, low_freq_factor, high_freq_factor,
    # original context length)
    rope_llama3: tuple[float, float, float, float] | None = None

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelArgs:
        if "text_config" in cfg and cfg.get("model_type") == "gemma3":
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        fam = family(cfg.get("model_type"))
        rope = rope_parameters(cfg)
        n_heads = cfg["num_attention_heads"]
        dim = cfg["hidden_size"]
        common: dict[str, Any] = dict(
            model_type=fam.model_type,
            vocab_size=cfg["vocab_size"],
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or dim // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
        return cls(**common, **fam.switches(cfg, rope, common))

    @classmethod
    def from_dir(cls, path: Path) -> ModelArgs:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))
