"""`--drafter auto`: the chooser's decisions from hand-set estimates, and exactness with the
drafter and k switching every step — greedy identity (one sequence and a batch), and the
sampled law (chi-square) with a wrong rule as the negative control."""

from __future__ import annotations

import pytest
from conftest import EXACT_MODES
from helpers import ALPHA, PASS, PROMPTS, chi2_pvalue, no_timing, random_head, small_head, switching

import specdec
from specdec.adaptive import MethodChooser
from specdec.config import GenerationConfig, SamplingParams
from specdec.drafters import AutoDrafter
from specdec.engine import Engine

LOOKUP, DRAFT, EAGLE3, SUFFIX = "prompt-lookup", "draft-model", "eagle3", "suffix"


def _feed(c: MethodChooser, method: str, situation, steps: int, asked: int, accepted: int, draft_ms: float) -> None:
    for _ in range(steps):
        c.update(method, situation, asked, asked, accepted, draft_ms)


def test_each_drafter_is_measured_once_then_the_best_rate_wins():
    c = MethodChooser([DRAFT, LOOKUP], 4, PASS)
    both = {DRAFT: ("", 4, 0.0), LOOKUP: (3, 4, 0.0)}
    assert c.choose(both) == (DRAFT, 4)  # costs unknown: draft once with each to measure them
    _feed(c, DRAFT, "", 1, 4, 2, draft_ms=4 * 15.0)
    assert c.choose(both) == (LOOKUP, 4)
    _feed(c, LOOKUP, 3, 10, 4, 4, draft_ms=0.2)  # copies that are always accepted, nearly free
    for accepted in [0, 1] * 5:  # a draft model at 15 ms a token whose first draft is right half the time
        _feed(c, DRAFT, "", 1, 4, accepted, draft_ms=4 * 15.0)
    assert c.choose(both) == (LOOKUP, 4)
    # no n-gram match this step: the draft model only where it beats plain decoding
    assert c.rate(DRAFT, "", 1) < c.rate("plain", None, 0)
    assert c.choose({DRAFT: ("", 4, 0.0)}) == ("plain", 0)
    _feed(c, DRAFT, "", 20, 2, 2, draft_ms=2 * 3.0)  # the draft becomes cheap and right
    assert c.choose({DRAFT: ("", 4, 0.0)})[0] == DRAFT
    report = c.report()
    assert report["steps"]["plain"] == {"steps": 1} and report["switches"] >= 2


def test_acceptance_is_kept_per_situation():
    c = MethodChooser([LOOKUP], 4, PASS)
    c.choose({LOOKUP: (1, 2, 0.0)})
    _feed(c, LOOKUP, 1, 30, 2, 0, draft_ms=0.1)  # one-token matches: never accepted
    _feed(c, LOOKUP, 3, 30, 4, 4, draft_ms=0.1)  # three-token matches: always accepted
    assert c.choose({LOOKUP: (1, 2, 0.0)}) == ("plain", 0)
    assert c.choose({LOOKUP: (3, 4, 0.0)}) == (LOOKUP, 4)
    assert c.choose({LOOKUP: (3, 2, 0.0)}) == (LOOKUP, 2)  # never more than the drafter can propose
    assert c.choose({}) == ("plain", 0)  # nothing to propose


