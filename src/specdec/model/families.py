"""Every decoder family specdec reads, one entry each.

An entry says what the rest of the model layer needs to know about a family, and nothing else
does: how its Hugging Face config maps onto `ModelArgs` (`config`), which GGUF architecture
llama.cpp writes it as and how that file's tensors differ from the checkpoint's (the GGUF
reader, the q4k packer and the file puncher read it), which checkpoint weights are several of
our linear layers stacked (Phi-3's qkv and gate/up), and a tiny random configuration of the
family (`specdec.testing`, checked against transformers). The native layer (`fused`) decides
from the `ModelArgs` switches alone whether it covers a block.

Adding a family is adding an entry here (and to the native layer only if its block is new).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    gguf_arch: str  # the GGUF architecture llama.cpp writes this family as
    # config.json -> the ModelArgs fields beyond the common ones (see config.ModelArgs.from_hf)
    switches: Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], dict[str, Any]]
    # transformers' config class name and the arguments of a tiny random model (see `tiny_config`)
    hf_config: str
    tiny: Callable[[dict[str, Any]], dict[str, Any]]
    # llama.cpp interleaves this family's q/k rows for its rotary kernel (transformers undoes it)
    gguf_qk_interleaved: bool = False
    gguf_norm_plus_one: bool = False  # the GGUF stores (1 + w) for norms the checkpoint stores as w
    # a checkpoint weight that is several of our linear layers stacked by rows, in order
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the GGUF tensor kind llama.cpp stores each stacked weight as (still stacked)
    gguf_stacked: dict[str, str] = field(default_factory=dict)


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rotary parameters, in either spelling (transformers 5's rope_parameters, or
    rope_theta with rope_scaling as older config files write them)."""
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    if scaling:
        rope.update(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            rope["rope_type"] = scaling["type"]
    return rope


def _theta(rope: dict[str, Any], cfg: dict[str, Any], default: float) -> float:
    return float(rope.get("rope_theta", cfg.get("rope_theta", default)))


def _rope_default(rope: dict[str, Any]) -> None:
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise UnsupportedModelError(f"rope_type {kind!r} is not supported for this family (only 'default')")


def _rope_llama(rope: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Default rotary, or Llama 3's frequency-dependent scaling (3.1, 3.2, 3.3)."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {}
    if kind == "llama3":
        return {
            "rope_llama3": (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                float(rope.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 8192)),
            )
        }
    raise UnsupportedModelError(f"rope_type {kind!r} is not supported yet (supported: 'default', 'llama3')")


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, context: float) -> list[float]:
    """The per-frequency divisors Llama 3's rotary scaling applies, as llama.cpp's converter
    writes them into a GGUF (`rope_freqs.weight`)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def llama3_from_factors(
    factors: list[float], head_dim: int, theta: float, context: float | None
) -> dict[str, float] | None:
    """Llama 3's scaling parameters that give a GGUF's `rope_freqs` (transformers reads the
    parameters, llama.cpp the divisors): the released models' (low 1, high 4, the file's original
    context or 8192), else solved from the smoothed band with low 1; None where nothing found
    reproduces the divisors."""
    factor = max(factors)
    if factor <= 1.0:
        return None
    candidates = [(1.0, 4.0, float(context or 8192))]
    band = [(2 * math.pi * theta ** (2 * j / head_dim), f) for j, f in enumerate(factors) if 1.0 < f < factor]
    if len(band) >= 2:
        # in the band, s = (C / wavelen - low) / (high - low) is linear in 1 / wavelen
        (w1, f1), (w2, f2) = band[0], band[-1]
        s1, s2 = ((1 / f - 1 / factor) / (1 - 1 / factor) for f in (f1, f2))
        slope = (s1 - s2) / (1 / w1 - 1 / w2)
        intercept = s1 - slope / w1
        if intercept < 0:
            width = -1.0 / intercept  # high - low, with low = 1
            candidates.append((1.0, round(1.0 + width, 4), round(slope * width)))  # (the file holds float32)
    for low, high, ctx in candidates:
        want = llama3_factors(head_dim, theta, factor, low, high, ctx)
        if all(abs(a - b) <= 1e-5 * b for a, b in zip(factors, want, strict=True)):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(ctx),
            }
    return None


def _window(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Sliding-window attention on every layer (Mistral, Phi-3), where the config sets one."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    return {"sliding_window": int(window), "layer_sliding": (True,) * n_layers}


def _no_partial_rotary(cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported yet (only 1.0)")


def _llama(cfg: dict[str, Any], rope: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"rope_theta": _theta(rope, cfg, 10_000.0), "qkv_bias": bias, "o_bias": bias, **_rope_llama(rope, cfg)}


def _mistral(cfg: dict[str, Any], rope: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    _rope_default(rope)
    return {"rope_theta": _theta(rope, cfg, 10_000.0), **_window(cfg, common["n_layers"])}


def _qwen2(cfg: dict[str, Any], rope: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    _rope_default(rope)
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("Qwen2 with use_sliding_window=true is not supported")
    return {"rope_theta": _theta(rope, cfg, 10_000.0), "qkv_bias": True, "o_bias": False}


def _qwen3(cfg: dict[str, Any], rope: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    _rope_default(rope)
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("Qwen3 with use_sliding_window=true is not supported")
    bias = bool(cfg.get("attention_bias", False))
    return {"rope_theta": _theta(rope, cfg, 10_000.0), "qkv_bias": bias, "o_bias": bias, "qk_norm": True}


def _phi3(cfg: dict[str, Any], rope: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    _rope_default(rope)  # (the 128k variants' longrope is not read yet)
    _no_partial_rotary(cfg, rope)
    return {"rope_theta": _theta(rope, cfg, 10_000.0), **_window(cfg, common["n_layers"])}


def _gemma3(cfg: dict[str, Any], rope: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    full = rope.get("full_attention", {}) if "full_attention" in rope else rope
    local = rope.get("sliding_attention", {})
    _rope_default(full)
    _rope_default(local)
    n_layers = common["n_layers"]
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) else "full_attention"
        for i in range(n_layers)
    ]
    if cfg.get("attn_logit_softcapping"):
        raise UnsupportedModelError("attention logit soft-capping is not supported yet")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with bidirectional attention is not a decoder")
    return {
        "rope_theta": float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
        "rope_theta_local": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
        "qkv_bias": bool(cfg.get("attention_bias", False)),
        "o_bias": bool(cfg.get("attention_bias", False)),
        "activation": "gelu_tanh",
        "norm_offset": True,
        "qk_norm": True,
        "sandwich_norm": True,
        "embed_scale": common["dim"] ** 0.5,
        "attn_scale": float(cfg.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        "sliding_window": cfg.get("sliding_window"),
        "layer_sliding": tuple(t == "sliding_attention" for t in layer_types),
        "final_logit_softcap": cfg.get("final_logit_softcapping"),
    }


def _tiny_llama(c: dict[str, Any]) -> dict[str, Any]:
    return {"tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _tiny_llama3(c: dict[str, Any]) -> dict[str, Any]:
    # a short original context so the tiny model's frequencies fall in all three bands
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, **scaling}}


def _tiny_gemma3(c: dict[str, Any]) -> dict[str, Any]:
    layers = c["num_hidden_layers"]
    # layer 0 sliding, layer 1 full: both kinds of attention are exercised
    return {
        "head_dim": c["hidden_size"] // c["num_attention_heads"],
        "sliding_window": c["sliding_window"],
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
        "query_pre_attn_scalar": 16,
        "initializer_range": 0.05,  # Gemma scales embeddings by sqrt(dim)
    }


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "llama", _llama, "LlamaConfig", _tiny_llama, gguf_qk_interleaved=True),
        # llama.cpp writes Mistral as llama (transformers tells them apart by the file's name)
        Family(
            "mistral",
            "llama",
            _mistral,
            "MistralConfig",
            lambda c: {
                "sliding_window": c["sliding_window"],
                "head_dim": 2 * c["hidden_size"] // c["num_attention_heads"],
            },
            gguf_qk_interleaved=True,
        ),
        Family("qwen2", "qwen2", _qwen2, "Qwen2Config", lambda c: {"tie_word_embeddings": True}),
        Family("qwen3", "qwen3", _qwen3, "Qwen3Config", lambda c: {"tie_word_embeddings": True, "head_dim": 32}),
        Family(
            "phi3",
            "phi3",
            _phi3,
            "Phi3Config",
            lambda c: {"sliding_window": c["sliding_window"], "tie_word_embeddings": False},
            stacked={
                "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            },
            gguf_stacked={"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
        ),
        Family("gemma3_text", "gemma3", _gemma3, "Gemma3TextConfig", _tiny_gemma3, gguf_norm_plus_one=True),
    )
}
# tiny test models named apart from their family: (family, its tiny arguments; None: the family's)
TINY_VARIANTS = {"gemma3": ("gemma3_text", None), "llama3": ("llama", _tiny_llama3)}

GGUF_ARCHITECTURES = tuple(sorted({f.gguf_arch for f in FAMILIES.values()}))


def family(model_type: str) -> Family:
    f = FAMILIES.get(model_type)
    if f is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    return f


def stacked_rows(fam: Family, part: str, args: Any) -> tuple[int, int]:  # noqa: ANN401 - ModelArgs
    """(first row, row count) of one of our linear layers (by suffix, e.g. "self_attn.k_proj")
    inside the checkpoint's stacked weight it belongs to."""
    sizes = {
        "self_attn.q_proj": args.n_heads * args.head_dim,
        "self_attn.k_proj": args.n_kv_heads * args.head_dim,
        "self_attn.v_proj": args.n_kv_heads * args.head_dim,
        "mlp.gate_proj": args.intermediate_size,
        "mlp.up_proj": args.intermediate_size,
    }
    for parts in fam.stacked.values():
        if part in parts:
            i = parts.index(part)
            return sum(sizes[p] for p in parts[:i]), sizes[part]
    raise KeyError(part)


