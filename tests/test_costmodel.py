"""The cost model: the expected-tokens formula on hand-built costs and acceptance."""

from __future__ import annotations

import pytest

from specdec.bench.costmodel import Acceptance, Costs, predict, recommend


def flat(ms: float = 10.0) -> Costs:
    return Costs({1: ms, 4: ms, 9: ms, 17: ms})


def iid(alpha: float, k: int, steps: int = 1000) -> Acceptance:
    # position i accepted in a fraction alpha^(i+1) of the steps; every step offers k tokens
    return Acceptance(steps, [round(steps * alpha ** (i + 1)) for i in range(k)], [steps] * k, 0.0)


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_iid_acceptance_gives_the_leviathan_formula(alpha, k):
    # free rows, free drafts: the speedup is the expected tokens per step
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert predict("prompt-lookup", k, iid(alpha, k), flat()) == pytest.approx(expected, rel=2e-3)


def test_draft_cost_and_row_cost_enter_the_denominator():
    costs = Costs({1: 10.0, 5: 20.0}, draft_ms=5.0)
    acc = iid(0.5, 4)
    tokens = 1 + 0.5 + 0.25 + 0.125 + 0.0625
    assert predict("draft-model", 4, acc, costs) == pytest.approx(tokens * 10 / (4 * 5 + 20), rel=2e-3)
    assert predict("prompt-lookup", 4, acc, costs) == pytest.approx(tokens * 10 / 20, rel=2e-3)
    assert costs.target(3) == pytest.approx(15.0) and costs.target(0.5) == 10.0 and costs.target(99) == 20.0


def test_the_runs_measured_drafting_time_is_what_a_step_pays():
    """Records that carry their drafting time per proposed token (auto's draft-model steps,
    heads' calls) are priced by it, pooled over the proposed tokens, for every method."""
    rec = {
        "steps": 10,
        "proposed": 20,
        "accepted_per_position": [8, 4],
        "proposed_per_position": [10, 10],
        "scored_rows": 30,
    }
    acc = Acceptance.pool([rec | {"draft_ms_per_token": 2.0}, rec | {"draft_ms_per_token": 4.0, "proposed": 60}])
    assert acc.draft_ms == pytest.approx((2 * 20 + 4 * 60) / 80)
    costs = Costs({1: 10.0, 3: 10.0}, draft_ms=99.0)  # (the stored step is not what these runs paid)
    assert predict("auto", 2, acc, costs) == pytest.approx((1 + 0.8 + 0.4) * 10 / (acc.draft_ms * 2 + 10))
    assert Acceptance.pool([rec]).draft_ms is None


def test_extrapolation_past_the_measured_positions_is_geometric():
    acc = iid(0.8, 2)  # measured positions: 0.8, 0.64
    A, P = acc.per_step(4)
    assert A == pytest.approx([0.8, 0.64, 0.512, 0.4096], rel=1e-3) and P == [1.0] * 4
    assert Acceptance(0, [], [], 0.0).per_step(2) == ([0.0, 0.0], [0.0, 0.0])


def test_recommend_picks_the_k_with_the_best_prediction():
    # each extra row costs 20% of a token: with alpha 0.6 the third draft no longer pays
    costs = Costs({r: 10.0 + 2.0 * (r - 1) for r in range(1, 18)})
    records = [
        {
            "steps": 1000,
            "accepted_per_position": [round(1000 * 0.6 ** (i + 1)) for i in range(8)],
            "proposed_per_position": [1000] * 8,
            "scored_rows": 9000,
            "speedup": 1.1,
        }
    ]
    rec = recommend("prompt-lookup", 0.0, "all", records, costs, k_used=8)
    by_k = {k: (1 - 0.6 ** (k + 1)) / 0.4 * 10 / (10 + 2 * k) for k in range(1, 9)}
    assert rec.best_k == max(by_k, key=by_k.get) == 2
    assert rec.by_k[3] == pytest.approx(by_k[3], rel=2e-3) and rec.measured_speedup == 1.1


@pytest.mark.parametrize(
    "ms, expected",
    [
        # one slow moment made 1 row look dearer than 2, 3 and 4 (measured like this): pooled
        ({1: 83.8, 2: 73.5, 3: 76.7, 4: 77.3, 5: 83.8}, {1: 77.825, 2: 77.825, 3: 77.825, 4: 77.825, 5: 83.8}),
        ({1: 30.0, 2: 36.0, 4: 46.0, 8: 68.0}, {1: 30.0, 2: 36.0, 4: 46.0, 8: 68.0}),  # already monotone: as is
        ({1: 2.0, 2: 1.0, 3: 3.0, 4: 2.0}, {1: 1.5, 2: 1.5, 3: 2.5, 4: 2.5}),
    ],
)
def test_pass_time_tables_are_made_monotone_in_rows(ms, expected):
    from specdec.costs import monotone

    got = monotone(ms)
    assert got == pytest.approx(expected)
    assert [got[r] for r in sorted(got)] == sorted(got.values())
