"""The tool-call parser: tagged blocks, bare JSON answers, malformed output as text, forced
starts, streaming in any chunking, and the chat history's tool calls as the template reads them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.server.tools import ToolCallParser, forced_start, history_message, parse_all, template_renders_tools

NAMES = frozenset({"get_weather", "search"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_tagged_call_after_some_text():
    content, calls = parse_all("Let me look.\n" + CALL, NAMES)
    assert content == "Let me look.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_") and calls[0].to_dict()["type"] == "function"


def test_two_calls_and_no_content():
    two = CALL + "\n" + CALL.replace("get_weather", "search").replace('"city": "Paris"', '"q": "rain"')
    content, calls = parse_all(two, NAMES)
    assert content is None and [c.name for c in calls] == ["get_weather", "search"]
    assert calls[0].id != calls[1].id


def test_no_parallel_calls_keeps_the_first():  # (parallel_tool_calls: false)
    two = CALL + "\nand " + CALL.replace("get_weather", "search").replace('"city": "Paris"', '"q": "rain"')
    content, calls = parse_all("First: " + two, NAMES, most=1)
    assert content == "First: " and [c.name for c in calls] == ["get_weather"]
    bare = '[{"name": "search", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert [c.name for c in parse_all(bare, NAMES, most=1)[1]] == ["search"]
    assert [c.name for c in parse_all(bare, NAMES)[1]] == ["search", "get_weather"]
    assert parse_all("no call here", NAMES, most=1) == ("no call here", [])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # broken JSON
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not an offered tool
        '<tool_call>\n["get_weather"]\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "get_weather", "arguments": 3}\n</tool_call>',  # arguments not an object
        '{"name": "get_weather", "arguments": {"city": "Paris"}} and then some prose',
        "```python\nprint('hi')\n```",  # a code answer: held, then text
    ],
)
def test_malformed_or_foreign_output_is_text(text):
    assert parse_all(text, NAMES) == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments as a JSON string
    ],
)
def test_a_bare_json_answer_naming_a_tool_is_a_call(text):
    content, calls = parse_all(text, NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_a_code_answer_streams_as_it_comes_while_a_json_one_is_held():
    """An agent's answer in a ```python fence cannot be a bare call: it goes out as it is made,
    not all at the end (as it did while any fenced answer was held)."""
    parser = ToolCallParser(NAMES)
    assert parser.feed("``") == [] and parser.feed("`py") != []  # (one can tell by the fence's language)
    assert "".join(v for _, v in parser.feed("thon\ndef f():\n")) == "thon\ndef f():\n"
    held = ToolCallParser(NAMES)
    assert held.feed("```js") == [] and held.feed("on\n") == [] and held.feed('{"name": "search", ') == []
    assert held.feed('"arguments": {}}\n```') == [] and [c.name for _, c in held.finish()] == ["search"]
    fenced = ToolCallParser(NAMES)  # a fence of JSON that is not an object or list: text, at once
    assert fenced.feed("```json\n") == [] and fenced.feed("42\n```") != []


def test_an_unclosed_block_at_the_end_is_a_call_when_its_json_is_whole():
    assert parse_all(CALL.removesuffix("</tool_call>"), NAMES)[1][0].name == "get_weather"
    text = '<tool_call>\n{"name": "get_weather", "argu'
    assert parse_all(text, NAMES) == (text, [])


def test_forced_starts_are_parsed_with_the_output():
    two = ["search", "get_weather"]
    assert forced_start("auto", two) == forced_start("none", two) == forced_start(None, two) == ""
    assert forced_start("required", two) == '<tool_call>\n{"name": "'
    start = forced_start({"type": "function", "function": {"name": "search"}}, two)
    assert start == forced_start("required", ["search"]) == '<tool_call>\n{"name": "search", "arguments": {'
    content, calls = parse_all('"q": "rain"}}\n</tool_call>', NAMES, start)
    assert content is None and calls[0].name == "search" and json.loads(calls[0].arguments) == {"q": "rain"}
    content, calls = parse_all('search", "arguments": {"q": 1}}', NAMES, forced_start("required", two))
    assert calls[0].name == "search"  # (closed by the end of the output)
    text = 'hello", "arguments": {}}'  # a name that is not a tool's: the output is text
    assert parse_all(text, NAMES, forced_start("required", two)) == ('<tool_call>\n{"name": "' + text, [])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=40),
    st.sampled_from(
        [
            "Sure. " + CALL + " Done.",
            CALL,
            '```json\n{"name": "search", "arguments": {"q": "x"}}\n```',
            "plain <tool answer",
            "a < b and <tool_call> never closed",
            '{"not": "a call"}',
            CALL + " then " + CALL.replace("Paris", "Rome"),
            "```python\ndef f():\n    return 1\n```",
            '```\n{"name": "search", "arguments": {}}\n```',
            "``python or not",
        ]
    ),
    st.sampled_from([None, 1]),
)
def test_streaming_in_any_chunks_says_what_parsing_the_whole_says(cuts, text, most):
    parser, events, at, i = ToolCallParser(NAMES, most=most), [], 0, 0
    while at < len(text):
        n = cuts[i % len(cuts)]
        events += parser.feed(text[at : at + n])
        at, i = at + n, i + 1
    events += parser.finish()
    content = "".join(v for kind, v in events if kind == "content")
    calls = [(v.name, v.arguments) for kind, v in events if kind == "call"]
    whole_content, whole_calls = parse_all(text, NAMES, most=most)
    assert len(whole_calls) <= (most or 2)
    assert (content if content.strip() or not calls else None) == whole_content
    assert calls == [(c.name, c.arguments) for c in whole_calls]
    # no text that is part of a call ever went out as content
    assert all('<tool_call>\n{"name"' not in v for kind, v in events if kind == "content") or not calls


def test_history_tool_calls_reach_the_template_as_objects():
    m = history_message(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        }
    )
    assert m["content"] == "" and m["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert history_message({"role": "tool", "content": "18C", "tool_call_id": "call_1"})["tool_call_id"] == "call_1"
    assert template_renders_tools("{% if tools %}...{% endif %}") and not template_renders_tools("{{ messages }}")
