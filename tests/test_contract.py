"""The contract every registered drafter keeps, as one table.

Each drafter of `specdec.drafters.DRAFTERS` has one row, saying how to build it
- on tiny random models, for **greedy identity**: its output equals plain decoding's token for
  token (asserted bitwise in the default, batch-invariant mode; in every exact mode where its own
  code path differs by mode), over several prompts and settings;
- on the 8-token models whose joint law of 4 tokens is enumerated exactly, for the **sampling
  law** at T = 1 and with top-k / top-p (3,000 draws, chi-square at ALPHA), and for its
  **negative control**: the same draws verified with the rule its steps go through, broken
  (`specdec.certify.BROKEN_RULES`), must fail the same test.

The tests are parametrized from DRAFTERS, not from the table: a drafter registered without a
row fails `test_every_drafter_keeps_the_contract` and its own `...-no-row` cases; it cannot be
left out by forgetting a list. How the checks run: every greedy case of a row (prompts x
settings) goes through one engine in one batch — in the batch-invariant modes a sequence
computes bitwise what it computes alone — against plain outputs computed once per session
(`plain_outputs`); the 3,000 draws of a law go through one engine with many sequences in flight
(`sample_joint`), as `specdec certify` draws. Checks particular to one drafter (its k
schedule, trees, cut vocabularies, windows, a prediction's edits, real models) stay in its own
file.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import EXACT_MODES, generate_many
from helpers import (
    ALPHA,
    LOOKAHEAD_CONFIGS,
    PROMPT_IDS,
    PROMPTS,
    Switching,
    chi2_pvalue,
    no_timing,
    random_head,
    random_heads,
    small_head,
)

from specdec.config import SamplingParams
from specdec.drafters import (
    DRAFTERS,
    AutoDrafter,
    DraftModelDrafter,
    Eagle3Drafter,
    EarlyExitDrafter,
    HydraDrafter,
    LookaheadDrafter,
    MedusaDrafter,
    PredictionDrafter,
    PromptLookupDrafter,
    SuffixDrafter,
)
from specdec.drafters.suffix import STORE
from specdec.memory import pools_of

DEFAULT_MODE = EXACT_MODES[-1]  # what `specdec.load` takes on this machine (q4k where it builds)
T1 = SamplingParams(temperature=1.0)
TOPK_TOPP = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
T05 = SamplingParams(temperature=0.5)  # a peaked q: where a sampled tree's rule is most visible
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma3")

Runs = Callable[[Any, Any, list[int]], list[dict]]  # (target, draft, plain's ids) -> generate keywords per run


@dataclass(frozen=True)
class Greedy:
    """Greedy identity on tiny models: for each prompt, `runs` gives the generate keywords of each
    run (a fresh drafter object each); every run must give plain decoding's tokens."""

    runs: Runs
    archs: tuple[str, ...] = ("llama", "qwen2", "gemma3")
    modes: tuple[str, ...] = (DEFAULT_MODE,)  # every exact mode only where the drafter's code path differs by mode
    drafts: tuple[str, ...] = ("close",)  # kinds of tiny draft model (`tiny`) the runs are given
    max_new_tokens: int = 40
    prompts: tuple[str, ...] = tuple(PROMPTS)
    layers4: bool = False  # a 4-layer target (early exit drafts from its first 1-3 layers)
    expect: tuple[str, ...] = ("proposed",)  # what must have happened over the runs: proposed, accepted, rejected
    setup: Callable[[pytest.MonkeyPatch], Any] | None = None  # returns a state for `check`
    check: Callable[[Any, str, dict[str, bool]], None] | None = None  # (state, draft kind, what happened)
    # the seed of the random chooser every run is given (`helpers.Switching`), whose picks are
    # then `check`'s state; None: the real one
    switching: int | None = None


