"""Medusa heads in the checkpoint layout vLLM's Medusa loader reads (`specdec export medusa`).

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

from .heads import MedusaConfig, MedusaHeads


def engine_config(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, Any]:
    c = heads.cfg
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
            "vocab_size": c.target_vocab_size, "num_heads": c.num_heads, "num_hidden_layers": 1, "max_paths": 64,
            "topk": 10, "truncated_vocab_size": c.draft_vocab_size, "medusa_fc_bias": c.medusa_fc_bias,
            "original_lm_head": True, "torch_dtype": str(dtype).removeprefix("torch."), "specdec_target": c.target}  # fmt: skip


def export(heads: MedusaHeads, out: str | Path, fmt: str = "vllm", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `heads` (attached to their target: the LM head rows come from it) for vLLM."""
    from safetensors.torch import save_file

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
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(engine_config(heads, dtype), indent=2) + "\n")
    return path


def load_exported(directory: str | Path) -> MedusaHeads:
    """An exported checkpoint read back as our heads (its LM head rows included): the test that
    the layout holds everything the heads compute."""
    from safetensors.torch import load_file

    d = Path(directory)
    cfg = json.loads((d / "config.json").read_text())
    t = load_file(str(d / "model.safetensors"))
    heads = MedusaHeads(MedusaConfig(kind="medusa", target=cfg.get("specdec_target", str(d)),
                                     target_vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                                     num_heads=cfg["num_heads"], draft_vocab_size=cfg["truncated_vocab_size"],
                                     medusa_fc_bias=cfg["medusa_fc_bias"]))  # fmt: skip
    state = {k: v.float() for k, v in t.items() if k.startswith("blocks.")}
    heads.load_state_dict(state, strict=False)
    heads.set_vocab(t["token_map"].long())
    order = t["token_map"].long().argsort()  # set_vocab sorts draft ids by target id
    heads.lm_weight = t["lm_head.weight"].float()[order].contiguous()
    return heads
