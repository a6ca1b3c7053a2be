"""The draft model reading a long context through a window (its first SINK tokens and the last
`window`, at their own positions): greedy identity, the rows it feeds, what it would draft
with the window's rows alone, the sampling law (with a negative control), and the option."""

from __future__ import annotations

import pytest
import torch
from helpers import ALPHA, WholeDraftQ, chi2_pvalue

import specdec
from specdec.config import SamplingParams
from specdec.drafters import DraftModelDrafter, make_drafter
from specdec.drafters.draft_model import SINK
from specdec.model.transformer import Segment

LONG = "The quick brown fox jumps over the lazy dog. " * 6 + "Then the fox"


@pytest.mark.parametrize("window", [0, 8, 40])
def test_greedy_identity_through_a_window(tiny, window):
    target, draft = tiny("llama"), tiny("llama", "close")
    plain = specdec.generate(target, LONG, max_new_tokens=24, ignore_eos=True)
    d = DraftModelDrafter(draft.model, vocab=0, window=window)
    out = specdec.generate(target, LONG, drafter=d, k=3, max_new_tokens=24, ignore_eos=True, adaptive_k=False)
    assert out.token_ids == plain.token_ids and out.metrics.proposed > 0
    n_prompt = out.metrics.prompt_tokens
    assert d.skip == (n_prompt - SINK - window if window else 0) and d.skip > 0 or window == 0


def test_the_window_feeds_its_rows_at_their_positions(tiny):
    """A proposal from the windowed cache is what the draft computes over the window's rows
    alone, placed at their positions; a whole-context draft proposes from all the rows."""
    draft = tiny("llama", "close").model
    ctx = list(range(40, 100))  # 60 committed tokens
    d = DraftModelDrafter(draft, vocab=0, window=10)
    d.begin(_session(ctx))
    got = d.propose(3).tokens.tolist()
    assert (
        d.skip == 60 - 1 - SINK - 10 and d.cache.length == SINK + 10 + 3
    )  # (the prompt's last token came with the proposal)
    cache = draft.new_cache(64)
    rows = ctx[:SINK] + ctx[SINK + d.skip :]
    pos = torch.tensor(list(range(SINK)) + list(range(SINK + d.skip, 60)))
    out = draft.forward_batch([Segment(torch.tensor(rows), cache, pos, last_only=True)])[0]
    want = [int(out.logits[0, -1].argmax())]
    for j in range(2):
        out = draft.forward_batch([Segment(torch.tensor([want[-1]]), cache, torch.tensor([60 + j]), last_only=True)])[0]
        want.append(int(out.logits[0, -1].argmax()))
    assert got == want


def _session(ctx):
    from specdec.drafters import DraftSession
    from specdec.sampling import make_generator

    return DraftSession(list(ctx), len(ctx) + 16, SamplingParams(), make_generator(0, "cpu"))


LONG_IDS = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # 10 tokens over the 8-token vocabulary: a window of 2 skips 4


@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.3, top_k=6)], ids=["T1", "T1.3-topk"]
)
@pytest.mark.slow
def test_a_windowed_draft_keeps_the_target_sampling_law(small_vocab, exact_joint, sample_joint, sampling):
    target, draft = small_vocab
    counts = sample_joint(
        target, lambda: DraftModelDrafter(draft, vocab=0, window=2), sampling, runs=3000, prompt=LONG_IDS
    )
    expected = exact_joint(target, sampling, 4, prompt=LONG_IDS)
    assert set(counts) - set(expected) == set()
    assert chi2_pvalue(counts, expected) > ALPHA


@pytest.mark.slow
def test_verifier_given_the_whole_context_q_fails(small_vocab, exact_joint, sample_joint):
    target, draft = small_vocab
    sampling = SamplingParams(temperature=1.0)
    # (600 runs: a wrong q this far off fails by many orders of magnitude; the law test keeps 3,000)
    counts = sample_joint(target, lambda: WholeDraftQ(draft, vocab=0, window=2), sampling, runs=600, prompt=LONG_IDS)
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4, prompt=LONG_IDS)) <= ALPHA


def test_the_window_option(tiny):
    draft = tiny("llama", "close").model
    assert make_drafter("draft-model", draft=draft, window=64).window == 64
    with pytest.raises(ValueError, match="draft window must be a whole number"):
        DraftModelDrafter(draft, window=-1)
