"""`specdec export`: trained heads in the checkpoint layouts other engines load.

**EAGLE-3** (`specdec export eagle3`): the checkpoint vLLM and SGLang load.

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

**Medusa** (`specdec export medusa`): Medusa heads in the checkpoint layout vLLM's Medusa loader
reads.

vLLM (`vllm/model_executor/models/medusa.py`, config `vllm/transformers_utils/configs/medusa.py`)
builds `blocks.{d}.layers.{l}` (Linear hidden -> hidden, bias when `medusa_fc_bias`; x + SiLU(
layer(x)) per layer) on the target's final hidden states, one LM head shared by every head when
`original_lm_head` is set, and maps a truncated draft vocabulary back to target ids through
`token_map` (draft id -> target id) when `truncated_vocab_size` < `vocab_size` — the same
computation as our heads, whose LM head is the target's own rows of the draft vocabulary (so the
export writes those rows as `lm_head.weight`). Its config loader renames every key holding "num"
and "heads"/"layers", so the config carries no other such key. Hydra heads have no vLLM loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..networks.eagle3 import ARCHITECTURE, Eagle3Head
from ..networks.medusa import MedusaConfig, MedusaHeads

FORMATS = ("vllm", "sglang")
EAGLE3_WEIGHT_NAMES = (
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


def _write(out: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """An engine checkpoint: `model.safetensors` and `config.json` in directory `out`."""
    from safetensors.torch import save_file

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return d


def eagle3_config(head: Eagle3Head, dtype: torch.dtype) -> dict[str, Any]:
    c = head.cfg
    layer_ids = [i + 1 for i in c.feature_layers]  # the engines capture a layer's input
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.target_vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layer_ids},
        "specdec": {"target": c.target, "feature_layers": list(c.feature_layers)},
    }


def export_eagle3(head: Eagle3Head, out: str | Path, fmt: str = "vllm", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `head` (its target attached, for a tied LM head) as an engine checkpoint."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    c = head.cfg
    if c.tie_lm_head and head.lm_head_weight.abs().sum() == 0:
        raise ValueError("attach the target first: the exported LM head is the target's rows of the draft vocabulary")
    state = {k: v for k, v in head.state_dict().items() if k in EAGLE3_WEIGHT_NAMES}
    state["lm_head.weight"] = head.lm_head_weight if c.tie_lm_head else head.lm_head.weight
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    missing = set(EAGLE3_WEIGHT_NAMES) - tensors.keys()
    if missing:
        raise ValueError(f"the head lacks {sorted(missing)}")
    return _write(out, tensors, eagle3_config(head, dtype))


# -- Medusa --------------------------------------------------------------------------------
def medusa_config(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, Any]:
    c = heads.cfg
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": c.hidden_size,
        "vocab_size": c.target_vocab_size,
        "num_heads": c.num_heads,
        "num_hidden_layers": 1,
        "max_paths": 64,
        "topk": 10,
        "truncated_vocab_size": c.draft_vocab_size,
        "medusa_fc_bias": c.medusa_fc_bias,
        "original_lm_head": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "specdec_target": c.target,
    }


def export_medusa(heads: MedusaHeads, out: str | Path, fmt: str = "vllm", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `heads` (attached to their target: the LM head rows come from it) for vLLM."""
    if fmt != "vllm":
        raise ValueError(f"unknown export format {fmt!r}; Medusa heads export to vllm")
    if heads.cfg.kind != "medusa":
        raise ValueError("vLLM has no loader for Hydra heads; only Medusa heads export (specdec export medusa)")
    if heads.lm_weight.numel() == 0:
        raise ValueError("attach the heads to their target first: the export writes its LM head rows")
    tensors: dict[str, torch.Tensor] = {}
    for d, block in enumerate(heads.blocks):
        tensors[f"blocks.{d}.layers.0.weight"] = block.layers[0].weight.detach().to(dtype).contiguous()
        if block.layers[0].bias is not None:
            tensors[f"blocks.{d}.layers.0.bias"] = block.layers[0].bias.detach().to(dtype).contiguous()
    tensors["lm_head.weight"] = heads.lm_weight.to(dtype).contiguous()  # [N, H]: the draft vocabulary's rows
    tensors["token_map"] = heads.draft_ids.clone().contiguous()  # [N]: draft id -> target id
    return _write(out, tensors, medusa_config(heads, dtype))


def load_medusa(directory: str | Path) -> MedusaHeads:
    """An exported checkpoint read back as our heads (its LM head rows included): the test that
    the layout holds everything the heads compute."""
    from safetensors.torch import load_file

    d = Path(directory)
    cfg = json.loads((d / "config.json").read_text())
    t = load_file(str(d / "model.safetensors"))
    heads = MedusaHeads(
        MedusaConfig(
            kind="medusa",
            target=cfg.get("specdec_target", str(d)),
            target_vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_heads=cfg["num_heads"],
            draft_vocab_size=cfg["truncated_vocab_size"],
            medusa_fc_bias=cfg["medusa_fc_bias"],
        )
    )
    state = {k: v.float() for k, v in t.items() if k.startswith("blocks.")}
    heads.load_state_dict(state, strict=False)
    heads.set_vocab(t["token_map"].long())
    order = t["token_map"].long().argsort()  # set_vocab sorts draft ids by target id
    heads.lm_weight = t["lm_head.weight"].float()[order].contiguous()
    return heads
