"""`--drafter auto`: the chooser's decisions from hand-set estimates, and exactness with the
drafter and k switching every step — greedy identity (one sequence and a batch), and the
sampled law (chi-square) with a wrong rule as the negative control."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import EXACT_MODES
from helpers import ALPHA, PASS, PROMPTS, Forced, Switching, chi2_pvalue, no_timing, random_head, small_head

import specdec
from specdec.config import GenerationConfig, SamplingParams
from specdec.costs import Costs, Pricing
from specdec.drafters import AutoDrafter, DraftSession
from specdec.engine import Engine

LOOKUP, DRAFT, EAGLE3, SUFFIX = "prompt-lookup", "draft-model", "eagle3", "suffix"


def _pass_rate(offer) -> float:
    return offer[2] / offer[3]


def test_every_logged_pick_follows_the_rule(tiny):
    """A real run's log: each step drafted on its merits took the best offer (or the member that
    drafted last, within the hysteresis), beating plain decoding by the margin; each plain step
    had no such offer; the members' table adds up to the steps."""
    from specdec.adaptive import HYSTERESIS, MARGIN

    target, draft = tiny("llama", dtype=EXACT_MODES[-1]), tiny("llama", "close", dtype=EXACT_MODES[-1])
    out = specdec.generate(
        target, PROMPTS[1], drafter="auto", assistant_model=draft, k=8, max_new_tokens=40, ignore_eos=True
    )
    rep = out.metrics.drafter_info["schedule"]
    log = rep["log"]
    assert log and sum(m["steps"] for m in rep["members"].values()) == len(log)
    for s in log:
        rates = [_pass_rate(o) for o in s["offers"]]
        plain = _pass_rate(s["plain"])
        if s["why"] == "best":
            assert _pass_rate(s["pick"]) * HYSTERESIS >= max(rates) and _pass_rate(s["pick"]) > MARGIN * plain
        elif s["why"] == "plain":
            assert s["pick"][0] == "plain" and all(r <= MARGIN * plain * HYSTERESIS for r in rates)
        assert "committed" in s or s is log[-1]


def test_greedy_identity_in_a_batch_of_auto_sequences(tiny):
    """Several sequences with auto drafters in one engine: those that chose the draft model
    draft together; every output is its plain decoding."""
    dtype = EXACT_MODES[-1]
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    choose = Switching(3)
    cfg = GenerationConfig(max_new_tokens=20, k=3, ignore_eos=True, adaptive_k=False)
    ids = [target.tokenizer.encode(p) for p in PROMPTS]
    eng = Engine(target.model, target.tokenizer)
    sids = [eng.add(i, cfg, SamplingParams(), AutoDrafter(target.model, draft.model), chooser=choose) for i in ids]
    while eng.has_work():
        eng.step()
    for sid, i in zip(sids, ids, strict=True):
        plain = specdec.generate(target, i, max_new_tokens=20, ignore_eos=True)
        assert eng.result(sid).token_ids == plain.token_ids
    assert {m for m, _ in choose.picks} >= {"plain", DRAFT}


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
    rep = out.metrics.drafter_info["schedule"]
    assert rep["methods"] == [DRAFT, LOOKUP, SUFFIX]
    steps = sum(n for ks in rep["steps"].values() for n in ks.values())
    # one choice per step with budget for a draft (the last step, one token left, has none)
    assert out.metrics.target_forwards - 1 <= steps <= out.metrics.target_forwards
    assert all(len(s["offers"]) >= 1 for s in rep["log"][:3])  # every member that could propose offered
    # the draft model runs only if chosen: not even its prefill otherwise
    assert (out.metrics.draft_forwards > 0) == (DRAFT in rep["steps"])
    assert out.metrics.proposed > 0


