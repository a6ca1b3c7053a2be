"""The prompt-file loaders on random files (hypothesis, derandomized): the benchmark's JSONL
reader returns checked prompts or raises one ValueError naming the file, never another
exception; `generate --prompt-file` reads any file or says why in one line."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.bench.suite import ROLES, load_prompts
from specdec.cli import main

FUZZ = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)
turn = st.fixed_dictionaries(
    {"role": st.sampled_from([*ROLES, "bot", ""]), "content": st.text(max_size=20) | st.integers()}
)
prompt_like = st.fixed_dictionaries(
    {
        "id": st.text(max_size=6) | st.integers(),
        "category": st.sampled_from(["chat", "code", ""]),
        "turns": st.lists(turn, max_size=3) | json_values,
    }
)
line = st.one_of(
    prompt_like.map(json.dumps),  # nearly valid prompts
    json_values.map(json.dumps),  # any JSON
    st.text(max_size=40),  # not JSON
    st.just("[" * 5000 + "]" * 5000),  # nested past the parser's recursion limit
)


@FUZZ
@given(lines=st.lists(line, max_size=6), raw=st.binary(max_size=20), use_raw=st.booleans())
@pytest.mark.slow
def test_prompt_file_loader_returns_checked_prompts_or_one_clear_error(tmp_path_factory, lines, raw, use_raw):
    path = tmp_path_factory.mktemp("p") / "prompts.jsonl"
    if use_raw:
        path.write_bytes(raw + b"\n" + "\n".join(lines).encode())
    else:
        path.write_text("\n".join(lines), encoding="utf-8")
    try:
        prompts = load_prompts(path)
    except ValueError as exc:
        assert "prompt" in str(exc) or path.name in str(exc)
        assert "\n" not in str(exc)
        return
    assert prompts and len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert isinstance(p.id, str) and p.id and isinstance(p.category, str) and p.category
        assert p.turns and p.turns[-1]["role"] == "user"
        assert all(t["role"] in ROLES and isinstance(t["content"], str) for t in p.turns)


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(min_size=1, max_size=64))
def test_generate_prompt_file_of_any_bytes_is_read_or_refused_in_one_line(tmp_path_factory, tiny_dir, raw):
    """Undecodable bytes are refused before any model loads; decodable text is a prompt (the
    tiny model then generates, or an empty prompt is refused)."""
    path = tmp_path_factory.mktemp("g") / "prompt.txt"
    path.write_bytes(raw)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        code = main(
            ["generate", "--target", str(tiny_dir("llama")), "--prompt-file", str(path), "--max-new-tokens", "2"]
        )
        assert code == 2
        return
    code = main(
        [
            "generate",
            "--target",
            str(tiny_dir("llama")),
            "--prompt-file",
            str(path),
            "--max-new-tokens",
            "2",
            "--no-chat",
        ]
    )
    assert code in (0, 2)
    assert (code == 2) == (not raw.decode("utf-8").strip())