def tiny_config(arch: str, common: dict[str, Any]):  # noqa: ANN201 - a transformers PretrainedConfig
    """transformers' config of a tiny random model of a family (`arch`: a model_type, or a name in
    TINY_VARIANTS); `common` holds the sizes every family shares."""
    import transformers

    model_type, tiny = TINY_VARIANTS.get(arch, (arch, None))
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    extra = (tiny or fam.tiny)(common)
    kwargs = {k: v for k, v in common.items() if k != "sliding_window"} | extra
    return getattr(transformers, fam.hf_config)(**kwargs)


def unstack(fam: Family, state: dict[str, Any], args: Any) -> dict[str, Any]:  # noqa: ANN401 - tensors, ModelArgs
    """A checkpoint's state dict with its stacked weights (Phi-3's qkv_proj, gate_up_proj) cut
    into our separate linear layers' rows (views, no copies)."""
    if not fam.stacked:
        return state
    out = {}
    for key, value in state.items():
        stem, _, leaf = key.rpartition(".")
        prefix, _, module = stem.partition(".layers.")
        layer, _, suffix = module.partition(".")
        parts = fam.stacked.get(suffix)
        if parts is None:
            out[key] = value
            continue
        for part in parts:
            first, rows = stacked_rows(fam, part, args)
            out[f"{prefix}.layers.{layer}.{part}.{leaf}"] = value[first : first + rows]
    return out


