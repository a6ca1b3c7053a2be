"""The point-mass verifier (deterministic drafts): hand-built cases, equivalence with the
general rule, and statistics with a negative control."""

from __future__ import annotations

import pytest
import torch
from helpers import ALPHA, chi2_pvalue

from specdec.drafters import point_mass
from specdec.verify import Verdict, point_mass_sample, rejection_sample


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_certain_draft_is_accepted_and_impossible_draft_rejected():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.2, 0.3, 0.5]]])  # [1, K+1=3, V=3]
    for seed in range(20):
        v = point_mass_sample(p, torch.tensor([[1, 1]]), gen(seed))  # p(1) = 1, then p(1) = 0
        assert int(v.num_accepted) == 1 and int(v.next_token) in (0, 2)  # never the rejected token


def test_all_accepted_draws_the_bonus_from_p_and_no_drafts_is_plain_sampling():
    p = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    v = point_mass_sample(p, torch.tensor([[0]]), gen(0))
    assert int(v.num_accepted) == 1 and int(v.next_token) == 1
    v = point_mass_sample(p[:, :1], torch.zeros(1, 0, dtype=torch.long), gen(0))
    assert int(v.num_accepted) == 0 and int(v.next_token) == 0


def test_same_draws_as_the_general_rule_with_one_hot_q():
    """With the same generator state, the verdicts equal rejection_sample's with q = one-hot."""
    g = gen(3)
    B, K, V = 64, 4, 7
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 1.5, -1)
    drafts = torch.where(
        torch.rand(B, K, generator=g) < 0.8, p[:, :K].argmax(-1), torch.randint(0, V, (B, K), generator=g)
    )
    a = point_mass_sample(p, drafts, gen(9))
    b = rejection_sample(p, point_mass(drafts, V), drafts, gen(9))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
    assert 0 < int((a.num_accepted == K).sum()) < B and int((a.num_accepted == 0).sum()) > 0  # all outcomes


def recover_without_removing(p, draft_tokens, generator) -> Verdict:
    """A deliberately wrong rule: correct acceptance, but the recovered token is drawn from p
    itself instead of p with the rejected draft removed."""
    v = point_mass_sample(p, draft_tokens, generator)
    B, K = draft_tokens.shape
    idx = v.num_accepted[:, None, None].expand(B, 1, p.shape[-1])
    fresh = torch.multinomial(p.gather(1, idx).squeeze(1), 1, generator=generator).squeeze(-1)
    return Verdict(v.num_accepted, torch.where(v.num_accepted < K, fresh, v.next_token))


def first_token_counts(rule, p: torch.Tensor, draft: int, n: int, seed: int) -> torch.Tensor:
    V = p.numel()
    P = p.expand(n, 2, V).clone()
    drafts = torch.full((n, 1), draft)
    v = rule(P, drafts, gen(seed))
    first = torch.where(v.num_accepted > 0, drafts[:, 0], v.next_token)
    return torch.bincount(first, minlength=V)


@pytest.mark.parametrize("seed", range(8))
def test_committed_token_follows_p(seed):
    g = gen(seed)
    p = torch.softmax(torch.randn(6, generator=g) * 2, -1)
    p[seed % 6] = 0.0  # sometimes the draft itself is impossible
    p = p / p.sum()
    counts = first_token_counts(
        point_mass_sample, p, draft=int(torch.randint(0, 6, (1,), generator=g)), n=20_000, seed=50 + seed
    )
    assert chi2_pvalue(counts.double().numpy(), p.double().numpy()) > ALPHA


def test_wrong_rule_fails_the_same_test():
    failures = 0
    for seed in range(8):
        g = gen(seed)
        p = torch.softmax(torch.randn(6, generator=g) * 2, -1)
        draft = int(p.argmax())  # a likely draft: the wrong rule then over-weights it
        counts = first_token_counts(recover_without_removing, p, draft, n=20_000, seed=50 + seed)
        failures += chi2_pvalue(counts.double().numpy(), p.double().numpy()) <= ALPHA
    assert failures >= 7, f"the negative control failed only {failures}/8 times"
