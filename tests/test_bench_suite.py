"""The benchmark prompt suite: the bundled file is complete and well formed; a user's file
is checked line by line with errors that name the problem."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from specdec.bench.suite import CATEGORIES, INPUT_GROUNDED, load_prompts, select


def test_bundled_suite_covers_every_category():
    prompts = load_prompts()
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(CATEGORIES) and min(counts.values()) >= 10
    assert len({p.id for p in prompts}) == len(prompts)
    assert any(len(p.turns) > 1 for p in prompts if p.category == "chat")  # multi-turn
    longest = {
        c: max(sum(len(t["content"]) for t in p.turns) for p in prompts if p.category == c) for c in INPUT_GROUNDED
    }
    assert max(longest.values()) > 10_000  # a few thousand tokens


def test_select_takes_the_first_per_category():
    prompts = load_prompts()
    quick = select(prompts, per_category=2)
    assert Counter(p.category for p in quick) == {c: 2 for c in CATEGORIES}
    assert [p.id for p in select(prompts, ["math"], 3)] == ["math-01", "math-02", "math-03"]
    with pytest.raises(ValueError, match="no prompts in categories"):
        select(prompts, ["poetry"])


def write(tmp_path, *lines):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"id": "a", "category": "mine", "turns": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ('["a"]', "line 2: expected a JSON object"),
        ('{"id": "b", "turns": []}', "line 2: missing category"),
        ('{"id": "b", "category": "c", "turns": []}', "turns must be a non-empty list"),
        ('{"id": "b", "category": "c", "turns": [{"role": "bot", "content": "x"}]}', "turn 0 must be"),
        (
            '{"id": "b", "category": "c", '
            '"turns": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}',
            "the last turn must be the user's",
        ),
        (GOOD, "line 2: duplicate id 'a'"),
    ],
)
def test_bad_prompt_files_name_the_line_and_the_fix(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        load_prompts(write(tmp_path, GOOD, line))


def test_user_file_and_empty_or_missing_files(tmp_path):
    prompts = load_prompts(write(tmp_path, GOOD, "", GOOD.replace('"a"', '"b"')))
    assert [p.id for p in prompts] == ["a", "b"] and prompts[0].turns[0]["content"] == "hi"
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(write(tmp_path, ""))
    with pytest.raises(ValueError, match="cannot read the prompt file"):
        load_prompts(tmp_path / "missing.jsonl")
