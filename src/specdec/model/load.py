"""Load a Hugging Face style directory into the native `Transformer`.

This is the only way models are loaded: registered names and GGUF files are first turned
into such a directory by `specdec.store.resolve`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelArgs
from .kernels import apply_mode, get_mode
from .transformer import Transformer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_devices() -> list[str]:
    """The devices this torch build can run on here."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append("mps")
    return out


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` checked against what this machine has: one clear error naming what is
    available instead of torch's assertion deep inside the first allocation."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {str(device)!r}; available here: {', '.join(available_devices())}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {str(device)!r}: {why}; available here: {', '.join(available_devices())}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: there are {torch.cuda.device_count()} CUDA devices; "
                             f"available here: {', '.join(available_devices())}")  # fmt: skip
    elif dev.type == "mps" and "mps" not in available_devices():
        raise ValueError(f"device 'mps' is not available here; available here: {', '.join(available_devices())}")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {str(device)!r} is not supported; available here: {', '.join(available_devices())}")
    return dev


def load_transformer(path: str | Path, *, dtype: str = "fp32", device: str | torch.device | None = None) -> Transformer:
    """`dtype` names a precision/kernel mode (see `specdec.model.kernels.MODES`), or "auto"
    for the fastest exact mode on the device. The default, fp32, is the reference precision."""
    from safetensors.torch import load_file

    path = Path(path)
    args = ModelArgs.from_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    # Some exports prefix the text model (multimodal Gemma 3); keep only what a decoder needs.
    state = {_strip_prefix(k): v for k, v in state.items()}
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Transformer(args)
    expected = {k for k in model.state_dict() if not (args.tie_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match a {args.model_type} decoder "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    dev = resolve_device(device)
    mode = get_mode(dtype, dev)
    state = {k: v.to(device=dev, dtype=mode.storage) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.eval()
    model.finalize()
    gguf = gguf_source(path)
    packed = packed_path(path, files, gguf) if mode.name == "q4k" else None
    apply_mode(model, mode, gguf=gguf, packed=packed, source=str(path.resolve()))
    if packed is not None:
        _prune_packed(keep=packed)
    model.mode = mode.name
    model.source_dir = path  # where it came from (drafters trained for it look it up)
    return model


def packed_path(path: Path, files: list[Path], gguf: Path | None) -> Path:
    """Where the q4k mode keeps this model's repacked weights: keyed by the weight files (and
    GGUF) it was made from and by the kernel's source, so any change repacks."""
    import hashlib

    from ..store import cache_root
    from . import kquant

    h = hashlib.sha256(f"{kquant.layout_version()}:{kquant.REQUANTIZE}".encode())
    for f in [*files, *([gguf] if gguf else [])]:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_root() / "packed" / f"{h.hexdigest()[:20]}.safetensors"


def _prune_packed(keep: Path) -> None:
    """Delete packed-weight files that can no longer be used: older packings of the same model
    (its weights or the kernel changed) and those of model directories that are gone."""
    from safetensors import safe_open

    from .kernels import PACKED_SOURCE_KEY

    with safe_open(str(keep), framework="pt") as f:
        mine = (f.metadata() or {}).get(PACKED_SOURCE_KEY, "")
    for other in keep.parent.glob("*.safetensors"):
        if other == keep:
            continue
        try:
            with safe_open(str(other), framework="pt") as f:
                source = (f.metadata() or {}).get(PACKED_SOURCE_KEY, "")
        except Exception:  # noqa: BLE001 - unreadable (e.g. half-written by a crashed run): stale
            source = ""
        if not source or source == mine or not Path(source).exists():
            other.unlink(missing_ok=True)


def q4k_cache_file(path: str | Path) -> Path:
    """The q4k mode's repacked-weight file for a model directory (may not exist yet)."""
    path = Path(path)
    return packed_path(path, sorted(path.glob("*.safetensors")), gguf_source(path))


def prepare_q4k(path: str | Path) -> bool:
    """Repack a model's weights for the q4k kernel now (the first q4k load does it otherwise,
    ~20 s for the 1.5B). Returns False where the kernel cannot be built here."""
    from . import native

    if not native.available():
        return False
    if not q4k_cache_file(path).exists():
        load_transformer(path, dtype="q4k", device="cpu")
    return True


def gguf_source(path: Path) -> Path | None:
    """The GGUF file a converted directory came from, if it is still there."""
    import json

    from ..store import cache_root

    meta = path / "specdec.json"
    if not meta.exists():
        return None
    info = json.loads(meta.read_text())
    for candidate in (info.get("source_path"), cache_root() / "gguf" / info.get("source", "")):
        if candidate and Path(candidate).is_file() and Path(candidate).suffix == ".gguf":
            return Path(candidate)
    return None


def _strip_prefix(key: str) -> str:
    for prefix in ("model.language_model.", "language_model.model."):
        if key.startswith(prefix):
            return "model." + key[len(prefix):]
    return key
