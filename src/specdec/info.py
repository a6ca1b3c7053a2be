"""`specdec info`: what this machine has and what specdec will run on it.

CPU model and the instruction-set flags the kernels care about, the native kernel build the
dispatcher picks and why, the default precision mode, threads, memory size and a measured
copy bandwidth (decoding one token is bound by it), and the installed models with their size
on disk. Numbers in bug reports and benchmark notes should say which of these produced them.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from . import registry, store
from .version import __version__

FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def copy_bandwidth_gbs(mib: int = 256, repeats: int = 3) -> float:
    """Read + write bandwidth of one large tensor copy (GB/s, the best of a few)."""
    a = torch.ones(mib * 2**18)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return round(2 * a.numel() * 4 / min(times) / 1e9, 1)


def _dir_bytes(path: Path) -> int:
    """Bytes the files under `path` take on disk: a sparse GGUF's holes (`model.sparse`) do not count."""
    from .model.sparse import disk_bytes

    return sum(disk_bytes(p) for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def model_blocks(name: str) -> dict[str, Any]:
    """An installed model's block types (type -> tensors, its 2-D ones) and how the q4k mode runs
    them: as the file holds them, or re-quantized (`--requantize`)."""
    from .model.gguf_file import block_types
    from .model.load import requantized

    gguf = store.gguf_path(registry.MODELS[name])
    if not gguf.exists():
        return {}
    return {
        "block_types": block_types(gguf),
        "requantize": requantized(store.converted_dir(registry.MODELS[name].sha256)),
    }


def blocks_text(m: dict[str, Any], build: str | None) -> str:
    """'Q5_0 133, Q8_0 13, ... (run as the file holds them, avx512 kernels)'."""
    types = ", ".join(f"{t} {n}" for t, n in m.get("block_types", {}).items())
    how = (
        "re-quantized to Q6_K where not Q4_K/Q6_K (--requantize)"
        if m.get("requantize")
        else "run as the file holds them"
    )
    return f"{types} ({how}, {build or 'no native'} kernels)"


def collect(bandwidth: bool = True) -> dict[str, Any]:
    from .model import native
    from .model.kernels import default_mode_name

    cpu = native.cpu_info()
    flags = native._cpu_flags()
    try:
        variant, why = native.dispatch()
        kernels: dict[str, Any] = {"build": variant, "why": why}
        try:
            native.library()
        except native.NativeUnavailableError as exc:
            kernels = {"build": None, "why": str(exc).splitlines()[0]}
    except native.NativeUnavailableError as exc:
        kernels = {"build": None, "why": str(exc)}
    models = {}
    for name in registry.MODELS:
        if store.is_installed(name):
            models[name] = {f"{kind}_mib": round(n / 2**20) for kind, n in store.model_files(name).items()}
            models[name] |= model_blocks(name)
    return {
        "specdec": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": {
            "model": cpu.get("model name", platform.processor()),
            "vendor": cpu.get("vendor_id"),
            "family": cpu.get("cpu family"),
            "model_number": cpu.get("model"),
            "flags": {f: f in flags for f in FLAGS},
        },
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _mem_total_gib(),
        "copy_bandwidth_gbs": copy_bandwidth_gbs() if bandwidth else None,
        "kernels": kernels,
        "default_mode": default_mode_name(torch.device("cpu")),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cache": str(store.cache_root()),
        "cache_mib": round(_dir_bytes(store.cache_root()) / 2**20),
        "models": models,
    }


def text(info: dict[str, Any]) -> str:
    c = info["cpu"]
    have = [f for f, on in c["flags"].items() if on]
    k = info["kernels"]
    lines = [
        f"specdec {info['specdec']}, torch {info['torch']}, Python {info['python']}",
        f"CPU: {c['model']} (vendor {c['vendor']}, family {c['family']} model {c['model_number']}), "
        f"{info['cores']} cores, torch threads {info['torch_threads']}",
        f"  flags: {' '.join(have) or 'none of ' + ', '.join(FLAGS)}",
        f"memory: {info['memory_gib']} GiB"
        + (f", copy bandwidth {info['copy_bandwidth_gbs']} GB/s" if info["copy_bandwidth_gbs"] else ""),
        f"native kernels: {k['build'] or 'unavailable'} ({k['why']})",
        f"default precision mode on the CPU: {info['default_mode']}"
        + (f"; CUDA: {info['cuda']}" if info["cuda"] else ""),
        f"cache: {info['cache']} ({info['cache_mib']} MiB)",
    ]
    for name, m in info["models"].items():
        lines.append(
            f"  {name}: GGUF {m['gguf_mib']} MiB, q4k packed {m['q4k_mib']} MiB, float32 {m['float32_mib']} MiB, "
            f"other {m['other_mib']} MiB"
        )
        if m.get("block_types"):
            lines.append(f"    blocks: {blocks_text(m, k['build'])}")
    if not info["models"]:
        lines.append("  no model installed (specdec models install NAME)")
    return "\n".join(lines)
