"""Suffix decoding: candidates and their match lengths, the merged tree (counts, shares, best
first), the store's bound, pools kept apart, the cost model's sizing; greedy identity with plain
decoding (tiny models, SmolLM2), exact sampling with trees drawn from earlier outputs (with a
negative control)."""

from __future__ import annotations

import pytest
import torch
from helpers import PASS, fb

import specdec
from specdec.config import SamplingParams
from specdec.costs import Pricing
from specdec.drafters import DraftSession, SuffixDrafter
from specdec.drafters.suffix import STORE, SuffixStore, _candidates, _Doc, build_tree, situation
from specdec.memory import Memory, pools_of
from specdec.offers import Estimates

FLAT = [1.0] * 64  # alpha: every depth certain (the tree's order is then its shares')


class _Target:
    """A stand-in target: what the drafter keeps for one (stores, acceptance memory) is keyed by it."""


def started(
    tokens: list[int], target=None, pool: str = "", sampling: SamplingParams | None = None, **kw
) -> SuffixDrafter:
    d = SuffixDrafter(total=kw.pop("total", 8), **kw)
    d.begin(
        DraftSession(
            list(tokens),
            1000,
            sampling or SamplingParams(),
            torch.Generator().manual_seed(0),
            target or _Target(),
            pool=pool,
            memory=pools_of(target).of(pool) if target is not None else Memory(),
        )
    )
    return d


def doc(tokens: list[int]) -> _Doc:
    d = _Doc()
    d.extend(tokens)
    return d


def test_candidates_and_match_lengths():
    text = [5, 1, 2, 3, 9, 7, 2, 3, 4, 1, 2, 3]
    cands = _candidates(doc(text), text, max_match=32)
    # the bigram (2, 3) occurred twice before the end: after "1 2 3" (match 3, followed by 9)
    # and after "7 2 3" (match 2, followed by 4); the most recent first
    assert [(c.match, c.pos, c.tokens[c.pos]) for c in cands] == [(2, 8, 4), (3, 4, 9)]
    assert _candidates(doc(text), text, max_match=2)[1].match == 2  # capped
    # no bigram: the last token alone (match 1); nothing at all: no candidate
    assert [(c.match, c.pos) for c in _candidates(doc([4, 6, 8, 6]), [4, 6, 8, 6], 32)] == [(1, 2)]
    assert _candidates(doc([1, 2, 3]), [1, 2, 3], 32) == []


def test_tree_merges_continuations_best_first():
    text = [1, 2, 7, 8, 9, 1, 2, 7, 8, 5, 1, 2, 6, 1, 2]
    cands = _candidates(doc(text), text, 32)
    tree = build_tree(cands, depth=3, cap=10, min_prob=0.0, alpha=FLAT)
    # continuations of "1 2": 7 8 9 / 7 8 5 / 6 1 2 -> 7 (2/3) then 8 (2/3), 6 (1/3), 9 and 5 (1/3 each) ...
    assert tree.tokens[:3] == [7, 8, 6] and tree.parents[:3] == [-1, 0, -1]
    assert tree.probs[:3] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert sorted(tree.tokens) == sorted([7, 8, 9, 5, 6, 1, 2])
    for j, par in enumerate(tree.parents):  # parents come first; a child's share is at most its parent's
        assert par < j and (par < 0 or tree.probs[j] <= tree.probs[par] + 1e-12)
    # min_prob drops the single continuations; cap and depth bound the tree
    assert build_tree(cands, 3, 10, 0.5, FLAT).tokens == [7, 8]
    assert len(build_tree(cands, 3, 2, 0.0, FLAT).tokens) == 2
    assert (
        max(
            specdec.Draft(torch.tensor(t.tokens), parents=t.parents).depth()
            for t in [build_tree(cands, 1, 10, 0.0, FLAT)]
        )
        == 1
    )
    # alpha scales each depth: a node's chance is its share times alpha at its depth
    half = build_tree(cands, 3, 10, 0.0, [1.0, 0.5, 0.25])
    assert half.probs[:2] == pytest.approx([2 / 3, 1 / 3])


def test_situations_are_match_length_buckets():
    assert [situation(m) for m in (1, 2, 3, 4, 5, 6, 8, 9, 15, 16, 40)] == [1, 2, 3, 4, 4, 6, 6, 9, 9, 16, 16]


def test_store_is_bounded_oldest_request_first():
    store = SuffixStore(max_tokens=10)
    store.add([1, 2, 3, 4])
    store.add([5, 6, 7, 8])
    assert store.tokens == 8 and len(store.docs) == 2
    store.add([9, 10, 11])  # 11 > 10: the oldest goes
    assert store.tokens == 7 and [list(d.tokens) for d in store.docs.values()] == [[5, 6, 7, 8], [9, 10, 11]]
    store.add(list(range(20, 40)))  # longer than the bound: its last 10 tokens kept, alone
    assert store.tokens == 10 and [list(d.tokens) for d in store.docs.values()] == [list(range(30, 40))]
    assert store.bytes() > 0
    store.add([1])  # too short to follow anything: not kept
    assert store.tokens == 10
    none = SuffixStore(max_tokens=0)
    none.add([1, 2, 3])
    assert none.tokens == 0


