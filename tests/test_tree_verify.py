"""Token-tree verification: hand-built greedy cases, tree checks, and the sampling law of
`tree_point_mass_sample` against exact probabilities (with a wrong rule as negative control)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import ALPHA, chi2_pvalue

from specdec import verify
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


def test_tree_sampling_law():
    p = fixed_p()
    counts = draw_two_tokens(tree_point_mass_sample, p, runs=20000)
    assert chi2_pvalue(counts, exact_two_tokens(p)) > ALPHA
    # every kind of event happened: first child, a later sibling, depth 2, no child
    firsts = Counter(k[0] for k in counts.elements())
    assert all(firsts[t] > 0 for t in (3, 1, 4)) and sum(v for k, v in counts.items() if k[1] == -1) > 0


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


def test_chain_tree_matches_point_mass_law():
    """A one-child-per-node tree is a chain: same law as `point_mass_sample` (first token)."""
    p = fixed_p(rows=3)
    g = torch.Generator().manual_seed(2)
    counts: Counter = Counter()
    for _ in range(20000):
        tv = tree_point_mass_sample(p, [2, 4], [-1, 0], g)
        counts[([2, 4][0] if tv.path else tv.next_token,)] += 1
    assert chi2_pvalue(counts, {(t,): float(p[0, t]) for t in range(5)}) > ALPHA
