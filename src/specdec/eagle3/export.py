"""`specdec export eagle3`: a head as the EAGLE-3 checkpoint vLLM and SGLang load.

Both engines read one layout (vLLM `models/llama_eagle3.py`, SGLang `models/llama_eagle3.py`,
the format the `speculators` package documents): a Llama-architecture `config.json` with
`architectures: ["LlamaForCausalLMEagle3"]`, one hidden layer, `draft_vocab_size`,
`target_hidden_size`, and a safetensors file with

    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    midlayer.self_attn.{q,k,v,o}_proj.weight   (q/k/v read 2 x hidden inputs)
    midlayer.mlp.{gate,up,down}_proj.weight
    fc.weight [hidden, 3 x target hidden]   norm.weight   lm_head.weight [draft vocab, hidden]
    d2t [draft vocab] (target id = draft id + d2t)   t2d [target vocab] bool

No `embed_tokens`: both engines then share the target's embedding, as our head does. A tied
head's LM head is written out as the target's rows of the draft vocabulary. The layers the
engines capture default to (2, n/2, n-3) of the target's layer *inputs*, which are the outputs
of our (1, n/2-1, n-4); the config records ours as `eagle_aux_hidden_state_layer_ids` in the
engines' indexing too. `Eagle3Head.load` reads an exported directory back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .head import Eagle3Head

ARCHITECTURE = "LlamaForCausalLMEagle3"
FORMATS = ("vllm", "sglang")
WEIGHT_NAMES = (
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
)  # fmt: skip


def engine_config(head: Eagle3Head, dtype: torch.dtype) -> dict[str, Any]:
    c = head.cfg
    layer_ids = [i + 1 for i in c.feature_layers]  # the engines capture a layer's input
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "target_hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.target_vocab_size, "draft_vocab_size": c.draft_vocab_size, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layer_ids},
        "specdec": {"target": c.target, "feature_layers": list(c.feature_layers)},
    }  # fmt: skip


def export(head: Eagle3Head, out: str | Path, fmt: str = "vllm", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `head` (its target attached, for a tied LM head) as an engine checkpoint."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    c = head.cfg
    if c.tie_lm_head and head.lm_head_weight.abs().sum() == 0:
        raise ValueError("attach the target first: the exported LM head is the target's rows of the draft vocabulary")
    state = {k: v for k, v in head.state_dict().items() if k in WEIGHT_NAMES}
    state["lm_head.weight"] = head.lm_head_weight if c.tie_lm_head else head.lm_head.weight
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    missing = set(WEIGHT_NAMES) - tensors.keys()
    if missing:
        raise ValueError(f"the head lacks {sorted(missing)}")
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(engine_config(head, dtype), indent=2) + "\n")
    return d


def load_exported(directory: str | Path) -> Eagle3Head:
    """A head from an engine checkpoint (ours or another trainer's in this layout)."""
    from safetensors.torch import load_file

    from .head import HeadConfig

    d = Path(directory)
    cfg = json.loads((d / "config.json").read_text())
    if ARCHITECTURE not in cfg.get("architectures", []) and "Eagle3LlamaForCausalLM" not in cfg.get("architectures", []):
        raise ValueError(f"{d}/config.json is not an EAGLE-3 head (architectures {cfg.get('architectures')})")
    layer_ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    feature_layers = tuple((cfg.get("specdec") or {}).get("feature_layers") or [i - 1 for i in layer_ids])
    hc = HeadConfig(
        target=(cfg.get("specdec") or {}).get("target", str(d)), target_vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"], draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
        feature_layers=feature_layers, rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg.get("rope_theta", 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192), tie_lm_head=False,
    )  # fmt: skip
    head = Eagle3Head(hc)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(str(d / "model.safetensors")).items()}
    state.pop("embed_tokens.weight", None)
    if "t2d" not in state:
        t2d = torch.zeros(hc.target_vocab_size, dtype=torch.bool)
        t2d[state["d2t"] + torch.arange(state["d2t"].numel())] = True
        state["t2d"] = t2d
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or any(m != "embed_weight" for m in missing):
        raise ValueError(f"{d}: weights do not match an EAGLE-3 head (missing {missing}, unexpected {unexpected})")
    return head