def test_earlier_requests_acceptance_is_the_next_ones_prior():
    """One-token matches never accepted in a request: the next request with the same memory
    starts with plain steps there, where a fresh chooser (prior alpha_1 = 0.6) tries them; an
    unseen situation and a drafter with a model of its own start from the prior either way."""
    memory: dict = {}
    first = MethodChooser(
        [LOOKUP, DRAFT], 4, PASS, draft_ms={LOOKUP: 0.1, DRAFT: 15.0}, memory=memory, remembered=frozenset({LOOKUP})
    )
    _feed(first, LOOKUP, 1, 30, 2, 0, draft_ms=0.2)
    _feed(first, DRAFT, "", 30, 2, 0, draft_ms=30.0)
    assert set(memory) == {(LOOKUP, 1)}  # the draft model's acceptance is its own, not the target's

    def chooser(mem):
        return MethodChooser(
            [LOOKUP, DRAFT], 4, PASS, draft_ms={LOOKUP: 0.1, DRAFT: 3.0}, memory=mem, remembered=frozenset({LOOKUP})
        )

    one_token = {LOOKUP: (1, 2, 0.0)}
    assert chooser(memory).choose(one_token) == ("plain", 0)
    assert chooser(None).choose(one_token)[0] == LOOKUP
    assert chooser(memory).choose({LOOKUP: (3, 4, 0.0)})[0] == LOOKUP  # never seen: the prior
    assert chooser(memory).choose({DRAFT: ("", 4, 0.0)})[0] == DRAFT  # not remembered: the prior


def test_plain_steps_probe_each_drafter_in_turn():
    c = MethodChooser([DRAFT, LOOKUP], 4, PASS)
    c.choose({DRAFT: ("", 4, 0.0)})
    c.choose({LOOKUP: (2, 4, 0.0)})
    for _ in range(10):
        c.update(DRAFT, "", 4, 4, 0, 4 * 19.0)
        c.update(LOOKUP, 2, 4, 4, 0, 0.1)
    both = {DRAFT: ("", 4, 0.0), LOOKUP: (2, 4, 0.0)}
    assert all(c.rate(m, s, k) < c.rate("plain", None, 0) for m, (s, _, _) in both.items() for k in range(1, 5))
    picks = [c.choose(both, remaining=100) for _ in range(14)]
    # one-token probes after 4, then 8 plain steps; the drafter that drafted least recently first
    assert picks[:5] == [("plain", 0)] * 4 + [(DRAFT, 1)]
    assert picks[5:14] == [("plain", 0)] * 8 + [(LOOKUP, 1)]


def test_no_probe_where_catching_up_costs_too_much():
    c = MethodChooser([DRAFT], 4, PASS, draft_ms={DRAFT: 19.0})
    for _ in range(10):
        c.update(DRAFT, "", 2, 2, 0, 2 * 19.0)
    # the draft model is 500 tokens behind (a long prompt it never prefilled): 40 tokens to go
    far = {DRAFT: ("", 4, 500.0)}
    assert [c.choose(far, remaining=40) for _ in range(20)] == [("plain", 0)] * 20
    near = {DRAFT: ("", 4, 5.0)}  # nearly caught up: probed again
    assert (DRAFT, 1) in [c.choose(near, remaining=40) for _ in range(40)]


def test_greedy_identity_in_a_batch_of_auto_sequences(tiny, monkeypatch):
    """Several sequences with auto drafters in one engine: those that chose the draft model
    draft together; every output is its plain decoding."""
    dtype = EXACT_MODES[-1]
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    switching(monkeypatch, 3)
    cfg = GenerationConfig(max_new_tokens=20, k=3, ignore_eos=True, adaptive_k=False)
    ids = [target.tokenizer.encode(p) for p in PROMPTS]
    eng = Engine(target.model, target.tokenizer)
    sids = [eng.add(i, cfg, SamplingParams(), AutoDrafter(target.model, draft.model)) for i in ids]
    while eng.has_work():
        eng.step()
    for sid, i in zip(sids, ids, strict=True):
        plain = specdec.generate(target, i, max_new_tokens=20, ignore_eos=True)
        assert eng.result(sid).token_ids == plain.token_ids


