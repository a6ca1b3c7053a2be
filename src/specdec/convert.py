"""GGUF -> Hugging Face directory (float32 safetensors), done once per file.

transformers reads the GGUF metadata and de-quantizes the tensors (undoing llama.cpp's
Q/K permutation and Gemma's norm offset); we store the result so that later loads are a
memory map of safetensors instead of a 30-90 s de-quantization.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch


def convert_gguf(gguf_file: Path, out_dir: Path, *, expected_architecture: str | None = None) -> Path:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .store import UnsupportedArchitectureError, gguf_architecture

    arch = gguf_architecture(gguf_file)
    if expected_architecture is not None and arch != expected_architecture:
        raise UnsupportedArchitectureError(
            f"{gguf_file.name}: expected GGUF architecture {expected_architecture!r}, found {arch!r}"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        folder, name = str(gguf_file.parent), gguf_file.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the stored weights are plain float32
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "source_gguf": gguf_file.name})
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "specdec.json").write_text(json.dumps({"source": gguf_file.name, "source_path": str(gguf_file.resolve()), "architecture": arch}))
        del model, state
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        hf_logging.set_verbosity(verbosity)
    return out_dir