# our linear layers (by module suffix) -> the GGUF tensor kind llama.cpp stores them as
GGUF_LINEARS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass(frozen=True)
class GGUFLinear:
    """Where one of our linear layers lies in a GGUF file."""

    tensor: str  # the GGUF tensor's name
    first_row: int | None  # a stacked tensor: the layer's first row in it; None: the whole tensor
    rows: int | None = None  # ...and its row count there
    interleaved_heads: int = 0  # llama.cpp interleaved its rows for rotary, in this many heads (0: not)


def gguf_linear(module: str, args: Any) -> GGUFLinear | None:  # noqa: ANN401 - ModelArgs
    """The GGUF tensor behind one of our linear layers (by module name), as llama.cpp writes this
    family; None for a name that is not a decoder's linear layer."""
    fam = family(args.model_type)
    if module == "lm_head":
        return GGUFLinear("token_embd.weight" if args.tie_embeddings else "output.weight", None)
    parts = module.split(".")  # model.layers.{i}.{self_attn|mlp}.{proj}
    if len(parts) != 5 or parts[:2] != ["model", "layers"]:
        return None
    suffix = ".".join(parts[3:])
    stack = next((s for s, stacked in fam.stacked.items() if suffix in stacked), None)
    if stack is not None:
        return GGUFLinear(f"blk.{parts[2]}.{fam.gguf_stacked[stack]}.weight", *stacked_rows(fam, suffix, args))
    kind = GGUF_LINEARS.get(suffix)
    if kind is None:
        return None
    heads = 0
    if fam.gguf_qk_interleaved and suffix in ("self_attn.q_proj", "self_attn.k_proj"):
        heads = args.n_heads if suffix == "self_attn.q_proj" else args.n_kv_heads
    return GGUFLinear(f"blk.{parts[2]}.{kind}.weight", None, interleaved_heads=heads)


def llama_rows(n: int, heads: int) -> np.ndarray:
    """The row order transformers gives llama's q/k weights when it reads a GGUF (it undoes
    llama.cpp's rotary interleaving): HF row (h, t, i) is GGUF row (h, i, t)."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(n)
