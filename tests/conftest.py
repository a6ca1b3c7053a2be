"""Shared fixtures: tiny random models (seconds), the real SmolLM2 (installed by CI), the
sampling-law machinery (exact joint laws by enumeration, seeded runs) and the deliberately
wrong acceptance rules the statistical tests use as negative controls."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from helpers import PROMPT_IDS, V_SMALL, drop_entries_under

import specdec
from specdec import engine
from specdec.certify import broken_rules
from specdec.config import GenerationConfig, SamplingParams
from specdec.model import load_transformer
from specdec.model.kernels import MODES
from specdec.model.native import available as native_available
from specdec.runtime import forget_all
from specdec.sampling import probs
from specdec.testing import make_tiny_model

# the batch-invariant modes this machine can run (q4k needs the native kernels)
EXACT_MODES = [m for m, mode in MODES.items() if mode.batch_invariant and (m != "q4k" or native_available())]

torch.set_num_threads(max(1, torch.get_num_threads()))


# the specdec cache's measurement tables (see specdec.costs.store_measurement)
MEASUREMENT_TABLES = ("pass_costs-v3.json", "draft_step-v1.json", "early_exit.json")


@pytest.fixture(scope="session", autouse=True)
def _no_measurements_of_temporary_models(tmp_path_factory):
    """Tests time tiny models in temporary directories, and a measurement is kept per model
    directory: without this, every run would leave its entries in the user's tables."""
    yield
    from specdec.store import cache_root

    runs = str(tmp_path_factory.getbasetemp().parent)  # (pytest-of-<user>: this run's and earlier ones')
    for name in MEASUREMENT_TABLES:
        drop_entries_under(cache_root() / name, runs)


@pytest.fixture(autouse=True)
def _fresh_acceptance_memory():
    """Each test starts as a new process would: nothing remembered from other tests' requests
    (acceptance, suffix stores, cached rows: `specdec.runtime.forget_all`), so no test depends on
    the order."""
    forget_all()
    yield


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


@pytest.fixture(scope="session")
def smollm2_exact():
    """SmolLM2-135M in a batch-invariant mode (q4k, or int8 where q4k cannot be built): where
    greedy identity is guaranteed bitwise and asserted."""
    return specdec.load("smollm2-135m", dtype=EXACT_MODES[-1], device="cpu")


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory):
    """A target and a noisy draft over an 8-token vocabulary (fp32): joint laws of a few
    tokens can be enumerated exactly."""
    root = tmp_path_factory.mktemp("v8")
    t = make_tiny_model(root / "t", "llama", seed=11, vocab_size=V_SMALL, tokenizer=False)
    d = make_tiny_model(root / "d", "llama", seed=12, vocab_size=V_SMALL, tokenizer=False, base=t, noise=0.3)
    return load_transformer(t, device="cpu"), load_transformer(d, device="cpu")


def _exact_joint(model, sampling: SamplingParams, n: int, prompt: list[int] = PROMPT_IDS) -> dict[tuple, float]:
    """P(t1..tn | prompt) under the target alone, by enumeration."""
    out: dict[tuple, float] = {}

    def walk(prefix: list[int], mass: float) -> None:
        if len(prefix) == n:
            out[tuple(prefix)] = mass
            return
        logits = model(torch.tensor([prompt + prefix]), model.new_cache(len(prompt) + n), last_only=True).logits[0, -1]
        p = probs(logits, sampling)
        for t in range(V_SMALL):
            if p[t] > 0:
                walk(prefix + [t], mass * float(p[t]))

    walk([], 1.0)
    return out


@pytest.fixture(scope="session")
def exact_joint():
    return _exact_joint


def _sample_joint(
    target,
    drafter,
    sampling: SamplingParams,
    *,
    runs: int,
    n_tokens: int = 4,
    k: int = 2,
    prompt: list[int] = PROMPT_IDS,
    expect_mixed: bool = True,
    bounds=(0.1, 0.9),
    adaptive_k: bool = False,
    prediction: list[int] | None = None,
) -> Counter:
    """Outputs of `runs` seeded speculative generations with `drafter`. With `expect_mixed`,
    drafts were offered and both branches of the rule (accept; reject + recover) exercised."""
    cfg = GenerationConfig(max_new_tokens=n_tokens, k=k, ignore_eos=True, adaptive_k=adaptive_k)
    counts: Counter = Counter()
    accepted = proposed = 0
    for seed in range(runs):
        out = engine.run(target, prompt, cfg, dataclasses.replace(sampling, seed=seed), drafter, prediction=prediction)
        counts[tuple(out.token_ids)] += 1
        accepted, proposed = accepted + out.metrics.accepted, proposed + out.metrics.proposed
    if expect_mixed:
        assert proposed > runs // 2 and bounds[0] < accepted / proposed < bounds[1]
    return counts


@pytest.fixture(scope="session")
def sample_joint():
    return _sample_joint


@pytest.fixture
def wrong_rule(monkeypatch):
    """Install a subtly wrong verification rule in the engine (`specdec.certify.BROKEN_RULES`): wrong_rule("rejection"),
    wrong_rule("point-mass"), wrong_rule("tree"), wrong_rule("sampled-tree") or wrong_rule("mixed-tree")."""

    def install(which: str) -> None:
        # every engine built from here verifies with it: the same broken rules `specdec certify`
        # hands its control's engine
        monkeypatch.setattr(engine, "EXACT", broken_rules([which]))

    return install


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs a real model (`real`) is slow too: `pytest -m "not slow"` is the fast
    subset a developer iterates with (tiny random models, hand-built logits), the whole suite
    what CI runs."""
    for item in items:
        if item.get_closest_marker("real") is not None:
            item.add_marker(pytest.mark.slow)
