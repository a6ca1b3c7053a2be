"""GGUF -> Hugging Face style directory, done once per file.

What every mode needs is written at install: `config.json`, the tokenizer files and
`base.safetensors` (norms and biases in float32, a few MB). The default q4k mode runs the
linear layers from the GGUF's own blocks and looks embedding rows up in the GGUF
(`specdec.model.gguf_file`), so it needs nothing more. The float modes (fp32, bf16, fp16,
int8) and transformers need `model.safetensors`, every weight de-quantized to float32 (6 GB
for a 1.5B model, about a minute): `float_weights` writes it on first use, or
`specdec models install --float` up front.

transformers is the converter (it reads the GGUF metadata into a config and a tokenizer and
de-quantizes the tensors, undoing llama.cpp's q/k permutation and Gemma's norm offset);
`specdec.model.gguf_file` reproduces its tensor processing bit for bit for the pieces the
q4k mode reads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

BASE_WEIGHTS = "base.safetensors"  # norms and biases: what no mode quantizes
FLOAT_WEIGHTS = "model.safetensors"  # every weight in float32 (float modes, transformers)


@contextmanager
def _parsed_once(gguf_file: Path) -> Iterator[None]:
    """transformers parses a GGUF once for its config, once for its tokenizer and once for its
    tensors, each with gguf's reader (slow on a Qwen vocabulary). Hand it our one
    faster parse of this file instead (it imports `gguf.GGUFReader` when called)."""
    import gguf

    from .gguf_reader import open_gguf

    real = gguf.GGUFReader
    mine = Path(gguf_file).resolve()

    def reader(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
        return open_gguf(mine) if Path(path).resolve() == mine and mode == "r" else real(path, mode)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def convert_gguf(
    gguf_file: Path,
    out_dir: Path,
    *,
    expected_architecture: str | None = None,
    floats: bool = False,
    pin: tuple[str, str] | None = None,
) -> Path:
    """Write `out_dir` for `gguf_file`: config, tokenizer, norms and biases (and, with
    `floats`, every weight in float32). Written to a temporary directory beside it and renamed,
    so `out_dir` is whole or absent."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from .config import ModelArgs
    from .gguf_file import UnsupportedArchitectureError, config_fixes, gguf_architecture, small_state
    from .gguf_reader import open_gguf

    arch = gguf_architecture(gguf_file)
    if expected_architecture is not None and arch != expected_architecture:
        raise UnsupportedArchitectureError(
            f"{gguf_file.name}: expected GGUF architecture {expected_architecture!r}, found {arch!r}"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", suffix=".tmp", dir=out_dir.parent))
    try:
        folder, name = str(gguf_file.parent), gguf_file.name
        with _quiet_transformers(), _parsed_once(gguf_file):
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # what we store is plain float32
        try:
            fixes = config_fixes(open_gguf(gguf_file), config.model_type, config.to_dict())
        except UnsupportedArchitectureError as exc:
            raise UnsupportedArchitectureError(f"{gguf_file.name}: {exc}") from None
        for key, value in fixes.items():
            setattr(config, key, value)
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        args = ModelArgs.from_dir(tmp)
        save_file(
            small_state(open_gguf(gguf_file), base_keys(args), args),
            str(tmp / BASE_WEIGHTS),
            metadata={"format": "pt", "source_gguf": gguf_file.name},
        )
        meta = {"source": gguf_file.name, "source_path": str(gguf_file.resolve()), "architecture": arch}
        if pin is not None:  # a registered model: its name and pinned sha256 (see `sparse`)
            meta["name"], meta["sha256"] = pin
        (tmp / "specdec.json").write_text(json.dumps(meta))
        if floats:
            _write_float_weights(gguf_file, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def base_keys(args) -> list[str]:  # noqa: ANN001 - ModelArgs
    """State-dict keys of the tensors kept in float in every mode: all but the linear layers'
    weights and the embedding table."""
    from .linear import Linear
    from .transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Linear)}
    return [k for k in model.state_dict() if k not in linear and k != "model.embed_tokens.weight"]


def converted_meta(path: Path) -> dict:
    """What `convert_gguf` noted in a converted directory (`specdec.json`: the source GGUF, its
    architecture, and for a registered model its name and pinned sha256); {} where none."""
    meta = Path(path) / "specdec.json"
    return json.loads(meta.read_text()) if meta.exists() else {}


def gguf_source(path: Path) -> Path | None:
    """The GGUF file a converted directory came from, if it is still there."""
    from ..paths import cache_root

    info = converted_meta(path)
    if not info:
        return None
    for candidate in (info.get("source_path"), cache_root() / "gguf" / info.get("source", "")):
        if candidate and Path(candidate).is_file() and Path(candidate).suffix == ".gguf":
            return Path(candidate)
    return None


def has_float_weights(model_dir: Path) -> bool:
    """Whether a directory has float weights: any directory but one installed from a GGUF
    (`base.safetensors`) before its float weights were written."""
    d = Path(model_dir)
    return (d / FLOAT_WEIGHTS).exists() or not (d / BASE_WEIGHTS).exists()


def float_weights(model_dir: Path, log: Callable[[str], None] | None = None) -> Path:
    """`model_dir` with every weight in float32 (`model.safetensors`), de-quantized from its GGUF
    on first use (the fp32/bf16/fp16/int8 modes and transformers read it). Safe to call from
    several processes at once: one converts, the others wait and reuse its file."""
    from filelock import FileLock

    from ..paths import lock_path

    model_dir = Path(model_dir)
    if has_float_weights(model_dir):
        return model_dir
    gguf = gguf_source(model_dir)
    if gguf is None:
        raise FileNotFoundError(
            f"{model_dir} has no {FLOAT_WEIGHTS} and no GGUF file to make it from; install the "
            "model again (`specdec models install NAME --float`)"
        )
    with FileLock(lock_path(model_dir.name)):
        if not has_float_weights(model_dir):
            size = gguf.stat().st_size
            (log or _stderr)(
                f"{model_dir.name[:12]}: de-quantizing {gguf.name} to float32 weights for the float "
                f"modes (once; about {size * 6 // 2**30 + 1} GB, a minute or two)"
            )
            _write_float_weights(gguf, model_dir)
    return model_dir


def _write_float_weights(gguf_file: Path, model_dir: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import sparse

    folder, name = str(gguf_file.parent), gguf_file.name
    # transformers reads every tensor from the file: its punched blocks are written back first
    # (and checked against the pinned sha256), and punched again once read.
    with (
        sparse.full(gguf_file),
        _quiet_transformers(),
        _parsed_once(gguf_file),
    ):  # transformers shows its own progress bar
        # (the config the directory holds: transformers' own reading of the GGUF leaves some out)
        config = AutoConfig.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    tmp = model_dir / f"{FLOAT_WEIGHTS}.{os.getpid()}.tmp"
    try:
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            str(tmp),
            metadata={"format": "pt", "source_gguf": gguf_file.name},
        )
        tmp.replace(model_dir / FLOAT_WEIGHTS)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr)
