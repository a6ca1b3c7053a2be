"""Load a Hugging Face style directory into the native `Transformer`.

This is the only way models are loaded: registered names and GGUF files are first turned
into such a directory by `specdec.store.resolve`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelArgs
from .convert import BASE_WEIGHTS, converted_meta, float_weights, gguf_source, has_float_weights
from .families import family, unstack
from .kernels import DRAFT_BITS, apply_mode, get_mode
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
            raise ValueError(
                f"device {str(device)!r}: there are {torch.cuda.device_count()} CUDA devices; "
                f"available here: {', '.join(available_devices())}"
            )
    elif dev.type == "mps" and "mps" not in available_devices():
        raise ValueError(f"device 'mps' is not available here; available here: {', '.join(available_devices())}")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {str(device)!r} is not supported; available here: {', '.join(available_devices())}")
    return dev


def load_transformer(
    path: str | Path, *, dtype: str = "fp32", device: str | torch.device | None = None, bits: int | None = None
) -> Transformer:
    """`dtype` names a precision/kernel mode (see `specdec.model.kernels.MODES`), or "auto"
    for the fastest exact mode on the device. The default, fp32, is the reference precision.

    A directory installed from a GGUF loads the q4k mode from the GGUF itself (no float copy);
    the other modes read `model.safetensors`, which is de-quantized from the GGUF the first
    time one of them is asked for (`specdec.model.convert.float_weights`).

    `bits` (q4k mode only): a cheaper packing than the file's, for a model that drafts — 4: every
    linear layer in Q4_K blocks (`kernels.apply_mode`), kept in its own packed file."""
    from safetensors.torch import load_file

    path = Path(path)
    args = ModelArgs.from_dir(path)
    dev = resolve_device(device)
    mode = get_mode(dtype, dev)
    if bits is not None and bits not in DRAFT_BITS:
        raise ValueError(
            f"draft bits {bits} are not a packing specdec has; choose {', '.join(map(str, DRAFT_BITS))}, "
            "or leave them unset for the model file's own"
        )
    if bits is not None and mode.name != "q4k":
        raise ValueError(f"draft bits are a packing of the q4k mode; the {mode.name} mode has none (drop the bits)")
    gguf = gguf_source(path)
    from_gguf = gguf is not None and (path / BASE_WEIGHTS).exists()
    requantize = requantized(path)
    if mode.name == "q4k" and from_gguf:
        if dev.type != "cpu":
            raise ValueError(f"the q4k mode runs on the CPU only for now (asked for {dev}); use bf16 or fp16")
        return _load_q4k_from_gguf(path, args, mode, gguf, bits, requantize)
    if from_gguf and not has_float_weights(path):
        float_weights(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    # Some exports prefix the text model (multimodal Gemma 3); keep only what a decoder needs.
    state = unstack(family(args.model_type), {_strip_prefix(k): v for k, v in state.items()}, args)
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
    state = {k: v.to(device=dev, dtype=mode.storage) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.eval()
    model.finalize()
    packed = packed_path(path, files, gguf, bits, requantize) if mode.name == "q4k" else None
    apply_mode(model, mode, gguf=gguf, packed=packed, source=str(path.resolve()), bits=bits, requantize=requantize)
    if packed is not None:
        _prune_packed(keep=packed)
    model.mode, model.bits = mode.name, bits
    model.set_native_layers(mode.name == "q4k")
    model.source_dir = path  # where it came from (drafters trained for it look it up)
    return model


def _load_q4k_from_gguf(  # noqa: PLR0913
    path: Path,
    args: ModelArgs,
    mode,  # noqa: ANN001 - Mode
    gguf: Path,
    bits: int | None = None,
    requantize: bool = False,
) -> Transformer:
    """The q4k mode with no float copy of the weights: norms and biases from
    `base.safetensors`, linear layers from the GGUF's blocks (repacked once into the packed
    file), embedding rows de-quantized from the GGUF when looked up."""
    from safetensors.torch import load_file

    from .gguf_file import GGUFEmbedding

    with torch.device("meta"):
        model = Transformer(args)
    state = {k: v.to(dtype=mode.storage) for k, v in load_file(str(path / BASE_WEIGHTS)).items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.model.embed_tokens = GGUFEmbedding(gguf, "token_embd.weight", mode.storage)
    model.eval()
    model.finalize()
    packed = packed_path(path, [], gguf, bits, requantize)
    fresh = not packed.exists() and bits is None  # (only the GGUF's own blocks can stand in for the GGUF's)
    apply_mode(
        model,
        mode,
        gguf=gguf,
        packed=packed,
        source=str(path.resolve()),
        from_gguf=True,
        bits=bits,
        requantize=requantize,
    )
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(
            f"{path}: {BASE_WEIGHTS} and {gguf.name} leave {left[:3]} without weights; install the model again"
        )
    _prune_packed(keep=packed)
    if fresh:
        _sparsify(path, gguf, packed, args)
    model.mode, model.bits = mode.name, bits
    model.set_native_layers(True)
    model.source_dir = path
    return model


def _sparsify(path: Path, gguf: Path, packed: Path, args: ModelArgs) -> int:
    """Keep the blocks `packed` holds only there, not also in the cached GGUF (see `sparse`), for
    a registered model (its name and pinned sha256 in the directory's `specdec.json`)."""
    from . import sparse

    meta = converted_meta(path)
    pin = (meta["name"], meta["sha256"]) if "name" in meta and "sha256" in meta else None
    return sparse.sparsify(gguf, packed, pin=pin, args=args)


def requantized(path: Path) -> bool:
    """Whether a model directory was installed with `--requantize` (its GGUF's tensors of other
    types than Q4_K/Q6_K run re-quantized to Q6_K)."""
    return bool(converted_meta(path).get("requantize", False))


def packed_path(
    path: Path, files: list[Path], gguf: Path | None, bits: int | None = None, requantize: bool = False
) -> Path:
    """Where the q4k mode keeps this model's repacked weights: keyed by the GGUF it was made
    from (else by the weight files), by the kernel's layout, so any change repacks, and by the
    packing asked for (draft bits, re-quantization). (The q4k weights of a GGUF-backed directory
    are the GGUF's blocks whether or not its float weights exist, so adding them keeps the key.)"""
    import hashlib

    from ..paths import cache_root
    from . import kquant

    h = hashlib.sha256(
        f"{kquant.layout_version()}:{kquant.REQUANTIZE}".encode()
        + (f":bits{bits}".encode() if bits else b"")
        + (b":requantize" if requantize else b"")
    )
    for f in [gguf] if gguf else files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_root() / "packed" / f"{h.hexdigest()[:20]}.safetensors"


def packed_source(packed: Path) -> str:
    """The model directory a q4k packed-weight file was made from ("" when unreadable, e.g.
    half-written by a crashed run)."""
    return _packed_meta(packed)[0]


def _packed_meta(packed: Path) -> tuple[str, str]:
    """(model directory, bits) of a packed-weight file; ("", "") when unreadable."""
    from safetensors import safe_open

    from .kernels import PACKED_BITS_KEY, PACKED_SOURCE_KEY

    try:
        with safe_open(str(packed), framework="pt") as f:
            meta = f.metadata() or {}
            return meta.get(PACKED_SOURCE_KEY, ""), meta.get(PACKED_BITS_KEY, "")
    except Exception:  # noqa: BLE001 - unreadable: no source
        return "", ""


def _prune_packed(keep: Path) -> None:
    """Delete packed-weight files that can no longer be used: older packings of the same model
    and bits (its weights or the kernel changed) and those of model directories that are gone."""
    from .sparse import held_packings

    mine, my_bits = _packed_meta(keep)
    held = held_packings()  # the only copy of some GGUF's blocks: never pruned (`sparse.restore` first)
    for other in keep.parent.glob("*.safetensors"):
        if other == keep or other.resolve() in held:
            continue
        source, bits = _packed_meta(other)
        if not source or (source == mine and bits == my_bits) or not Path(source).exists():
            other.unlink(missing_ok=True)


def q4k_cache_file(path: str | Path, bits: int | None = None) -> Path:
    """The q4k mode's repacked-weight file for a model directory (may not exist yet)."""
    path = Path(path)
    return packed_path(path, sorted(path.glob("*.safetensors")), gguf_source(path), bits, requantized(path))


def prepare_q4k(path: str | Path, draft_bits: int | None = None) -> bool:
    """Repack a model's weights for the q4k kernel now (the first q4k load does it otherwise,
    ~20 s for the 1.5B), and with `draft_bits` its cheaper packing as a draft too. Returns False
    where the kernel cannot be built here."""
    from . import native

    if not native.available():
        return False
    path = Path(path)
    if draft_bits is not None and not q4k_cache_file(path, draft_bits).exists():
        load_transformer(path, dtype="q4k", device="cpu", bits=draft_bits)
    packed = q4k_cache_file(path)
    if not packed.exists():
        load_transformer(path, dtype="q4k", device="cpu")  # packs, then sparsifies the GGUF
    elif (gguf := gguf_source(path)) is not None:
        from .sparse import state

        if state(gguf) is None:  # packed by an earlier version, or killed in between
            _sparsify(path, gguf, packed, ModelArgs.from_dir(path))
    return True


def _strip_prefix(key: str) -> str:
    for prefix in ("model.language_model.", "language_model.model."):
        if key.startswith(prefix):
            return "model." + key[len(prefix) :]
    return key
