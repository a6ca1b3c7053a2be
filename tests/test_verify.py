"""Verifiers: hand-built cases and statistics (with negative controls)."""

from __future__ import annotations

import pytest
import torch
from helpers import ALPHA, chi2_pvalue

from specdec.verify import Verdict, greedy_verify, rejection_sample


def onehot_logits(tokens: list[int], V: int = 6) -> torch.Tensor:
    x = torch.full((1, len(tokens), V), -10.0)
    x[0, torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return x


class TestGreedy:
    def test_all_accepted_gives_bonus(self):
        v = greedy_verify(onehot_logits([1, 2, 3, 4]), torch.tensor([[1, 2, 3]]))
        assert (int(v.num_accepted), int(v.next_token)) == (3, 4)

    def test_first_mismatch_gives_target_token(self):
        v = greedy_verify(onehot_logits([1, 5, 3, 4]), torch.tensor([[1, 2, 3]]))
        assert (int(v.num_accepted), int(v.next_token)) == (1, 5)

    def test_later_matches_after_mismatch_do_not_count(self):
        v = greedy_verify(onehot_logits([0, 2, 3]), torch.tensor([[1, 2]]))
        assert (int(v.num_accepted), int(v.next_token)) == (0, 0)

    def test_zero_drafts(self):
        v = greedy_verify(onehot_logits([4]), torch.zeros(1, 0, dtype=torch.long))
        assert (int(v.num_accepted), int(v.next_token)) == (0, 4)

    def test_batched_rows_are_independent(self):
        logits = torch.cat([onehot_logits([1, 2, 3]), onehot_logits([1, 0, 3])])
        v = greedy_verify(logits, torch.tensor([[1, 2], [1, 2]]))
        assert v.num_accepted.tolist() == [2, 1] and v.next_token.tolist() == [3, 0]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class TestRejectionHandBuilt:
    def test_identical_distributions_always_accept(self):
        p = torch.tensor([[[0.2, 0.3, 0.5]] * 3])
        for seed in range(50):
            v = rejection_sample(p, p[:, :2], torch.tensor([[0, 1]]), gen(seed))
            assert int(v.num_accepted) == 2

    def test_draft_with_zero_target_probability_is_rejected(self):
        p = torch.tensor([[[0.0, 0.5, 0.5], [1 / 3] * 3]])
        q = torch.tensor([[[1.0, 0.0, 0.0]]])
        for seed in range(50):
            v = rejection_sample(p, q, torch.tensor([[0]]), gen(seed))
            assert int(v.num_accepted) == 0 and int(v.next_token) in (1, 2)

    def test_recovered_token_comes_from_residual(self):
        # p - q is positive only at token 2: every recovered token must be 2.
        p = torch.tensor([[[0.5, 0.0, 0.5], [1 / 3] * 3]])
        q = torch.tensor([[[1.0, 0.0, 0.0]]])
        seen_reject = False
        for seed in range(100):
            v = rejection_sample(p, q, torch.tensor([[0]]), gen(seed))
            if int(v.num_accepted) == 0:
                seen_reject = True
                assert int(v.next_token) == 2
        assert seen_reject

    def test_draft_vocab_larger_than_target(self):
        p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])
        q = torch.tensor([[[0.0, 0.0, 1.0]]])  # draft proposes an id the target does not have
        for seed in range(20):
            v = rejection_sample(p, q, torch.tensor([[2]]), gen(seed))
            assert int(v.num_accepted) == 0 and int(v.next_token) in (0, 1)


# -- statistics -------------------------------------------------------------------------
def random_pair(V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (p, q) pair with zeros in q where p > 0 and zeros in p where q > 0."""
    g = gen(seed)
    p = torch.rand(V, generator=g) ** 2
    q = torch.rand(V, generator=g) ** 2
    p[0], q[1] = 0.0, 0.0  # q covers a token p forbids; p has a token q never drafts
    return p / p.sum(), q / q.sum()


def draw_first_token(rule, p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Counts of the first committed token when drafting one token from q; K = 1."""
    V = p.numel()
    g = gen(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)  # [n]
    P = p.expand(n, 2, V).clone()  # [n, K+1, V]
    Q = q.expand(n, 1, V).clone()  # [n, K, V]
    v = rule(P, Q, drafts[:, None], g)
    first = torch.where(v.num_accepted > 0, drafts, v.next_token)
    return torch.bincount(first, minlength=V)


def always_accept(p, q, draft_tokens, generator) -> Verdict:
    """A deliberately wrong rule: every draft passes (output follows q, not p)."""
    B, K = draft_tokens.shape
    bonus = torch.multinomial(p[:, K], 1, generator=generator).squeeze(-1)
    return Verdict(torch.full((B,), K), bonus)


def resample_from_p(p, q, draft_tokens, generator) -> Verdict:
    """A subtler wrong rule: correct acceptance test but recovers from p instead of max(0, p - q)."""
    v = rejection_sample(p, q, draft_tokens, generator)
    B, K = draft_tokens.shape
    idx = v.num_accepted[:, None, None].expand(B, 1, p.shape[-1])
    fresh = torch.multinomial(p.gather(1, idx).squeeze(1), 1, generator=generator).squeeze(-1)
    return Verdict(v.num_accepted, torch.where(v.num_accepted < K, fresh, v.next_token))


def pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    return chi2_pvalue(counts.double().numpy(), p.double().numpy())


@pytest.mark.parametrize("seed", range(12))
def test_rejection_sampler_matches_target(seed):
    p, q = random_pair(V=6, seed=seed)
    counts = draw_first_token(rejection_sample, p, q, n=20_000, seed=100 + seed)
    assert pvalue(counts, p) > ALPHA


@pytest.mark.parametrize("wrong_rule", [always_accept, resample_from_p])
def test_wrong_rules_fail_the_same_test(wrong_rule):
    failures = 0
    for seed in range(12):
        p, q = random_pair(V=6, seed=seed)
        counts = draw_first_token(wrong_rule, p, q, n=20_000, seed=100 + seed)
        failures += pvalue(counts, p) <= ALPHA
    assert failures >= 10, f"the negative control failed only {failures}/12 times"


def test_multi_position_chain_matches_target():
    """K = 3 drafts from position-dependent q; every committed position follows its p."""
    V, K, n = 5, 3, 20_000
    g = gen(7)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(K, V, generator=g) * 2, -1)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(K)], 1)
    v = rejection_sample(p.expand(n, K + 1, V), q.expand(n, K, V), drafts, g)
    # The token at position j exists when at least j drafts passed; given that, it must follow
    # p[j] (context-independent here, so the conditional equals the marginal).
    for j in range(K + 1):
        has = v.num_accepted >= j
        tok = (
            torch.where(v.num_accepted[has] > j, drafts[has, j] if j < K else v.next_token[has], v.next_token[has])
            if j < K
            else v.next_token[has & (v.num_accepted == K)]
        )
        assert pvalue(torch.bincount(tok, minlength=V), p[j]) > ALPHA
