"""Tool calls in OpenAI's shapes over the chat template's own format.

The model is told about `tools` by its chat template (Qwen2.5's renders them in the system
message, as Hermes-style function calling) and answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallParser` turns that text back into `message.tool_calls`, or into streamed tool-call
deltas, as it arrives: text outside the blocks is content; a block is held until it closes,
then parsed; a block that is not a JSON object with a name of a given tool (malformed output)
goes back as text, never as an error. Some models answer a call without the tags, as the bare
JSON object (Qwen2.5-Coder-1.5B writes it in a ```json fence): an output that is nothing but
such an object (or a list of them) is a call too. An output that may be one (it begins with
"{", "[" or "```") is held back until it ends. `tool_choice` "required" or a named function starts
the assistant's turn with the opening of a call (and the name), which the model continues:
the output is then the target's own continuation of that start, as exact as any other.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads `tools` (and so tells the model about them)."""
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def forced_start(tool_choice: Any, names: list[str]) -> str:
    """The text that starts the assistant's turn for a `tool_choice` among the functions
    `names`: the opening of a call up to the name ("required"), or up to the arguments' brace
    of a call to the named function (or the only one); "" where the model chooses. The more of
    the call's shape is given, the less a small model can stray from it (Qwen2.5-Coder-0.5B,
    given only the opening tag, ends its turn)."""
    if isinstance(tool_choice, dict) or (tool_choice == "required" and len(names) == 1):
        name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else names[0]
        return OPEN + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": {'
    if tool_choice == "required":
        return OPEN + "\n" + '{"name": "'
    return ""


def history_message(m: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as the chat template reads it: an assistant's tool calls with their
    arguments as objects (the template writes them as JSON itself), a tool result as content."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            args = c["function"].get("arguments") or "{}"
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                pass  # (kept as the text the client sent)
            calls.append(
                {"type": "function", "id": c.get("id"), "function": {"name": c["function"]["name"], "arguments": args}}
            )
        out["tool_calls"] = calls
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    if m.get("name"):
        out["name"] = m["name"]
    return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallParser:
    """Splits the model's text into content and tool calls as it streams (see the module doc).
    `feed` returns what can be said now: ("content", text) and ("call", ToolCall) events in
    order; `finish` what is left at the end."""

    names: frozenset[str]  # the functions the request offered
    start: str = ""  # text the turn began with (a forced start): parsed, but not the model's output to echo
    most: int | None = None  # the most calls returned (1: `parallel_tool_calls: false`); later ones are dropped
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _in_call: bool = False
    _mode: str | None = None  # "stream" (text goes out as it comes), "hold" (may be a bare call); None: not yet seen
    _held: str = ""
    _given: int = 0  # calls returned so far

    def __post_init__(self) -> None:
        self._buf, self._in_call, self._held = self.start, False, ""
        self._mode = "stream" if self.start else None  # (a forced start is the tags' opening)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self._mode != "stream":
            self._held += text
            lead = self._held.lstrip()
            if lead:  # held only while the output may still be a bare call (a code answer goes out)
                self._mode = "hold" if _may_be_bare(lead) else "stream"
            if self._mode != "stream":
                return []
            text, self._held = self._held, ""
        return self._limit(self._stream(text))

    def finish(self) -> list[tuple[str, Any]]:
        """The end of the output: what is left, and a held output parsed whole."""
        if self._mode == "stream":
            return self._limit(self._finish_stream())
        held, self._held = self._held, ""
        events = _merge(self._stream(held) + self._finish_stream())
        if any(kind == "call" for kind, _ in events) or not held.strip():
            return self._limit(events)
        bare = self._bare(held)
        return self._limit([("call", c) for c in bare]) if bare else [("content", held)]

    def _limit(self, events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Drop the calls past `most` (as one that asked for a single call expects: the first),
        with the text around them once a call was made."""
        if self.most is None:
            return events
        out, given = [], self._given
        for kind, v in events:
            if kind == "call":
                given += 1
                if given <= self.most:
                    out.append((kind, v))
            elif given < self.most:
                out.append((kind, v))
        self._given = given
        self.calls = self.calls[: self.most]
        return out

    def _bare(self, text: str) -> list[ToolCall]:
        """Calls from an output that is only a JSON object naming a tool, or a list of them
        (optionally in a code fence); none unless every one parses."""
        body = text.strip()
        if body.startswith("```"):
            first, _, rest = body.partition("\n")
            body = rest.strip().removesuffix("```").strip() if body.endswith("```") and rest else ""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return []
        objs = obj if isinstance(obj, list) else [obj]
        calls = [self._call(o) for o in objs]
        if not objs or any(c is None for c in calls):
            return []
        self.calls += calls  # type: ignore[arg-type]
        return calls  # type: ignore[return-value]

    def _stream(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        events: list[tuple[str, Any]] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:  # hold back what could be the start of an opening tag
                    keep = _partial_suffix(self._buf, OPEN)
                    if len(self._buf) > keep:
                        events.append(("content", self._buf[: len(self._buf) - keep]))
                        self._buf = self._buf[len(self._buf) - keep :]
                    return _merge(events)
                if at:
                    events.append(("content", self._buf[:at]))
                self._buf, self._in_call = self._buf[at:], True
            end = self._buf.find(CLOSE)
            if end < 0:
                return _merge(events)
            block = self._buf[: end + len(CLOSE)]
            self._buf, self._in_call = self._buf[end + len(CLOSE) :], False
            call = self._parse(block[len(OPEN) : -len(CLOSE)])
            events.append(("call", call) if call is not None else ("content", block))

    def _finish_stream(self) -> list[tuple[str, Any]]:
        """The end of streamed text: an unclosed block whose JSON is complete is a call (a model
        may stop at its end token instead of the closing tag); anything else is text."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            call = self._parse(rest[len(OPEN) :])
            return [("call", call)] if call is not None else [("content", rest)] if rest else []
        return [("content", rest)] if rest else []

    def _parse(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        call = self._call(obj)
        if call is not None:
            self.calls.append(call)
        return call

    def _call(self, obj: Any) -> ToolCall | None:
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # (a model that writes the arguments as a JSON string)
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall("call_" + uuid.uuid4().hex[:24], obj["name"], json.dumps(args, ensure_ascii=False))


def parse_all(
    text: str, names: frozenset[str], start: str = "", most: int | None = None
) -> tuple[str | None, list[ToolCall]]:
    """The whole output at once: (content, or None where there is none; the tool calls)."""
    parser = ToolCallParser(names, start, most)
    events = parser.feed(text) + parser.finish()
    content = "".join(v for kind, v in events if kind == "content")
    calls = [v for kind, v in events if kind == "call"]
    return (content if content.strip() or not calls else None), calls


def _may_be_bare(lead: str) -> bool:
    """Whether an output beginning with `lead` (no leading space) may still be a bare call: JSON
    from its first character, or in a code fence marked json or not marked at all (what
    `ToolCallParser._bare` reads). A fence of another language (```python) or one whose first
    line is not JSON settles it: text, streamed as it comes."""
    if lead[0] in "{[":
        return True
    if not lead.startswith("```"):
        return "```".startswith(lead)  # (one or two backticks: not known yet)
    first, newline, rest = lead[3:].partition("\n")
    if not newline:  # (still in the fence's first line)
        return "json".startswith(first.strip().lower())
    body = rest.lstrip()
    return first.strip().lower() in ("", "json") and (not body or body[0] in "{[")


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _merge(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for kind, v in events:
        if kind == "content" and not v:
            continue
        if kind == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + v)
        else:
            out.append((kind, v))
    return out