@dataclass(frozen=True)
class Law:
    """The sampling law on the 8-token models: `make(target, draft)` gives a factory of fresh
    drafters; `options`: `sample_joint`'s keywords; `controls`: (broken rule, sampling, the
    factory's maker where the control needs another drafter) — each must fail the test."""

    make: Callable[[Any, Any], Callable[[], Any]]
    options: dict = field(default_factory=dict)
    samplings: tuple[tuple[str, SamplingParams], ...] = (("T1", T1), ("T0.7-topk-topp", TOPK_TOPP))
    controls: tuple[tuple[str, SamplingParams, Callable | None, dict], ...] = ()
    setup: Callable[[pytest.MonkeyPatch, Any], Any] | None = None  # (monkeypatch, target) -> state for `check`
    check: Callable[[Any, Any], None] | None = None  # (state, target)
    switching: int | None = None  # as `Greedy.switching`


@dataclass(frozen=True)
class Row:
    greedy: Greedy
    law: Law


# -- the rows ------------------------------------------------------------------------------------
def _lookup_runs(target, draft, ids):
    return [dict(drafter=PromptLookupDrafter(), k=k, adaptive_k=False) for k in (1, 3, 6)]


def _suffix_runs(target, draft, ids):
    settings = (({"total": 6}, 3), ({"total": 12, "factor": 8.0}, 6), ({}, 16))
    return [dict(drafter=SuffixDrafter(**kw), k=k) for kw, k in settings]


def _lookahead_runs(target, draft, ids):
    return [
        dict(drafter=LookaheadDrafter(**cfg), k=k, adaptive_k=False)
        for cfg, k in zip(LOOKAHEAD_CONFIGS, (2, 3, 1), strict=True)
    ]


def _early_exit_runs(target, draft, ids):
    return [
        dict(drafter=EarlyExitDrafter(target.model, layer=layer), k=k, adaptive_k=False)
        for layer, k in ((1, 3), (2, 1), (3, 4), (None, 2))
    ]


def _prediction_runs(target, draft, ids):
    """The output itself, and with one token changed in the middle, as the client's prediction."""
    m = len(ids) // 2
    changed = ids[:m] + [(ids[m] + 1) % 200] + ids[m + 1 :]
    return [dict(drafter="prediction", prediction=p, k=6, adaptive_k=a) for p in (ids, changed) for a in (True, False)]


def _eagle3_runs(target, draft, ids):
    head = _cached(target, "eagle3", lambda: random_head(target.model, seed=2, scale=20.0))
    options = ({"topk": 1, "total": 4}, {"topk": 3, "total": 8}, {"topk": 4, "total": 30})
    return [dict(drafter=Eagle3Drafter(target.model, head=head, **o), k=4, adaptive_k=False) for o in options]


def _heads_runs(kind: str, cls) -> Runs:
    def runs(target, draft, ids):
        heads = _cached(target, kind, lambda: random_heads(target.model, kind, seed=2))
        options = ({"total": 1}, {"total": 3, "topk": 1}, {"total": 12}, {"total": 31})
        return [dict(drafter=cls(target.model, head=heads, **o), k=3, adaptive_k=False) for o in options]

    return runs


def _draft_model_runs(target, draft, ids):
    return [dict(assistant_model=draft, k=k, adaptive_k=False) for k in (1, 2, 3, 5, 8)]


def _close_draft_accepted(state, kind, happened):
    if kind == "close":  # (an independent draft is accepted rarely)
        assert happened["accepted"], "a draft close to the target was never accepted"


def _auto_runs(target, draft, ids):
    return [dict(drafter="auto", k=4), dict(drafter="auto", assistant_model=draft, k=4)]


def _auto_greedy_setup(monkeypatch):
    no_timing(monkeypatch)  # (the draft's depth is priced: the same costs every run, the same steps)


def _auto_greedy_check(picks, kind, happened):
    assert {m for m, _ in picks} == {"plain", "prompt-lookup", "suffix", "draft-model"}
    assert {k for m, k in picks if m == "draft-model"} >= {1, 4}


def _auto_law_setup(monkeypatch, target):
    no_timing(monkeypatch)


def _auto_law_check(picks, target):
    assert {m for m, _ in picks} == {"plain", "prompt-lookup", "suffix", "draft-model"}


