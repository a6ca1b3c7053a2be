"""Temperature, top-k and top-p by hand-built cases."""

from __future__ import annotations

import pytest
import torch

from specdec.config import SamplingParams
from specdec.sampling import pick, probs


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    got = probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(got, torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_k_most_likely():
    got = probs(torch.tensor([[1.0, 4.0, 2.0, 3.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (got[0, [0, 2]] == 0).all() and torch.isclose(got.sum(), torch.tensor(1.0))
    torch.testing.assert_close(got[0, [1, 3]], torch.softmax(torch.tensor([4.0, 3.0]), -1))


def test_top_p_keeps_smallest_prefix_reaching_mass():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    got = probs(p.log(), SamplingParams(temperature=1.0, top_p=0.8))
    # 0.5 < 0.8, 0.5 + 0.3 reaches 0.8: keep the first two
    torch.testing.assert_close(got, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    got = probs(p.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert (got[0, :3] > 0).all() and got[0, 3] == 0


def test_top_p_always_keeps_the_most_likely_token():
    got = probs(torch.tensor([[0.0, 5.0, 1.0]]), SamplingParams(temperature=1.0, top_p=1e-6))
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.0, 0.0]]))


def test_greedy_pick_is_argmax_and_has_no_distribution():
    logits = torch.tensor([[0.1, 0.7, 0.2]])
    assert int(pick(logits, SamplingParams(), torch.Generator().manual_seed(0))) == 1
    with pytest.raises(ValueError, match="greedy"):
        probs(logits, SamplingParams())


def test_seeded_sampling_reproduces():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    s = SamplingParams(temperature=1.0)
    a = [int(pick(logits, s, g)) for g in [torch.Generator().manual_seed(3)] for _ in range(20)]
    b = [int(pick(logits, s, g)) for g in [torch.Generator().manual_seed(3)] for _ in range(20)]
    assert a == b
