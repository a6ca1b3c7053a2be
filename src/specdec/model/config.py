"""One config dataclass for every supported decoder, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "gemma3_text")


class UnsupportedModelError(ValueError):
    pass


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

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelArgs:
        if "text_config" in cfg and cfg.get("model_type") == "gemma3":
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        mtype = cfg.get("model_type")
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {mtype!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("rope_scaling",):
            if cfg.get(key):
                raise UnsupportedModelError(f"{key}={cfg[key]!r} is not supported yet")
        rope = cfg.get("rope_parameters") or {}
        n_heads = cfg["num_attention_heads"]
        dim = cfg["hidden_size"]
        common: dict[str, Any] = dict(
            model_type=mtype,
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
        if mtype in ("llama", "qwen2"):
            _check_rope_default(rope)
            theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
            if mtype == "qwen2" and cfg.get("use_sliding_window"):
                raise UnsupportedModelError("Qwen2 with use_sliding_window=true is not supported")
            bias = bool(cfg.get("attention_bias", False))
            return cls(
                **common,
                rope_theta=float(theta),
                qkv_bias=True if mtype == "qwen2" else bias,
                o_bias=False if mtype == "qwen2" else bias,
            )
        # gemma3_text
        full = rope.get("full_attention", {}) if "full_attention" in rope else rope
        local = rope.get("sliding_attention", {})
        _check_rope_default(full)
        _check_rope_default(local)
        n_layers = common["n_layers"]
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) else "full_attention"
            for i in range(n_layers)
        ]
        if cfg.get("attn_logit_softcapping"):
            raise UnsupportedModelError("attention logit soft-capping is not supported yet")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("Gemma 3 with bidirectional attention is not a decoder")
        return cls(
            **common,
            rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
            rope_theta_local=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            activation="gelu_tanh",
            norm_offset=True,
            qk_norm=True,
            sandwich_norm=True,
            embed_scale=dim**0.5,
            attn_scale=float(cfg.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
            sliding_window=cfg.get("sliding_window"),
            layer_sliding=tuple(t == "sliding_attention" for t in layer_types),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelArgs:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


def _check_rope_default(rope: dict[str, Any]) -> None:
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise UnsupportedModelError(f"rope_type {kind!r} is not supported yet (only 'default')")
