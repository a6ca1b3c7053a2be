"""Token-tree verification: hand-built greedy cases, tree checks, and the sampling law of
`tree_point_mass_sample` against exact probabilities (with a wrong rule as negative control)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import ALPHA, chi2_pvalue

from specdec import verify
from specdec.certify import broken_tree_recovery_sample, broken_tree_rejection_sample
from specdec.verify import TreeVerdict, tree_greedy_verify, tree_point_mass_sample


def one_hot_logits(choices: list[int], V: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(choices), V)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


# tree: root -> 3 (node 0) -> 4 (node 2); root -> 1 (node 1) -> 2 (node 3) -> 5 (node 4)
TOKENS = [3, 1, 4, 2, 5]
PARENTS = [-1, -1, 0, 1, 3]


def test_greedy_walks_the_matching_branch():
    # rows: root, n0, n1, n2, n3, n4 ; target argmax at each
    assert tree_greedy_verify(one_hot_logits([1, 0, 2, 0, 5, 0]), TOKENS, PARENTS) == TreeVerdict([1, 3, 4], 0)
    assert tree_greedy_verify(one_hot_logits([3, 4, 0, 1, 0, 0]), TOKENS, PARENTS) == TreeVerdict([0, 2], 1)
    assert tree_greedy_verify(one_hot_logits([0, 4, 2, 0, 0, 0]), TOKENS, PARENTS) == TreeVerdict([], 0)
    assert tree_greedy_verify(one_hot_logits([3]), [], []) == TreeVerdict([], 3)


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parents must come before"):
        tree_greedy_verify(one_hot_logits([0, 0, 0]), [1, 2], [1, -1])
    with pytest.raises(ValueError, match="repeats a sibling"):
        tree_greedy_verify(one_hot_logits([0, 0, 0]), [1, 1], [-1, -1])


def fixed_p(V: int = 5, rows: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(rows, V, generator=g), -1)  # [rows, V]


# V = 5 tree: root children 3 (n0), 1 (n1), 4 (n2); n0 -> 2 (n3), n0 -> 0 (n4)
S_TOKENS = [3, 1, 4, 2, 0]
S_PARENTS = [-1, -1, -1, 0, 0]


def exact_two_tokens(p: torch.Tensor) -> dict[tuple, float]:
    """P(first two output tokens) where the second is determined by this tree's rows: the first
    token is drawn from p[0]; after a child c its row is p[c + 1]; after a non-child the
    second token is whatever comes next (marked -1)."""
    rows = {S_TOKENS[j]: j + 1 for j, par in enumerate(S_PARENTS) if par == -1}
    out: dict[tuple, float] = {}
    for a in range(p.shape[1]):
        if a in rows:
            for b in range(p.shape[1]):
                out[(a, b)] = float(p[0, a] * p[rows[a], b])
        else:
            out[(a, -1)] = float(p[0, a])
    return out


def draw_two_tokens(rule, p: torch.Tensor, runs: int) -> Counter:
    g = torch.Generator().manual_seed(1)
    counts: Counter = Counter()
    for _ in range(runs):
        tv = rule(p, S_TOKENS, S_PARENTS, g)
        seq = [S_TOKENS[j] for j in tv.path] + [tv.next_token]
        first = seq[0]
        counts[(first, seq[1] if len(seq) > 1 else -1)] += 1
    return counts


@pytest.mark.slow
def test_tree_sampling_law():
    p = fixed_p()
    counts = draw_two_tokens(tree_point_mass_sample, p, runs=20000)
    assert chi2_pvalue(counts, exact_two_tokens(p)) > ALPHA
    # every kind of event happened: first child, a later sibling, depth 2, no child
    firsts = Counter(k[0] for k in counts.elements())
    assert all(firsts[t] > 0 for t in (3, 1, 4)) and sum(v for k, v in counts.items() if k[1] == -1) > 0


@pytest.mark.slow
def test_wrong_tree_rule_fails():
    """Negative control: trying each sibling with the original p(x) (not renormalised after
    earlier rejections) under-samples later siblings."""

    def unrenormalised(p, tokens, parents, generator):
        kids = verify._children(parents, tokens)
        path, row = [], 0
        while True:
            for c in kids.get(row, []):
                if float(torch.rand(1, generator=generator)) < float(p[row, tokens[c]]):
                    path.append(c)
                    row = c + 1
                    break
            else:
                r = p[row].clone()
                for c in kids.get(row, []):
                    r[tokens[c]] = 0
                return TreeVerdict(path, int(torch.multinomial(r, 1, generator=generator)))

    p = fixed_p()
    counts = draw_two_tokens(unrenormalised, p, runs=20000)
    assert chi2_pvalue(counts, exact_two_tokens(p)) <= ALPHA


@pytest.mark.slow
def test_chain_tree_matches_point_mass_law():
    """A one-child-per-node tree is a chain: same law as `point_mass_sample` (first token)."""
    p = fixed_p(rows=3)
    g = torch.Generator().manual_seed(2)
    counts: Counter = Counter()
    for _ in range(20000):
        tv = tree_point_mass_sample(p, [2, 4], [-1, 0], g)
        counts[([2, 4][0] if tv.path else tv.next_token,)] += 1
    assert chi2_pvalue(counts, {(t,): float(p[0, t]) for t in range(5)}) > ALPHA


# -- sampled trees: siblings drawn from q without replacement ------------------------------
V_TREE = 6


def _dist(g: torch.Generator, sharp: float) -> torch.Tensor:
    return torch.softmax(sharp * torch.randn(V_TREE, generator=g), -1)


def _sampled_tree_setup():
    g = torch.Generator().manual_seed(7)
    p0, q0 = _dist(g, 1.5), _dist(g, 1.5)
    p1 = torch.stack([_dist(g, 1.5) for _ in range(V_TREE)])  # second token's law after each first
    q1 = torch.stack([_dist(g, 1.5) for _ in range(V_TREE)])
    return p0, q0, p1, q1


def _draw_without_replacement(q: torch.Tensor, m: int, g: torch.Generator) -> list[int]:
    s, out = q.clone(), []
    for _ in range(m):
        x = int(torch.multinomial(s / s.sum(), 1, generator=g))
        out.append(x)
        s[x] = 0.0
    return out


def sampled_tree_two_tokens(rule, runs: int) -> Counter:
    """Each run drafts a fresh tree — 3 root children drawn from q0 without replacement, one
    grandchild under each of the first two drawn from q1[child] — verifies it with `rule`, and
    records the first two tokens (a second token the step did not reach is drawn from p1, as
    the next step would)."""
    p0, q0, p1, q1 = _sampled_tree_setup()
    g = torch.Generator().manual_seed(3)
    counts: Counter = Counter()
    for _ in range(runs):
        xs = _draw_without_replacement(q0, 3, g)
        ys = [int(torch.multinomial(q1[x], 1, generator=g)) for x in xs[:2]]
        tokens, parents = xs + ys, [-1, -1, -1, 0, 1]
        q = torch.stack([q0, q0, q0, q1[xs[0]], q1[xs[1]]])  # [K, V]
        p = torch.stack([p0, p1[xs[0]], p1[xs[1]], p1[xs[2]], p0, p0])  # [K+1, V]; leaf rows unused
        tv = rule(p, q, tokens, parents, g)
        seq = [tokens[j] for j in tv.path] + [tv.next_token]
        t2 = seq[1] if len(seq) > 1 else int(torch.multinomial(p1[seq[0]], 1, generator=g))
        counts[(seq[0], t2)] += 1
    return counts


def _exact_sampled_tree() -> dict[tuple, float]:
    p0, _, p1, _ = _sampled_tree_setup()
    return {(a, b): float(p0[a] * p1[a, b]) for a in range(V_TREE) for b in range(V_TREE)}


@pytest.mark.slow
def test_sampled_tree_law():
    counts = sampled_tree_two_tokens(verify.tree_rejection_sample, runs=20000)
    assert chi2_pvalue(counts, _exact_sampled_tree()) > ALPHA


@pytest.mark.slow
def test_sampled_tree_rule_that_keeps_rejected_drafts_fails():
    """Negative control: the rule for drafts drawn *with* replacement (s is not updated after
    a rejection, so a rejected child's mass stays in the proposal) is wrong here."""

    counts = sampled_tree_two_tokens(broken_tree_rejection_sample, runs=20000)
    assert chi2_pvalue(counts, _exact_sampled_tree()) <= ALPHA


@pytest.mark.slow
def test_sampled_tree_rule_that_recovers_from_p_fails():
    """Negative control (`specdec certify`'s): children tested right, but the token after an
    all-rejected node drawn from p instead of the residual."""
    counts = sampled_tree_two_tokens(broken_tree_recovery_sample, runs=20000)
    assert chi2_pvalue(counts, _exact_sampled_tree()) <= ALPHA


@pytest.mark.slow
def test_sampled_tree_with_one_child_per_node_is_rejection_sampling():
    """A chain drawn from q: the same law of the first token as `rejection_sample`."""
    p0, q0, p1, q1 = _sampled_tree_setup()
    g = torch.Generator().manual_seed(4)
    counts: Counter = Counter()
    for _ in range(20000):
        x = int(torch.multinomial(q0, 1, generator=g))
        tv = verify.tree_rejection_sample(torch.stack([p0, p1[x]]), q0[None], [x], [-1], g)
        counts[([x][0] if tv.path else tv.next_token,)] += 1
    assert chi2_pvalue(counts, {(t,): float(p0[t]) for t in range(V_TREE)}) > ALPHA


# -- mixed trees: drafts drawn from q beside deterministic ones ------------------------------
def _mixed_setup():
    g = torch.Generator().manual_seed(11)
    p0 = _dist(g, 1.5)
    q0 = torch.softmax(torch.tensor([0.0, 0.5, 0.0, 2.0, 0.0, 0.3]), -1)  # often draws 3, a fixed draft's token
    p1 = torch.stack([_dist(g, 1.5) for _ in range(V_TREE)])
    q1 = torch.stack([_dist(g, 1.5) for _ in range(V_TREE)])
    return p0, q0, p1, q1


def mixed_tree_two_tokens(rule, runs: int) -> Counter:
    """Each run: at the root, the fixed drafts 3 then 1 (prompt lookup's, suffix decoding's)
    and the draft model's token y drawn from q0, tried in the order 3, y, 1 (y may be 3 or 1
    itself: then its node is tried twice); under 3 the fixed draft 2, under y the draft model's
    next token z drawn from q1[y]. The first two tokens are recorded (a second token the step
    did not reach is drawn from p1, as the next step would)."""
    p0, q0, p1, q1 = _mixed_setup()
    g = torch.Generator().manual_seed(5)
    counts: Counter = Counter()
    for _ in range(runs):
        y = int(torch.multinomial(q0, 1, generator=g))
        z = int(torch.multinomial(q1[y], 1, generator=g))
        tokens, parents, attempts = [3, 1], [-1, -1], [(0, False)]
        node_y = {3: 0, 1: 1}.get(y)
        if node_y is None:
            tokens.append(y)
            parents.append(-1)
            node_y = 2
        attempts += [(node_y, True), (1, False)]
        tokens.append(2)  # under 3 (fixed)
        parents.append(0)
        attempts.append((len(tokens) - 1, False))
        if not (node_y == 0 and z == 2):  # under y (drawn); merged with the fixed 2 when it is the same
            tokens.append(z)
            parents.append(node_y)
            attempts.append((len(tokens) - 1, True))
            node_z = len(tokens) - 1
        else:
            node_z = len(tokens) - 1
            attempts.append((node_z, True))
        q = torch.zeros(len(tokens), V_TREE)
        q[node_y], q[node_z] = q0, q1[y]
        p = torch.stack([p0, *(p1[t] for t in tokens)])  # [K+1, V]: row j + 1 after node j
        tv = rule(p, q, tokens, parents, attempts, g)
        seq = [tokens[j] for j in tv.path] + [tv.next_token]
        t2 = seq[1] if len(seq) > 1 else int(torch.multinomial(p1[seq[0]], 1, generator=g))
        counts[(seq[0], t2)] += 1
    return counts


def _exact_mixed_tree() -> dict[tuple, float]:
    p0, _, p1, _ = _mixed_setup()
    return {(a, b): float(p0[a] * p1[a, b]) for a in range(V_TREE) for b in range(V_TREE)}


@pytest.mark.slow
def test_mixed_tree_law():
    counts = mixed_tree_two_tokens(verify.tree_mixed_sample, runs=20000)
    assert chi2_pvalue(counts, _exact_mixed_tree()) > ALPHA


@pytest.mark.slow
def test_mixed_tree_rule_that_recovers_from_p_fails():
    """Negative control (`specdec certify`'s): attempts tested right, the token after an
    all-rejected node drawn from p instead of the residual."""
    from specdec.certify import broken_tree_mixed_sample

    counts = mixed_tree_two_tokens(broken_tree_mixed_sample, runs=20000)
    assert chi2_pvalue(counts, _exact_mixed_tree()) <= ALPHA


@pytest.mark.slow
def test_mixed_tree_rule_that_drops_a_repeated_node_fails():
    """Negative control for the docstring's warning: when the draft model drew a token a fixed
    draft had proposed, skipping its attempt (the node was tried already) drops the residual
    update that attempt owes — which siblings are tried then depends on the draw."""

    def dedupe(p, q, tokens, parents, attempts, generator):
        kept, tried = [], set()
        for j, drawn in attempts:
            if j not in tried:
                kept.append((j, drawn))
            tried.add(j)
        return verify.tree_mixed_sample(p, q, tokens, parents, kept, generator)

    counts = mixed_tree_two_tokens(dedupe, runs=20000)
    assert chi2_pvalue(counts, _exact_mixed_tree()) <= ALPHA


def test_mixed_tree_checks_its_attempts():
    p, q = fixed_p(V=6, rows=3), torch.zeros(2, 6)
    with pytest.raises(ValueError, match="needs an attempt"):
        verify.tree_mixed_sample(p, q, [1, 2], [-1, -1], [(0, False)], torch.Generator())
    with pytest.raises(ValueError, match="repeats one"):
        verify.tree_mixed_sample(p, q, [1, 2], [-1, -1], [(0, False), (1, False), (0, False)], torch.Generator())
    # fixed drafts only: the law of `tree_point_mass_sample` (the same draws, the same verdicts)
    a = verify.tree_mixed_sample(p, q, [1, 2], [-1, 0], [(0, False), (1, False)], torch.Generator().manual_seed(3))
    b = tree_point_mass_sample(p, [1, 2], [-1, 0], torch.Generator().manual_seed(3))
    assert a == b
