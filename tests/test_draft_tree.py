"""Draft-model token trees (`specdec.drafters.draft_tree`): a tree grown over several draft
passes attends as a chain would, the draft's cache rolls back to the accepted path, greedy
output is plain decoding's, and sampled output follows the target's law (with a wrong rule
that must fail)."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT_MODES
from helpers import ALPHA, PROMPT_IDS, PROMPTS, always_draft, chi2_pvalue, no_timing

import specdec
from specdec.config import SamplingParams
from specdec.costs import Costs
from specdec.drafters import DraftModelDrafter
from specdec.drafters.base import DraftSession, Feedback
from specdec.drafters.confidence import Calibration
from specdec.drafters.draft_tree import TreeGrowth
from specdec.model.transformer import Segment
from specdec.sampling import make_generator


def test_a_tree_fed_over_two_passes_attends_as_a_chain(tiny):
    """Rows fed in a later pass see only their ancestors among the earlier tree rows (the
    [T, S] mask), so a node's logits are those of its path fed as a chain."""
    model = tiny("llama").model
    prompt = torch.tensor(PROMPT_IDS * 3)
    cache = model.new_cache(32)
    model.forward_batch([Segment(prompt, cache, last_only=True)])
    base = prompt.shape[0] - 1  # position of the last committed token
    # pass 1: two siblings (depth 1); pass 2: a child of the second one (depth 2)
    model.forward_batch(
        [
            Segment(
                torch.tensor([5, 9]),
                cache,
                torch.tensor([base + 1, base + 1]),
                tree_mask=torch.tensor([[True, False], [False, True]]),
            )
        ]
    )
    out = model.forward_batch(
        [Segment(torch.tensor([7]), cache, torch.tensor([base + 2]), tree_mask=torch.tensor([[False, True, True]]))]
    )[0]
    chain = model.new_cache(32)
    ref = model.forward_batch([Segment(torch.cat([prompt, torch.tensor([9, 7])]), chain)])[0]
    torch.testing.assert_close(out.logits[0, -1], ref.logits[0, -1], rtol=1e-4, atol=1e-4)
    # ...and a row that saw its cousin too would differ (the mask matters)
    wrong = model.new_cache(32)
    model.forward_batch([Segment(prompt, wrong, last_only=True)])
    model.forward_batch(
        [
            Segment(
                torch.tensor([5, 9]),
                wrong,
                torch.tensor([base + 1, base + 1]),
                tree_mask=torch.tensor([[True, False], [False, True]]),
            )
        ]
    )
    leak = model.forward_batch([Segment(torch.tensor([7]), wrong, torch.tensor([base + 2]))])[0]
    assert not torch.allclose(leak.logits[0, -1], ref.logits[0, -1], rtol=1e-4, atol=1e-4)


def test_a_mask_wider_than_the_cache_is_refused(tiny):
    model = tiny("llama").model
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match=r"tree_mask must be \[T, S\]"):
        model.forward_batch([Segment(torch.tensor([1]), cache, tree_mask=torch.ones(1, 3, dtype=torch.bool))])


def _bushy(monkeypatch) -> None:
    """Trees grow whatever the prices say: two children per node, two leaves fed per pass, up to
    depth k — so the tests meet branching, cousins and rollback on tiny models (each step
    drafting, with `helpers.always_draft` the request's chooser)."""
    monkeypatch.setattr(TreeGrowth, "_pays", lambda self, gain, extra_rows, before=0.0: extra_rows <= 2)

    def to_feed(self):
        leaves = [j for j, n in enumerate(self.nodes) if n.slot is None and n.depth < self.depth_max]
        return sorted(leaves, key=lambda j: -self.nodes[j].chance)[:2]

    monkeypatch.setattr(TreeGrowth, "to_feed", to_feed)


def _fresh_rows(model, tokens: list[int], n: int) -> torch.Tensor:
    cache = model.new_cache(len(tokens) + 1)
    model.forward_batch([Segment(torch.tensor(tokens[:n]), cache, last_only=True)], head=False)
    return cache.k[:, :, :, :n]


