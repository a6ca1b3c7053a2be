"""Shared fixtures: tiny random models (seconds), the real SmolLM2 (installed by CI), the
sampling-law machinery (exact joint laws by enumeration, seeded runs) and the deliberately
wrong acceptance rules the statistical tests use as negative controls."""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import PROMPT_IDS, V_SMALL, CliRun, drop_entries_under, run_cli

import specdec
from specdec import engine
from specdec.api import _request_kw, run_requests
from specdec.certify import broken_rules
from specdec.config import GenerationConfig, SamplingParams
from specdec.drafters import Drafter
from specdec.engine import GenerationResult
from specdec.model import load_transformer
from specdec.model.kernels import MODES
from specdec.model.native import available as native_available
from specdec.runtime import forget_all
from specdec.sampling import probs
from specdec.testing import make_tiny_model

# the batch-invariant modes this machine can run (q4k needs the native kernels)
EXACT_MODES = [m for m, mode in MODES.items() if mode.batch_invariant and (m != "q4k" or native_available())]

# Under pytest-xdist each worker takes its share of the cores: two workers of two threads each on
# two cores would make every parallel region of the kernels wait for a descheduled thread. Tiny
# models gain nothing from a second thread; the workers keep both cores busy instead.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)  # (and the commands a test runs in a subprocess)

# sequences in flight while a sampling-law test draws its samples: enough that a target pass
# and a draft model's batched proposal carry many rows, few enough that drafters which learn
# from earlier outputs (suffix decoding) see many finished ones
IN_FLIGHT = 200


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
def tiny4(tmp_path_factory):
    """Tiny targets of 4 layers (early exit drafts from their first 1-3), built once per session:
    tiny4(arch, dtype)."""
    root = tmp_path_factory.mktemp("tiny4")
    loaded: dict[tuple[str, str], specdec.LoadedModel] = {}

    def get(arch: str = "llama", dtype: str = "fp32") -> specdec.LoadedModel:
        if (arch, dtype) not in loaded:
            path = root / arch
            if not path.exists():
                make_tiny_model(path, arch, seed=5, layers=4)
            loaded[(arch, dtype)] = specdec.load(path, dtype=dtype, device="cpu")
        return loaded[(arch, dtype)]

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


def invariant(target: specdec.LoadedModel) -> bool:
    """Does the model's mode compute a sequence bitwise the same alone and in any batch?"""
    return MODES[target.model.mode].batch_invariant


def generate_many(target: specdec.LoadedModel, calls: list[tuple[object, dict]]) -> list[GenerationResult]:
    """`specdec.generate(target, prompt, **kw)` for every (prompt, kw), all in flight through one
    engine (`specdec.api.run_requests`). Only in the batch-invariant modes, where a sequence
    computes bitwise what it computes alone: there the batch is the same check as the calls one
    by one, at a fraction of the passes."""
    assert invariant(target), f"{target.model.mode} is not batch-invariant: generate one at a time"
    return run_requests(target, [_request_kw(target, prompt, kw) for prompt, kw in calls])


class PlainOutputs:
    """Plain greedy decoding of each (model, prompt, length, options), computed once per test
    session and shared by every identity test that compares with it. Keyed by the model object
    (weakly: a model a test made and dropped takes its entries with it); several missing outputs
    of one model are computed together where its mode is batch-invariant."""

    def __init__(self) -> None:
        self._memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, target: specdec.LoadedModel, prompts, max_new_tokens: int, **kw) -> list[GenerationResult]:
        """One plain result per prompt (greedy; `kw`: more of generate's keywords)."""
        single = not isinstance(prompts, list | tuple) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        memo = self._memo.setdefault(target.model, {})
        opts = dict(kw, max_new_tokens=max_new_tokens)
        keys = [(repr(p), repr(sorted(opts.items())), target.tokenizer.eos_ids) for p in prompts]
        missing = {k: p for k, p in zip(keys, prompts, strict=True) if k not in memo}
        if missing:
            calls = [(p, opts) for p in missing.values()]
            if invariant(target):
                results = generate_many(target, calls)
            else:
                results = [specdec.generate(target, p, **o) for p, o in calls]
            memo.update(zip(missing, results, strict=True))
        out = [memo[k] for k in keys]
        return out[0] if single else out


@pytest.fixture(scope="session")
def plain_outputs() -> PlainOutputs:
    """`plain_outputs(target, prompt_or_prompts, max_new_tokens, **kw)`: plain decoding's results, shared."""
    return PlainOutputs()


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
    make_drafter: Callable[[], Drafter | None],
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
    width: int = IN_FLIGHT,
    chooser: Callable[[float], Any] | None = None,
) -> Counter:
    """Outputs of `runs` speculative generations with seeds 0..runs-1, drawn as `specdec certify`
    draws: `width` sequences in flight through one engine (a new one joins as one ends), each
    with its own drafter from `make_drafter`. A sequence's output law does not depend on what
    else is in the batch (each verifies with its own generator; a drafter that learns from
    other sequences' outputs only changes q), so the samples are independent draws of the law
    under test. With `expect_mixed`, drafts were offered and both branches of the rule (accept;
    reject + recover) exercised."""
    cfg = GenerationConfig(max_new_tokens=n_tokens, k=k, ignore_eos=True, adaptive_k=adaptive_k)
    eng = engine.Engine(target)
    counts: Counter = Counter()
    accepted = proposed = started = 0
    live = 0
    while started < runs or live:
        while started < runs and live < width:
            seeded = dataclasses.replace(sampling, seed=started)
            eng.add(prompt, cfg, seeded, make_drafter(), prediction=prediction, chooser=chooser)
            started, live = started + 1, live + 1
        for delta in eng.step():
            if delta.finished:
                live -= 1
                out = eng.result(delta.seq_id)
                counts[tuple(out.token_ids)] += 1
                accepted, proposed = accepted + out.metrics.accepted, proposed + out.metrics.proposed
    assert sum(counts.values()) == runs
    if expect_mixed:
        assert proposed > runs // 2 and bounds[0] < accepted / proposed < bounds[1]
    return counts


@pytest.fixture(scope="session")
def sample_joint():
    return _sample_joint


@pytest.fixture
def specdec_cli(capsys, monkeypatch):
    """`specdec_cli(*args, env_home=None)`: `specdec ARGS` in this process (`helpers.run_cli`);
    `env_home`: the specdec cache it sees."""

    def run(*args: str, env_home=None) -> CliRun:
        if env_home is not None:
            monkeypatch.setenv("SPECDEC_HOME", str(env_home))
        return run_cli(capsys, *args)

    return run


@pytest.fixture
def wrong_rule(monkeypatch):
    """Install a subtly wrong verification rule in the engine (`specdec.certify.BROKEN_RULES`): wrong_rule("rejection"),
    wrong_rule("point-mass"), wrong_rule("tree"), wrong_rule("sampled-tree") or wrong_rule("mixed-tree")."""

    def install(which: str) -> None:
        # every engine built from here verifies with it: the same broken rules `specdec certify`
        # hands its control's engine
        monkeypatch.setattr(engine, "EXACT", broken_rules([which]))

    return install


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, at most 4 (each loads the real models once)."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs a real model (`real`) is slow too: `pytest -m "not slow"` is the fast
    subset a developer iterates with (tiny random models, hand-built logits), the whole suite
    what CI runs."""
    for item in items:
        if item.get_closest_marker("real") is not None:
            item.add_marker(pytest.mark.slow)
