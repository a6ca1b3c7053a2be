"""Files out, for the engines a user grows into: a model as llama.cpp, transformers and vLLM load it.

The cache's GGUF files are not for other tools: once packed, a registered model's GGUF keeps
the blocks the q4k file holds as holes (`model.sparse`), and a tool handed it reads zeros
without an error. `specdec models export` gives what they load:
- `--gguf FILE`: the whole file, its punched blocks written back from the packed tiles, and
  checked against its sha256 (the pinned one of a registered model, the one it was installed
  under for a file of one's own) before it is kept;
- `--hf DIR`: a Hugging Face directory in bfloat16 (config with its `architectures`, tokenizer
  and chat template, `model.safetensors`), de-quantized from the file by transformers' own GGUF
  reader, with the config specdec reads from the file (what transformers' reading leaves out:
  the head size, a sliding window, Llama 3's rotary scaling).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from . import registry, store
from .model import sparse
from .model.convert import converted_meta, gguf_source
from .paths import file_sha256, sha256_file


def _source(name: str) -> tuple[Path, Path, str]:
    """(converted directory, GGUF, expected sha256) of a registered name or a .gguf path."""
    directory = store.resolve(name)
    gguf = gguf_source(directory)
    if gguf is None:
        raise FileNotFoundError(f"{name}: its GGUF file is gone; install it again (`specdec models install {name}`)")
    if name in registry.MODELS:
        return directory, gguf, registry.MODELS[name].sha256
    return directory, gguf, converted_meta(directory).get("sha256") or file_sha256(gguf)


def export_gguf(name: str, out: Path, log: Callable[[str], None] = print) -> Path:
    """The model's whole GGUF at `out`, checked against its sha256."""
    _, gguf, sha = _source(name)
    out = Path(out)
    if out.resolve() == gguf.resolve():
        raise ValueError(f"{out} is the cache's own file; export to another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with sparse.full(gguf):  # the punched blocks back in place while it is copied
            shutil.copyfile(gguf, tmp)
        got = sha256_file(tmp)
        if got != sha:
            raise RuntimeError(f"the exported file's sha256 is {got}, not {sha}; nothing was written to {out}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"{out}: {out.stat().st_size / 1e9:.2f} GB, sha256 {sha[:16]}... as installed")
    return out


def export_hf(name: str, out: Path, log: Callable[[str], None] = print) -> Path:
    """The model as a Hugging Face directory in bfloat16 at `out` (a new or empty directory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .model.convert import _parsed_once, _quiet_transformers

    directory, gguf, _ = _source(name)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; export into a new directory")
    log(f"{name}: de-quantizing {gguf.name} to bfloat16 with transformers (about 2 bytes per parameter)")
    with sparse.full(gguf), _quiet_transformers(), _parsed_once(gguf):
        config = AutoConfig.from_pretrained(directory)  # (specdec's reading: what transformers' own leaves out)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, config=config, dtype=torch.bfloat16
        )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # What transformers keeps of the GGUF's quantization is only how it read the file: the
    # weights are plain bfloat16 now, and saved as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log(f"{out}: {type(model).__name__}, bfloat16, tokenizer and chat template")
    return out
