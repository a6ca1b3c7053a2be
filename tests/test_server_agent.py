"""What agents and editors send through `specdec serve`, with the official `openai` client:
tool calls (streamed and not, forced by tool_choice, the tool's result back in the history),
predicted outputs (exact, with OpenAI's accepted/rejected counts), logprobs equal to plain
decoding's. Qwen2.5-Coder-0.5B as the target: its chat template renders tools."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server import Running

import specdec
from specdec.server import ServeSettings, create_app

MODEL = "qwen2.5-coder-0.5b"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
CODE = '''def area(w, h):
    """Area of a rectangle."""
    return w * h


def perimeter(w, h):
    return 2 * (w + h)
'''
EDIT = [
    {
        "role": "user",
        "content": "Rename the function `area` to `rect_area` in this code. Reply with the whole "
        "code and nothing else.\n\n```python\n" + CODE + "```",
    }
]


@pytest.fixture(scope="module")
def qwen():
    return specdec.load(MODEL, device="cpu")


@pytest.fixture(scope="module")
def server(qwen):
    running = Running(create_app(qwen, None, ServeSettings(MODEL, "auto", {}, max_batch=4)))
    yield running
    running.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _plain(method: str = "none") -> dict:
    return {"speculative": {"method": method}}


@pytest.mark.real
def test_a_tool_call_streamed_and_not_then_the_tools_answer(client):
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    msg = chat.choices[0].message
    assert chat.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the call's id and name first, then its arguments, in OpenAI's deltas
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0, stream=True
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert deltas and {d.index for d in deltas} == {0} and deltas[0].id and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # the tool's result goes back as a `tool` message; the model answers in prose
    history = ASK + [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "sunny"}'},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    assert answer.choices[0].message.tool_calls is None and "18" in answer.choices[0].message.content


@pytest.mark.real
def test_tool_choice_forces_or_forbids_a_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello there!"}],
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=40,
            temperature=0,
        )
        assert chat.choices[0].finish_reason == "tool_calls", choice
        assert chat.choices[0].message.tool_calls[0].function.name == "get_weather"
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0
    )
    assert chat.choices[0].message.tool_calls is None and chat.choices[0].message.content


@pytest.mark.real
def test_a_prediction_is_exact_and_counted(client):
    plain = client.chat.completions.create(
        model=MODEL, messages=EDIT, max_tokens=120, temperature=0, extra_body=_plain()
    )
    assert "rect_area" in plain.choices[0].message.content
    for body in ({}, {"speculative": {"method": "prediction"}}):
        chat = client.chat.completions.create(
            model=MODEL,
            messages=EDIT,
            max_tokens=120,
            temperature=0,
            prediction={"type": "content", "content": CODE},
            extra_body=body,
        )
        assert chat.choices[0].message.content == plain.choices[0].message.content
        details = chat.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 10 and details.rejected_prediction_tokens >= 0
        assert (
            chat.usage.model_extra["speculative"]["method"]
            == (body or {"speculative": {"method": "auto"}})["speculative"]["method"]
        )
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    # (streamed, the prediction drafts alone: under auto, suffix decoding may now take the steps
    # from the same answer in its store, which the earlier requests left there)
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=EDIT,
        max_tokens=120,
        temperature=0,
        stream=True,
        prediction={"type": "content", "content": [{"type": "text", "text": CODE}]},
        stream_options={"include_usage": True},
        extra_body={"speculative": {"method": "prediction"}},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 10


@pytest.mark.real
def test_logprobs_equal_plain_decodings(client):
    def chat(method: str, stream: bool = False):
        return client.chat.completions.create(
            model=MODEL,
            messages=EDIT,
            max_tokens=40,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=stream,
            extra_body=_plain(method),
        )

    plain = chat("none").choices[0].logprobs.content
    assert len(plain) == 40 and all(len(t.top_logprobs) == 3 and t.bytes for t in plain)
    for method in ("auto", "prompt-lookup", "suffix"):
        assert chat(method).choices[0].logprobs.content == plain, method
    streamed = [
        t
        for c in chat("auto", stream=True)
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert streamed == plain
    comp = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=20, temperature=0, logprobs=2)
    ref = client.completions.create(
        model=MODEL, prompt="def fib(n):", max_tokens=20, temperature=0, logprobs=2, extra_body=_plain()
    )
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs == ref.choices[0].logprobs.token_logprobs and "".join(lp.tokens) == comp.choices[0].text
    assert len(lp.top_logprobs[0]) == 2 and lp.text_offset[0] == 0


@pytest.mark.real
@pytest.mark.parametrize(
    "change, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"prediction": {"type": "content", "content": "x"}, "speculative": {"method": "suffix"}}, "prediction"),
        ({"prediction": {"type": "url", "content": "x"}}, "prediction.type"),
        ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ],
)
def test_bad_agent_requests_get_one_clear_line(server, change, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4} | change
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    err = r.json()["error"]
    assert (
        r.status_code == 400 and "\n" not in err["message"] and (err["param"] or "").startswith(param.split(".")[0])
    ), err
