"""The projection: real runs' passes re-priced with another target's pass table."""

from __future__ import annotations

import pytest

from specdec.bench import projection

TABLE = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0, 16: 20.0}


def _record(method: str, passes: dict[str, int], draft_s: float, tokens: int = 40, identical: bool = True) -> dict:
    return {
        "method": method,
        "category": "code",
        "temperature": 0,
        "identical": identical,
        "passes": passes,
        "draft_seconds": draft_s,
        "new_tokens": tokens,
        "plain_passes": {"1": tokens},
        "plain_new_tokens": tokens,
        "speedup": 1.3,
        "decode_speedup": 1.4,
        "acceptance_rate": 0.8,
        "steps": sum(passes.values()),
    }


def test_passes_are_priced_from_the_table_and_past_it_along_its_last_segment():
    assert projection.price(TABLE, 1) == 10.0
    assert projection.price(TABLE, 5) == 12.5
    assert projection.price(TABLE, 32) == 32.0  # 20 + 16 * (20 - 14) / 8


def test_a_run_is_priced_with_its_drafting_time_and_the_best_k_is_taken():
    k4 = {"settings": {"k": 4}, "records": [_record("draft-model", {"5": 10}, 0.1)]}  # (125 + 100) / 40 ms a token
    k8 = {"settings": {"k": 8}, "records": [_record("draft-model", {"9": 8}, 0.2)]}  # (8 * 14.75 + 200) / 40
    got = projection.project([k4, k8], TABLE)
    (row,) = got["rows"]
    assert row["k"] == 4 and row["projected_speedup"] == pytest.approx(10.0 / 5.625)
    assert got["median_over_categories"] == {"draft-model": pytest.approx(10.0 / 5.625)}
    assert "PROJECTION" in projection.table(got, "a 7B shape")


def test_runs_not_checked_identical_are_left_out():
    with pytest.raises(ValueError, match="no greedy run checked identical"):
        projection.project([{"records": [_record("suffix", {"3": 10}, 0.0, identical=False)]}], TABLE)