def _suffix_law_setup(monkeypatch, target):
    """Trees from the prompt and from earlier runs' outputs (the store is read although the
    runs are seeded: what is tested is the rule, given any tree)."""
    from specdec import costs

    monkeypatch.setattr(costs, "reproducible", lambda s: False)
    pools_of(target).pools.clear()


def _suffix_law_check(state, target):
    stores = [m.get(STORE) for m in pools_of(target).pools.values()]
    assert max(len(s.docs) for s in stores if s is not None) > 100  # earlier outputs were drafted from


_HEADS: dict[tuple[int, str], Any] = {}


def _cached(target, kind: str, build: Callable[[], Any]):
    """One random head (or set of heads) per tiny target and kind, built on first use."""
    key = (id(target.model), kind)
    if key not in _HEADS:
        _HEADS[key] = (target.model, build())  # (the model kept: its id is not reused)
    return _HEADS[key][1]


def _v8_heads(target, kind):
    """Heads over the 8-token vocabulary (accepted 13-31% of the time at the settings tested);
    two tokens they can never draft."""
    return random_heads(target, kind, seed=9, num_heads=2, noise=0.3, hydra_inner=8, vocab_ids=[0, 1, 2, 4, 5, 7])


def _heads_law(kind: str, cls) -> Law:
    def make(target, draft):
        heads = _v8_heads(target, kind)
        return lambda: cls(target, head=heads, total=5)

    return Law(make, dict(k=2, bounds=(0.05, 0.95)), controls=(("sampled-tree", T05, None, {}),))


def _eagle3_make(target, draft):
    head = small_head(target)
    return lambda: Eagle3Drafter(target, head=head, sample_children=2, sample_frontier=2)


CONTRACT: dict[str, Row] = {
    "draft-model": Row(
        # the draft model runs the family's own code, in the mode's kernels: every family, every exact mode
        Greedy(
            _draft_model_runs,
            archs=FAMILIES,
            modes=tuple(EXACT_MODES),
            drafts=("close", "independent"),
            max_new_tokens=24,
            expect=("rejected",),
            check=_close_draft_accepted,
        ),
        Law(
            lambda target, draft: lambda: DraftModelDrafter(draft),
            controls=(("rejection", T1, None, {}),),  # a rejection recovered from p, not norm(max(0, p - q))
        ),
    ),
    "prompt-lookup": Row(
        Greedy(_lookup_runs),
        Law(
            lambda target, draft: lambda: PromptLookupDrafter(max_ngram=2),
            dict(k=3, bounds=(0.05, 0.95)),
            controls=(("point-mass", T1, None, {}),),
        ),
    ),
    "suffix": Row(
        Greedy(_suffix_runs),
        Law(
            lambda target, draft: lambda: SuffixDrafter(total=4, min_prob=0.0),
            dict(k=3, prompt=PROMPT_IDS * 2, bounds=(0.05, 0.99)),
            controls=(("tree", T1, None, {}),),
            setup=_suffix_law_setup,
            check=_suffix_law_check,
        ),
    ),
    "lookahead": Row(
        Greedy(_lookahead_runs, expect=("accepted",)),
        Law(
            lambda target, draft: lambda: LookaheadDrafter(window=3, ngram=2, guesses=3),
            dict(prompt=PROMPT_IDS * 2, bounds=(0.05, 0.95)),
            controls=(("tree", T1, None, {}),),
        ),
    ),
    "prediction": Row(
        Greedy(_prediction_runs, archs=("llama", "qwen2"), prompts=tuple(PROMPTS[:3]), expect=("accepted", "rejected")),
        Law(
            # a prediction the target follows part of the time (its likeliest tokens): both branches run
            lambda target, draft: PredictionDrafter,
            dict(k=3, prediction=[3, 3, 7, 3, 7], bounds=(0.05, 0.95)),
            controls=(("point-mass", T1, None, {}),),
        ),
    ),
    "early-exit": Row(
        # drafts through the target's own early blocks, which run other code per mode: every exact mode
        Greedy(
            _early_exit_runs,
            modes=tuple(EXACT_MODES),
            max_new_tokens=30,
            layers4=True,
            expect=("accepted", "rejected"),
        ),
        Law(
            lambda target, draft: lambda: EarlyExitDrafter(target, layer=1),
            dict(bounds=(0.05, 0.95)),
            controls=(("rejection", T1, None, {}),),
        ),
    ),
    "eagle3": Row(
        Greedy(_eagle3_runs, max_new_tokens=24, expect=("proposed", "accepted")),
        Law(
            _eagle3_make,
            dict(k=2, bounds=(0.05, 0.95)),
            samplings=(("T1", T1), ("T0.7-topk-topp", TOPK_TOPP), ("T0.5", T05)),
            # keeping a rejected child's mass in q
            controls=(("sampled-tree", T05, None, {}),),
        ),
    ),
    "medusa": Row(
        Greedy(_heads_runs("medusa", MedusaDrafter), max_new_tokens=24, expect=("proposed", "accepted")),
        _heads_law("medusa", MedusaDrafter),
    ),
    "hydra": Row(
        Greedy(_heads_runs("hydra", HydraDrafter), max_new_tokens=24, expect=("proposed", "accepted")),
        _heads_law("hydra", HydraDrafter),
    ),
    "auto": Row(
        # the chooser replaced by a seeded random pick of a member (or a plain step) and k, every step
        Greedy(
            _auto_runs,
            archs=("llama",),
            max_new_tokens=24,
            setup=_auto_greedy_setup,
            switching=0,
            check=_auto_greedy_check,
        ),
        Law(
            lambda target, draft: lambda: AutoDrafter(target, draft),
            samplings=(("T1", T1), ("T0.7-topk", SamplingParams(temperature=0.7, top_k=5))),
            # each control switches between the member whose rule is broken and plain steps only,
            # so that enough steps go through the rule under test
            controls=(
                ("rejection", T1, lambda target, draft: lambda: AutoDrafter(target, draft, methods="draft-model"), {}),
                (
                    "point-mass",
                    T1,
                    lambda target, draft: lambda: AutoDrafter(target, methods="prompt-lookup"),
                    dict(k=3, expect_mixed=False),
                ),
            ),
            setup=_auto_law_setup,
            switching=1,
            check=_auto_law_check,
        ),
    ),
}