def test_auto_without_a_draft_model_uses_the_model_free_drafters(tiny):
    target = tiny("llama", dtype=EXACT_MODES[-1])
    out = specdec.generate(
        target, PROMPTS[0], drafter="auto", k=4, max_new_tokens=12, ignore_eos=True, adaptive_k=False
    )
    assert out.metrics.drafter_info["schedule"]["methods"] == [LOOKUP, SUFFIX]


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
    """`sync` prefills a draft model (`begin` defers it), then does nothing in steady decoding (a
    proposal's first forward feeds up to two committed tokens itself): no extra forward per step."""
    from specdec.drafters import DraftModelDrafter, DraftSession
    from specdec.sampling import make_generator

    draft = tiny("llama", "close").model
    d = DraftModelDrafter(draft)
    d.begin(DraftSession(list(range(1, 12)), 64, SamplingParams(), make_generator(0, draft.device)))
    assert d.forwards == 0 and d._catch_up_ms() > 0  # nothing prefilled yet: catching up costs
    d.sync()
    assert d.forwards == 1 and d.cache.length == 10 and d._catch_up_ms() == 0.0
    d.catch_up([5])  # two tokens behind: the next proposal feeds them
    d.sync()
    assert d.forwards == 1 and d._catch_up_ms() == 0.0
    d.catch_up([6, 7])  # four behind: sync feeds three, the proposal the last
    assert d._catch_up_ms() > 0
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
    choose = Switching(4)
    accepted = 0
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
        out = specdec.generate(
            target, prompt, drafter="auto", head=head, k=4, max_new_tokens=24, ignore_eos=True, chooser=choose
        )
        assert out.token_ids == plain.token_ids, prompt
        assert out.metrics.drafter_info["schedule"]["methods"] == [EAGLE3, LOOKUP, SUFFIX]
        accepted += out.metrics.accepted
    # (suffix decoding offers a tree only where its plan pays: on a random head it may not)
    picks = choose.picks
    assert {m for m, _ in picks} >= {"plain", LOOKUP, EAGLE3} and {k for m, k in picks if m == EAGLE3} >= {1, 4}
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
    choose = Switching(5)
    sampling = SamplingParams(temperature=0.7)
    head = small_head(target)
    counts = sample_joint(
        target,
        lambda: AutoDrafter(target, methods=f"{EAGLE3},{LOOKUP}", head=head),
        sampling,
        runs=3000,
        bounds=(0.05, 0.95),
        chooser=choose,
    )
    assert EAGLE3 in {m for m, _ in choose.picks}
    p = chi2_pvalue(counts, exact_joint(target, sampling, 4))
    assert p > ALPHA if rule == "exact" else p <= ALPHA, p


def test_a_seeded_sampled_requests_choices_take_no_timing():
    """`reproducible`: the same verified steps give the same offers whatever the clock says
    (the stored table unscaled, the members' own cost estimates kept), so a seeded sampled
    request draws the same random numbers every time."""
    import dataclasses

    from specdec.offers import Estimates

    costs = dataclasses.replace(PASS)
    est = Estimates(costs, 4, reproducible=True)
    before = est.chain(DRAFT, "", 4, 3.0)
    costs.observe(1, 10 * costs.target_ms[1], weight=1.0)  # the shared table follows a slow moment
    est.learn(before, 2, 2, draft_ms=500.0)  # a slow measured draft
    est2 = Estimates(dataclasses.replace(PASS), 4, reproducible=True)
    est2.learn(est2.chain(DRAFT, "", 4, 3.0), 2, 2, draft_ms=1.0)
    assert est.draft_ms == {} and est.costs.scale == 1.0
    assert est.chain(DRAFT, "", 4, 3.0) == est2.chain(DRAFT, "", 4, 3.0)  # as if neither had happened


# -- merged trees: suffix decoding's tree beside the chosen chain -----------------------------
def test_merge_builds_a_trie_with_each_sources_attempts():
    from specdec.drafters.merge import merge

    m = merge([5, 6, 7], True, [5, 8, 6, 9], [-1, -1, 0, 2])
    assert m.tokens == [5, 6, 7, 8, 9] and m.parents == [-1, 0, 1, -1, 1]
    assert m.chain == [0, 1, 2] and m.tree == [0, 3, 1, 4]
    # drawn first at each parent, then the fixed ones; a node both propose is tried both ways
    assert m.attempts == [(0, True), (1, True), (2, True), (0, False), (3, False), (1, False), (4, False)]
    fixed = merge([5, 6, 7], False, [5, 8, 6, 9], [-1, -1, 0, 2])  # a deterministic chain: once each
    assert fixed.attempts == [(j, False) for j in range(5)]


def _merging(monkeypatch, method: str, k: int):
    """The chooser (`chooser=`) that always picks `method` with k drafts; every suffix tree joins
    it whole."""

    def rule(offers, plain):
        mine = [o for o in offers if o.member == method]
        return replace(mine[0], k=min(k, mine[0].k)) if mine else plain

    monkeypatch.setattr(
        AutoDrafter, "_tree_nodes", lambda self, chain, tree, depth, shared=None: (len(tree.tokens), 1.0, 1.0)
    )
    return lambda margin: Forced(rule, margin)


