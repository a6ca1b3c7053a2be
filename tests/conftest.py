"""Shared fixtures: tiny random models (seconds) and the real SmolLM2 (installed by CI)."""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.testing import make_tiny_model

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Per-architecture tiny target directories, built once."""
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, object] = {}

    def get(arch: str = "llama", kind: str = "target"):
        key = f"{arch}-{kind}"
        if key not in cache:
            target = root / f"{arch}-target"
            if not target.exists():
                make_tiny_model(target, arch, seed=1)
            if kind == "target":
                cache[key] = target
            elif kind == "close":  # target + noise: agrees often, not always
                cache[key] = make_tiny_model(root / key, arch, seed=2, base=target, noise=0.05)
            elif kind == "independent":  # unrelated weights: mostly rejections
                cache[key] = make_tiny_model(root / key, arch, seed=3)
            else:
                raise ValueError(kind)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    loaded: dict[str, specdec.LoadedModel] = {}

    def get(arch: str = "llama", kind: str = "target", dtype: str = "fp32") -> specdec.LoadedModel:
        key = f"{arch}-{kind}-{dtype}"
        if key not in loaded:
            loaded[key] = specdec.load(tiny_dir(arch, kind), dtype=dtype, device="cpu")
        return loaded[key]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M in fp32, the reference precision (transformers is the oracle).
    Not installed -> the error names `specdec models install smollm2-135m`."""
    return specdec.load("smollm2-135m", dtype="fp32", device="cpu")