def _row(name: str) -> Row:
    if name not in CONTRACT:
        pytest.fail(f"drafter {name!r} is registered but has no row in tests/test_contract.py's CONTRACT: add one")
    return CONTRACT[name]


def _cases(part: Callable[[str, Row], list[tuple[Any, ...]]]) -> list:
    """One case per registered drafter and setting; a drafter without a row gives one failing case."""
    out = []
    for name in sorted(DRAFTERS):
        if name not in CONTRACT:
            out.append(pytest.param(name, None, None, None, id=f"{name}-no-row"))
            continue
        for values in part(name, CONTRACT[name]):
            out.append(pytest.param(name, *values, id="-".join([name, *(v for v in values if isinstance(v, str))])))
    return out


def test_every_drafter_keeps_the_contract():
    assert set(CONTRACT) == set(DRAFTERS), "one row per registered drafter (no more, no fewer)"


def test_a_drafter_without_a_row_cannot_be_skipped(monkeypatch):
    """Negative control: a drafter registered without a row is in every parametrization, as a
    case that fails."""
    monkeypatch.setitem(DRAFTERS, "new-drafter", DRAFTERS["prompt-lookup"])
    for part in (_greedy_cases, _law_cases):
        ids = [case.id for case in _cases(part)]
        assert "new-drafter-no-row" in ids and all(f"{name}-" in " ".join(ids) for name in CONTRACT)
    with pytest.raises(pytest.fail.Exception, match="'new-drafter' is registered but has no row"):
        _row("new-drafter")


# -- greedy identity -----------------------------------------------------------------------------
def _greedy_cases(name: str, row: Row) -> list[tuple[str, str, str]]:
    g = row.greedy
    return list(itertools.product(g.archs, g.modes, g.drafts))