def test_the_real_chooser_is_exact_and_reports(tiny):
    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])
    plain = specdec.generate(target, PROMPTS[0], max_new_tokens=30, ignore_eos=True)
    out = specdec.generate(
        target,
        PROMPTS[0],
        drafter="auto",
        assistant_model=draft,
        k=4,
        max_new_tokens=30,
        ignore_eos=True,
        adaptive_k=False,
    )
    assert out.token_ids == plain.token_ids
    rep = out.metrics.drafter_info["auto"]
    assert rep["methods"] == [DRAFT, LOOKUP, SUFFIX]
    steps = sum(n for ks in rep["steps"].values() for n in ks.values())
    # one choice per step with budget for a draft (the last step, one token left, has none)
    assert out.metrics.target_forwards - 1 <= steps <= out.metrics.target_forwards
    assert rep["draft_ms_per_token"][DRAFT] > 0  # known before it drafts: its one-row pass time
    # the draft model runs only if chosen: not even its prefill otherwise
    assert (out.metrics.draft_forwards > 0) == (DRAFT in rep["steps"])
    assert out.metrics.proposed > 0


def test_auto_without_a_draft_model_uses_the_model_free_drafters(tiny):
    target = tiny("llama", dtype=EXACT_MODES[-1])
    out = specdec.generate(
        target, PROMPTS[0], drafter="auto", k=4, max_new_tokens=12, ignore_eos=True, adaptive_k=False
    )
    assert out.metrics.drafter_info["auto"]["methods"] == [LOOKUP, SUFFIX]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"methods": "lookahead"}, "auto cannot switch to 'lookahead'"),
        ({"methods": " , "}, "--auto-methods is empty"),
        ({"methods": "prompt-lookup,prompt-lookup"}, "names a drafter twice"),
        ({"methods": "draft-model"}, "auto with draft-model needs a draft model"),
    ],
)
def test_bad_method_lists_are_one_clear_error(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        AutoDrafter(tiny("llama").model, **kwargs)


def test_a_draft_model_that_auto_would_not_use_is_refused(tiny):
    with pytest.raises(ValueError, match="drop --draft or add draft-model"):
        AutoDrafter(tiny("llama").model, tiny("llama", "close").model, methods="prompt-lookup")


def test_draft_model_sync_feeds_only_what_a_proposal_would_not(tiny):
    """`sync` prefills a lazily begun draft model, then does nothing in steady decoding (a
    proposal's first forward feeds up to two committed tokens itself): no extra forward per step."""
    from specdec.drafters import DraftModelDrafter, DraftSession
    from specdec.sampling import make_generator

    draft = tiny("llama", "close").model
    d = DraftModelDrafter(draft)
    d.begin(DraftSession(list(range(1, 12)), 64, SamplingParams(), make_generator(0, draft.device), lazy=True))
    assert d.forwards == 0 and d.switch_ms() > 0  # nothing prefilled yet: catching up costs
    d.sync()
    assert d.forwards == 1 and d.cache.length == 10 and d.switch_ms() == 0.0
    d.catch_up([5])  # two tokens behind: the next proposal feeds them
    d.sync()
    assert d.forwards == 1 and d.switch_ms() == 0.0
    d.catch_up([6, 7])  # four behind: sync feeds three, the proposal the last
    assert d.switch_ms() > 0
    d.sync()
    assert d.forwards == 2 and d.cache.length == 13
    assert d.propose(2).tokens.shape[0] == 2 and d.cache.length == 15


# -- an EAGLE-3 head among auto's drafters (chains of the head's most likely or drawn tokens) --
@pytest.mark.parametrize("dtype", EXACT_MODES)
def test_greedy_identity_with_eagle3_among_the_switching_drafters(tiny, monkeypatch, dtype):
    """The head follows what prompt lookup and plain steps commit (from the target's features
    of those rows) and drafts chains of the k chosen: greedy output is plain decoding's."""
    target = tiny("qwen2", dtype=dtype)
    head = random_head(target.model, seed=2, scale=20.0)
    no_timing(monkeypatch)  # (which steps suffix decoding has a tree for must not follow the clock)
    picks = switching(monkeypatch, 4)
    accepted = 0
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
        out = specdec.generate(target, prompt, drafter="auto", head=head, k=4, max_new_tokens=24, ignore_eos=True)
        assert out.token_ids == plain.token_ids, prompt
        assert out.metrics.drafter_info["auto"]["methods"] == [EAGLE3, LOOKUP, SUFFIX]
        accepted += out.metrics.accepted
    assert {m for m, _ in picks} == {"plain", LOOKUP, SUFFIX, EAGLE3} and {k for m, k in picks if m == EAGLE3} >= {1, 4}
    assert accepted > 0


def test_auto_takes_eagle3_only_when_asked(tiny):
    target = tiny("llama").model
    assert AutoDrafter(target).methods == [LOOKUP, SUFFIX]  # the head only when asked for (none ships for it)
    assert AutoDrafter(target, head=random_head(target)).methods == [EAGLE3, LOOKUP, SUFFIX]
    with pytest.raises(ValueError, match="add eagle3 to --auto-methods"):
        AutoDrafter(target, methods=LOOKUP, head=random_head(target))
    with pytest.raises(ValueError, match="--auto-head DIR"):
        AutoDrafter(target, methods=EAGLE3)


@pytest.mark.parametrize("rule", ["exact", "rejection"])
@pytest.mark.slow
def test_sampling_law_with_eagle3_chains_switching(
    small_vocab, exact_joint, sample_joint, monkeypatch, wrong_rule, rule
):
    """The head's drawn chains, switching with prompt lookup and plain steps, keep the target's
    law; the negative control (a rejection recovered from p) must fail the same test."""
    if rule != "exact":
        wrong_rule(rule)
    target, _ = small_vocab
    no_timing(monkeypatch)
    picks = switching(monkeypatch, 5)
    sampling = SamplingParams(temperature=0.7)
    head = small_head(target)
    counts = sample_joint(
        target,
        lambda: AutoDrafter(target, methods=f"{EAGLE3},{LOOKUP}", head=head),
        sampling,
        runs=3000,
        bounds=(0.05, 0.95),
    )
    assert EAGLE3 in {m for m, _ in picks}
    p = chi2_pvalue(counts, exact_joint(target, sampling, 4))
    assert p > ALPHA if rule == "exact" else p <= ALPHA, p


def test_a_seeded_sampled_requests_choices_take_no_timing():
    """`reproducible`: the same verified steps give the same choices whatever the clock says
    (the stored table unscaled, the drafters' own cost estimates kept), so a seeded sampled
    request draws the same random numbers every time."""
    import dataclasses

    costs = dataclasses.replace(PASS)
    c = MethodChooser([LOOKUP, DRAFT], 4, costs, draft_ms={LOOKUP: 0.1, DRAFT: None}, reproducible=True)
    costs.observe(1, 10 * costs.target_ms[1], weight=1.0)  # the shared table follows a slow moment
    _feed(c, DRAFT, "", 5, 2, 2, draft_ms=500.0)  # a slow measured draft
    assert c.draft_ms == {LOOKUP: 0.1, DRAFT: 0.0} and c.costs.scale == 1.0
    assert c.choose({DRAFT: ("", 4, 0.0)})[0] == DRAFT  # as if neither had happened


# -- merged trees: suffix decoding's tree beside the chosen chain -----------------------------
def test_merge_builds_a_trie_with_each_sources_attempts():
    from specdec.drafters.auto import merge

    m = merge([5, 6, 7], True, [5, 8, 6, 9], [-1, -1, 0, 2])
    assert m.tokens == [5, 6, 7, 8, 9] and m.parents == [-1, 0, 1, -1, 1]
    assert m.chain == [0, 1, 2] and m.tree == [0, 3, 1, 4]
    # drawn first at each parent, then the fixed ones; a node both propose is tried both ways
    assert m.attempts == [(0, True), (1, True), (2, True), (0, False), (3, False), (1, False), (4, False)]
    fixed = merge([5, 6, 7], False, [5, 8, 6, 9], [-1, -1, 0, 2])  # a deterministic chain: once each
    assert fixed.attempts == [(j, False) for j in range(5)]


def _merging(monkeypatch, method: str, k: int) -> list[int]:
    """auto always chooses `method` with k drafts, and every suffix tree joins it whole; returns
    the sizes of the merged trees sent."""
    sizes: list[int] = []

    def choose(self, outlook, remaining=None, others=(0, 0.0)):
        return (method, min(k, outlook[method][1])) if method in outlook else ("plain", 0)

    real = AutoDrafter._with_suffix

    def with_suffix(self, chain):
        draft = real(self, chain)
        if self._merged is not None:
            sizes.append(len(self._merged.tokens))
        return draft

    monkeypatch.setattr(MethodChooser, "choose", choose)
    monkeypatch.setattr(AutoDrafter, "_suffix_wins", lambda self, tree_rate, chosen_rate, merged=False: False)
    monkeypatch.setattr(AutoDrafter, "_tree_nodes", lambda self, chances, depths, shared=None: len(chances))
    monkeypatch.setattr(AutoDrafter, "_with_suffix", with_suffix)
    return sizes


@pytest.mark.parametrize("dtype", EXACT_MODES)
@pytest.mark.parametrize("method", [DRAFT, LOOKUP])
def test_greedy_identity_with_merged_trees(tiny, monkeypatch, dtype, method):
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    sizes = _merging(monkeypatch, method, 3)
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
        out = specdec.generate(
            target, prompt, drafter="auto", assistant_model=draft, k=4, max_new_tokens=24, ignore_eos=True
        )
        assert out.token_ids == plain.token_ids, prompt
        assert out.metrics.drafter_info["auto"]["merged"]["steps"] > 0
    assert sizes and max(sizes) > 3  # (trees beyond the chain were sent)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["exact", "wrong-mixed-rule"])
def test_sampling_law_with_merged_trees(small_vocab, exact_joint, sample_joint, monkeypatch, wrong_rule, broken):
    """The draft model's drawn chain and suffix decoding's fixed tree in one tree, verified by
    the mixed rule: the output law is the target's; with a wrong mixed rule (negative control)
    it is not."""
    if broken:
        wrong_rule("mixed-tree")
    target, draft = small_vocab
    no_timing(monkeypatch)
    sizes = _merging(monkeypatch, DRAFT, 2)
    sampling = SamplingParams(temperature=1.0)
    counts = sample_joint(target, lambda: AutoDrafter(target, draft), sampling, runs=3000, k=3, bounds=(0.05, 0.95))
    assert len(sizes) > 1000 and max(sizes) > 2  # (most runs merged a tree)
    p = chi2_pvalue(counts, exact_joint(target, sampling, 4))
    assert (p <= ALPHA) if broken else (p > ALPHA)


def test_suffix_tree_alone_must_clearly_beat_a_chain_it_would_join():
    """Where the chosen chain is the draft model's, which takes suffix decoding's tree into its
    own step anyway, the tree alone takes the step only if it beats the chain by KEEP_MEASURED
    (the merged step keeps the tree's chances); against any other choice (prompt lookup's
    chain, a plain step, a head), any margin."""
    from specdec.adaptive import KEEP_MEASURED

    auto = AutoDrafter.__new__(AutoDrafter)
    assert auto._suffix_wins(1.05, 1.0) and not auto._suffix_wins(1.05, 1.0, merged=True)
    assert auto._suffix_wins(KEEP_MEASURED * 1.01, 1.0, merged=True)
    assert auto._suffix_wins(0.01, 0.0, merged=False)


def test_a_tree_node_the_copying_chain_proposes_already_costs_no_row():
    from specdec.drafters.auto import _depths, _on_chain

    tokens, parents = [5, 6, 7, 8, 9, 4, 3], [-1, 0, 1, 2, 3, -1, 0]
    assert _on_chain([5, 6, 7], tokens, parents, _depths(parents)) == [True, True, True, False, False, False, False]
    assert _on_chain([], tokens, parents, _depths(parents)) == [False] * 7
    assert _on_chain([5, 9], tokens, parents, _depths(parents)) == [True, False, False, False, False, False, False]
