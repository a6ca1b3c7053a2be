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


def _weights(V: int = 1700) -> torch.Tensor:
    """Unnormalised weights over several of `sample`'s blocks: zeros (a whole block of them
    too), tiny values, a heavy last token."""
    g = torch.Generator().manual_seed(5)
    w = torch.zeros(V)
    w[::3] = torch.rand(len(range(0, V, 3)), generator=g) * 2.0
    w[600:1100] = 0.0  # an empty block (BLOCK = 512) and parts of its neighbours
    w[7], w[8] = 1e-4, 3e-3
    w[V - 1] = 5.0
    return w


def _wrong_sample(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A plausible bug: an inverse CDF that assumes normalised weights (u not scaled by the total)."""
    cdf = weights.double().cumsum(-1)
    u = torch.rand(weights.shape[0], 1, generator=generator, dtype=torch.float64)
    return torch.searchsorted(cdf, u, right=True).clamp_max(weights.shape[-1] - 1).squeeze(-1)


@pytest.mark.parametrize("sampler", ["sample", "wrong"])
def test_sample_draws_the_weights_law_and_never_a_zero(sampler):
    from helpers import ALPHA, chi2_pvalue

    from specdec.sampling import sample

    w = _weights()
    n = 60_000
    draw = sample if sampler == "sample" else _wrong_sample
    got = draw(w[None].expand(n, -1).contiguous(), torch.Generator().manual_seed(11))
    counts = torch.bincount(got, minlength=w.shape[0]).numpy()
    p = chi2_pvalue(counts, (w / w.sum()).numpy())
    if sampler == "sample":
        assert got.shape == (n,) and counts[(w == 0).numpy()].sum() == 0
        assert p > ALPHA, p
    else:  # the negative control: the same test catches the bug
        assert p < ALPHA, p


def test_sample_takes_each_rows_own_weights_and_one_dimension():
    from specdec.sampling import sample

    g = torch.Generator().manual_seed(0)
    w = torch.zeros(3, 2000)
    w[0, 5], w[1, 1999], w[2, 1024] = 1.0, 0.25, 7.0  # one-hot rows in different blocks, unnormalised
    assert sample(w, g).tolist() == [5, 1999, 1024]
    one = sample(w[2], g)
    assert one.dim() == 0 and int(one) == 1024
    with pytest.raises(ValueError, match="all zero"):
        sample(torch.zeros(2, 10), g)