@pytest.mark.parametrize("name, arch, mode, draft_kind", _cases(_greedy_cases))
def test_greedy_identity(name, arch, mode, draft_kind, tiny, tiny4, plain_outputs, monkeypatch):
    g = _row(name).greedy
    target = (tiny4 if g.layers4 else tiny)(arch, dtype=mode)
    draft = tiny(arch, draft_kind, dtype=mode)
    state = g.setup(monkeypatch) if g.setup is not None else None
    chooser = Switching(g.switching) if g.switching is not None else None
    kw = dict(max_new_tokens=g.max_new_tokens, ignore_eos=True)  # (tiny tokenizers have no chat template)
    plains = plain_outputs(target, list(g.prompts), **kw)
    calls = [
        (prompt, dict(kw, **run))
        for prompt, p in zip(g.prompts, plains, strict=True)
        for run in g.runs(target, draft, p.token_ids)
    ]
    if chooser is not None:
        calls = [(prompt, dict(run, chooser=chooser)) for prompt, run in calls]
    outs = generate_many(target, calls)
    expected = {prompt: p for prompt, p in zip(g.prompts, plains, strict=True)}
    for (prompt, run), out in zip(calls, outs, strict=True):
        settings = {k: v for k, v in run.items() if k not in kw and k != "chooser"}
        assert out.token_ids == expected[prompt].token_ids, (prompt, settings)
        assert out.text == expected[prompt].text
    proposed = sum(o.metrics.proposed for o in outs)
    accepted = sum(o.metrics.accepted for o in outs)
    happened = {"proposed": proposed > 0, "accepted": accepted > 0, "rejected": proposed > accepted}
    for what in g.expect:
        assert happened[what], f"no draft token was {what}: the check did not exercise that path"
    if g.check is not None:
        g.check(chooser.picks if chooser is not None else state, draft_kind, happened)


# -- the sampling law and its negative control ---------------------------------------------------
def _law_cases(name: str, row: Row) -> list[tuple[str, str, int | None]]:
    laws = [("law", label, None) for label, _ in row.law.samplings]
    return laws + [("control", rule, i) for i, (rule, _, _, _) in enumerate(row.law.controls)]


# the controls caught by far at 1,000 draws (p under 1e-10 there, on an AVX2 EPYC, 2026-12-07),
# which draw no more; the others (auto's, lookahead's, suffix's: a broken rule that touches fewer
# steps) keep 3,000, as every law does
STRONG_CONTROLS = {"draft-model", "eagle3", "early-exit", "hydra", "medusa", "prediction", "prompt-lookup"}


@pytest.mark.slow
@pytest.mark.parametrize("name, kind, label, index", _cases(_law_cases))
def test_sampling_law(name, kind, label, index, small_vocab, exact_joint, sample_joint, monkeypatch, wrong_rule):
    """The target's joint law of 4 tokens, by enumeration, against 3,000 draws; a control draws
    with its rule broken (1,000 or 3,000 times) and must be caught (p <= ALPHA)."""
    law = _row(name).law
    target, draft = small_vocab
    if kind == "law":
        sampling, make, extra = dict(law.samplings)[label], law.make, {}
    else:
        rule, sampling, maker, extra = law.controls[index]
        wrong_rule(rule)
        make = maker or law.make
    state = law.setup(monkeypatch, target) if law.setup is not None else None
    chooser = Switching(law.switching) if law.switching is not None else None
    options = {**law.options, **extra, **({"chooser": chooser} if chooser is not None else {})}
    runs = 1000 if kind == "control" and name in STRONG_CONTROLS else 3000
    counts = sample_joint(target, make(target, draft), sampling, runs=runs, **options)
    p = chi2_pvalue(counts, exact_joint(target, sampling, 4, options.get("prompt", PROMPT_IDS)))
    print(f"{name} {kind} {label}: p = {p:.3g}")  # (-s shows every law's and control's p-value)
    if kind == "law":
        assert p > ALPHA, p
        if law.check is not None:
            law.check(chooser.picks if chooser is not None else state, target)
    else:
        assert p <= ALPHA, f"the broken {label!r} rule was not caught (p = {p:.3g})"