@pytest.mark.parametrize("dtype", EXACT_MODES)
@pytest.mark.parametrize("method", [DRAFT, LOOKUP])
def test_greedy_identity_with_merged_trees(tiny, monkeypatch, dtype, method):
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    chooser = _merging(monkeypatch, method, 3)
    largest = 0
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
        out = specdec.generate(
            target,
            prompt,
            drafter="auto",
            assistant_model=draft,
            k=4,
            max_new_tokens=24,
            ignore_eos=True,
            chooser=chooser,
        )
        assert out.token_ids == plain.token_ids, prompt
        merged = out.metrics.drafter_info["schedule"]["merged"]
        assert merged["steps"] > 0
        largest = max(largest, merged["tree_tokens_max"])
    assert largest > 3  # (trees beyond the chain were sent)


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
    chooser = _merging(monkeypatch, DRAFT, 2)
    sampling = SamplingParams(temperature=1.0)
    made: list[AutoDrafter] = []
    counts = sample_joint(
        target,
        lambda: made.append(AutoDrafter(target, draft)) or made[-1],
        sampling,
        runs=3000,
        k=3,
        bounds=(0.05, 0.95),
        chooser=chooser,
    )
    merged = [d.info["schedule"]["merged"] for d in made]
    # (most runs merged a tree, some beyond the chain)
    assert sum(m["steps"] for m in merged) > 1000 and max(m["tree_tokens_max"] or 0 for m in merged) > 2
    p = chi2_pvalue(counts, exact_joint(target, sampling, 4))
    assert (p <= ALPHA) if broken else (p > ALPHA)


def test_a_tree_beside_a_chain_is_priced_where_the_chain_misses():
    """The merged offer: a tree node adds its chance where the chain is predicted to miss at its
    depth and costs a row; a node the chain proposes already adds nothing; beside a chain sure to
    be accepted, no tree node pays."""
    from specdec.drafters.merge import tree_beside
    from specdec.offers import Offer

    chain = Offer(LOOKUP, 2, 1.0 + 0.6 + 0.36, PASS.rows(3))  # alpha 0.6, 0.36
    n, tokens, ms = tree_beside(chain, [0.9, 0.8], [1, 2], [0.6, 0.36], PASS.rows)
    assert n == 2 and tokens == pytest.approx(chain.tokens + 0.9 * 0.4 + 0.8 * (1 - 0.36))
    assert ms == pytest.approx(PASS.rows(5))
    assert tree_beside(chain, [0.9, 0.8], [1, 2], [0.6, 0.36], PASS.rows, shared=[True, True])[0] == 0
    assert tree_beside(chain, [0.3], [1], [1.0, 1.0], PASS.rows)[0] == 0


def test_a_tree_node_the_copying_chain_proposes_already_costs_no_row():
    from specdec.drafters.merge import depths, on_chain

    tokens, parents = [5, 6, 7, 8, 9, 4, 3], [-1, 0, 1, 2, 3, -1, 0]
    assert on_chain([5, 6, 7], tokens, parents, depths(parents)) == [True, True, True, False, False, False, False]
    assert on_chain([], tokens, parents, depths(parents)) == [False] * 7
    assert on_chain([5, 9], tokens, parents, depths(parents)) == [True, False, False, False, False, False, False]


def test_the_draft_reads_the_prompt_first_only_where_the_batchs_pass_repays_it(tiny):
    """`_pays_back`, on the first step's load: alone, a draft accepted as a same-family draft
    plausibly is pays for its prefill over a long answer, which it reads at once; beside three
    sequences whose pass turns compute-bound from the fifth row, its rows do not pay, and it
    reads nothing (decided as if alone, every sequence of a batch of four paid its prefill)."""
    dtype = EXACT_MODES[-1]
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    steep = Costs({1: 30.0, 2: 31.0, 4: 33.0, 8: 80.0, 16: 160.0, 32: 320.0, 64: 640.0})

    def first_step(load: tuple[float, float]) -> AutoDrafter:
        d = AutoDrafter(target.model, draft.model, methods=DRAFT)
        session = DraftSession(
            list(range(3, 40)),
            300,
            SamplingParams(),
            torch.Generator().manual_seed(0),
            target.model,
            pricing=Pricing(target.model, tables=lambda t, rows: steep, history={}),
        )
        d.begin(session)
        d.plan(4, None, load)
        d.propose_batch([d], [4])
        return d

    alone = first_step((0, 0.0))
    assert alone._sync_ms > 0 and alone.subs[DRAFT].forwards > 0
    beside = first_step((3, 3.0))
    assert beside._sync_ms == 0 and beside.subs[DRAFT].forwards == 0
