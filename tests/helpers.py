"""Statistics shared by the exactness tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

ALPHA = 1e-3  # significance level of every statistical test; all runs are seeded


def chi2_pvalue(counts: dict[tuple, int] | np.ndarray, expected_probs: dict[tuple, float] | np.ndarray,
                min_expected: float = 5.0) -> float:  # fmt: skip
    """Pearson chi-square p-value of observed counts against exact probabilities. Cells with
    expected count < `min_expected` are pooled into one cell. An outcome with probability 0
    that was observed makes the p-value 0."""
    if isinstance(expected_probs, dict):
        keys = sorted(set(expected_probs) | set(counts))
        obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
        prob = np.array([expected_probs.get(k, 0.0) for k in keys], dtype=float)
    else:
        obs, prob = np.asarray(counts, dtype=float), np.asarray(expected_probs, dtype=float)
    if obs[prob <= 0].sum() > 0:
        return 0.0
    n = obs.sum()
    prob = prob / prob.sum()
    exp = prob * n
    small = exp < min_expected
    obs_cells = np.append(obs[~small], obs[small].sum())
    exp_cells = np.append(exp[~small], exp[small].sum())
    if exp_cells[-1] == 0:
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    return float(chisquare(obs_cells, exp_cells).pvalue)