def test_proposes_from_the_prompt_and_continues_after_acceptance():
    d = started([4, 1, 2, 3, 5, 6, 9, 1, 2])
    draft = d.propose(4)
    assert draft.tokens.tolist() == [3, 5, 6, 9] and draft.parents == [-1, 0, 1, 2]
    d.accepted(fb([0, 1], 6))  # kept 3 5, then the target's 6: "... 1 2 3 5 6"
    assert d.propose(2).tokens.tolist() == [9, 1]
    assert started([1, 2, 3, 4]).propose(4).tokens.numel() == 0  # nothing to follow


def test_earlier_outputs_draft_only_within_their_pool():
    target = _Target()
    a = started([7, 7, 1, 2], target, pool="a")
    a.accepted(fb([], 3))  # the output so far: 3 4 5 6 (committed by the target)
    a.accepted(fb([], 4))
    a.accepted(fb([], 5))
    a.end()  # its output joins pool a's store
    assert set(pools_of(target).pools) == {"a"}
    assert list(pools_of(target).of("a").get(STORE).docs[0].tokens) == [2, 3, 4, 5]
    assert started([9, 3, 4], target, pool="a").propose(4).tokens.tolist() == [5]
    assert started([9, 3, 4], target, pool="b").propose(4).tokens.numel() == 0  # another client's: never
    assert started([9, 3, 4], target, pool="a", max_tokens=0).propose(4).tokens.numel() == 0  # its own text only
    # a seeded sampled request does not read the store (its answer must not depend on what ran
    # before), but adds to it
    seeded = started([9, 3, 4], target, pool="a", sampling=SamplingParams(temperature=1.0, seed=3))
    assert seeded.propose(4).tokens.numel() == 0
    assert started([9, 3, 4], target, pool="a", sampling=SamplingParams(temperature=1.0)).propose(
        4
    ).tokens.tolist() == [5]


def test_cost_model_sizes_the_tree():
    target = _Target()
    pricing = Pricing(target, tables=lambda t, rows: PASS)  # rows cost 30 + 6 (r - 1) ms
    text = [4, 1, 2, 3, 5, 6, 9, 8, 7, 1, 2]
    d = SuffixDrafter(max_nodes=8)
    d.begin(DraftSession(list(text), 1000, SamplingParams(), torch.Generator().manual_seed(0), target, pricing=pricing))
    # the prior (alpha 0.6, 0.36, ...) and 6 ms a row: two nodes pay (1.96 tokens / 42 ms > 1.6 / 36)
    assert d.propose(8).tokens.tolist() == [3, 5]
    for _ in range(30):  # copies that are always accepted: deeper trees pay
        d._acc(d._situation).update(8, 8)
    assert len(d.propose(8).tokens) > 2
    for _ in range(60):  # copies that never are: plain steps
        d._acc(d._situation).update(8, 0)
    assert d.propose(8).tokens.numel() == 0


def test_bad_options_are_refused():
    for kw in ({"factor": 0}, {"min_prob": 2}, {"max_nodes": 0}, {"max_tokens": -1}, {"total": 0}):
        with pytest.raises(ValueError, match="suffix|nodes"):
            SuffixDrafter(**kw)


@pytest.mark.real
def test_greedy_identity_smollm2(smollm2_exact):
    prompts = [
        "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
        "List the numbers 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and then again 1, 2, 3,",
        "What is the capital of France?",
    ]
    accepted = 0
    for prompt in prompts * 2:  # the second round drafts from the first's outputs too
        plain = specdec.generate(smollm2_exact, prompt, max_new_tokens=48)
        for drafter in (SuffixDrafter(total=8), SuffixDrafter()):
            out = specdec.generate(smollm2_exact, prompt, drafter=drafter, max_new_tokens=48)
            assert out.token_ids == plain.token_ids, prompt
            accepted += out.metrics.accepted
    assert accepted > 0


def test_its_tree_is_offered_on_the_batchs_pass():
    """Beside the rest of a batch (6 rows committing 6 tokens) its tree's offer is the whole
    pass's: those tokens and rows with its own (priced alone, a tree looked cheap beside plain
    steps that carried the batch)."""
    d = started([4, 1, 2, 3, 5, 6, 9, 1, 2])
    est = Estimates(PASS, 8)
    alone = d.offer(4, est)
    est.step(None, (6, 6.0))
    beside = d.offer(4, est)
    assert alone is not None and beside is not None and alone.tree.tokens
    assert beside.tokens == pytest.approx(6.0 + alone.tokens)
    assert beside.ms == pytest.approx(PASS.rows(6 + len(alone.tree.tokens) + 1))