@pytest.mark.parametrize("dtype", EXACT_MODES)
def test_greedy_identity_and_rollback_with_trees(tiny, monkeypatch, dtype):
    target, draft = tiny("llama", dtype=dtype), tiny("llama", "close", dtype=dtype)
    _bushy(monkeypatch)
    seen = {"steps": 0, "branched": 0, "checked": 0}
    original = DraftModelDrafter.accepted

    def accepted(self, feedback: Feedback) -> None:
        g = self._growth
        seen["branched"] += g is not None and len({n.parent for n in g.nodes}) < len(g.nodes)
        original(self, feedback)
        # the draft's cache now holds exactly the committed rows a fresh prefill computes
        n = self.cache.length
        assert n <= len(self._tokens) and torch.equal(self.cache.pos[0, :n], torch.arange(n))
        torch.testing.assert_close(
            self.cache.k[:, :, :, :n], _fresh_rows(self.model, self._tokens, n), rtol=1e-3, atol=1e-3
        )
        seen["checked"] += 1

    monkeypatch.setattr(DraftModelDrafter, "accepted", accepted)
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=20, ignore_eos=True)
        out = specdec.generate(
            target, prompt, assistant_model=draft, k=3, tree=1, max_new_tokens=20, ignore_eos=True, chooser=always_draft
        )
        assert out.token_ids == plain.token_ids, prompt
        assert out.metrics.scored_rows > out.metrics.target_forwards + out.metrics.proposed  # trees were verified
    assert seen["branched"] > 0 and seen["checked"] > 0


def test_the_tree_grows_only_where_it_pays():
    """By hand: a sure draft grows one branch and feeds it; a torn one branches at the root; a
    draft step that costs a whole target pass feeds nothing more; rows that cost their full
    share keep even the best child out."""
    cheap_rows = Costs({r: 30.0 + r for r in range(1, 26)})
    dear_rows = Costs({r: 30.0 * r for r in range(1, 26)})  # (every row a whole pass)

    def grow(dist: list[float], step_ms: float, costs) -> TreeGrowth:
        g = TreeGrowth(4, Calibration(), costs, lambda rows: step_ms, 10, 0, True, make_generator(0, "cpu"))
        g.add_pass(1)
        g.children(-1, torch.tensor(dist), None, None)
        return g

    sure = grow([0.97, 0.01, 0.01, 0.01], 2.0, cheap_rows)
    assert [n.token for n in sure.nodes] == [0] and sure.to_feed() == [0]
    torn = grow([0.46, 0.44, 0.05, 0.05], 2.0, cheap_rows)
    assert [n.token for n in torn.nodes] == [0, 1]  # both halves of the split, not the tail
    assert grow([0.6, 0.3, 0.05, 0.05], 30.0, cheap_rows).to_feed() == []
    assert grow([0.45, 0.45, 0.05, 0.05], 2.0, dear_rows).nodes == []


def test_tree_option_is_checked():
    with pytest.raises(ValueError, match="--draft-tree"):
        DraftModelDrafter(None, tree=3)  # type: ignore[arg-type]


def test_a_tree_proposal_is_a_draft_of_distinct_siblings(tiny, monkeypatch):
    _bushy(monkeypatch)
    model = tiny("llama", "close").model
    d = DraftModelDrafter(model, tree=1)
    d.begin(
        DraftSession(PROMPT_IDS * 2, 64, SamplingParams(temperature=1.0), make_generator(0, "cpu"), tiny("llama").model)
    )
    draft = d.propose(3)
    assert draft.parents is not None and draft.probs is not None and draft.depth() == 3
    kids: dict[int, list[int]] = {}
    for j, p in enumerate(draft.parents):
        kids.setdefault(p, []).append(int(draft.tokens[j]))
    assert all(len(set(v)) == len(v) for v in kids.values()) and max(map(len, kids.values())) == 2
    # siblings share their parent's q row, and each was drawn from it (q > 0)
    for j, p in enumerate(draft.parents):
        first = draft.parents.index(p)
        assert torch.equal(draft.probs[j], draft.probs[first]) and float(draft.probs[j, draft.tokens[j]]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["exact", "wrong-rule"])
def test_sampling_law_with_trees(small_vocab, exact_joint, sample_joint, monkeypatch, wrong_rule, broken):
    """Trees of siblings drawn without replacement keep the target's law; the negative control
    (the tree rule with a wrong recovery after a rejection) must fail the same test."""
    if broken:
        wrong_rule("sampled-tree")
    target, draft = small_vocab
    no_timing(monkeypatch)
    _bushy(monkeypatch)
    sampling = SamplingParams(temperature=1.0)
    counts = sample_joint(
        target,
        lambda: DraftModelDrafter(draft, vocab=0, tree=1),
        sampling,
        runs=3000,
        k=2,
        adaptive_k=True,
        chooser=always_draft,
    )
    p = chi2_pvalue(counts, exact_joint(target, sampling, 4))
    assert (p <= ALPHA) if broken else (p > ALPHA)
