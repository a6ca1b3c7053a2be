"""The request bodies the server accepts, and its errors, in OpenAI's shapes."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..config import MAX_K
from ..drafters import DRAFTERS
from ..engine import MAX_TOP_LOGPROBS
from ..plans import PLAIN as NONE  # the `speculative.method` that asks for plain decoding

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def parts_text(content: str | list[dict[str, Any]], param: str) -> str:
    """A message's (or a prediction's) text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", param=param)
        out.append(part["text"])
    return "".join(out)


# -- errors --------------------------------------------------------------------------------
class APIError(Exception):
    """An error the client caused or should know about, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# -- request bodies ------------------------------------------------------------------------
class Speculative(BaseModel):
    """The extra body field that picks a request's drafting method and k."""

    model_config = ConfigDict(extra="allow")  # the method's own options (e.g. "max_ngram": 4)
    method: str
    k: int | None = Field(default=None, ge=1, le=MAX_K)

    @field_validator("method")
    @classmethod
    def _known(cls, v: str) -> str:
        if v != NONE and v not in DRAFTERS:
            raise ValueError(f"unknown method {v!r}; choose {NONE!r} or one of {', '.join(sorted(DRAFTERS))}")
        return v


class StreamOptions(BaseModel):
    include_usage: bool = False
    # (ours) each chunk carries the pass that committed its text as `speculative`: the pass
    # number, the draft tokens it verified and accepted, who drafted them, and how many of the
    # chunk's first characters are accepted drafts (`app.step_trace`); OpenAI clients ignore it
    include_steps: bool = False


class Prediction(BaseModel):
    """OpenAI's predicted output: the text the client expects back (a file it asked to edit)."""

    type: Literal["content"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        return parts_text(self.content, "prediction")


class _Common(BaseModel):
    """What both endpoints take. Unknown fields are ignored (OpenAI clients send some we do not
    use); fields we cannot honour are refused where set to anything but their neutral value."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)  # an extra field (vLLM's spelling); 0 = off
    ignore_eos: bool = False  # an extra field (vLLM's): keep generating past end-of-sequence tokens
    seed: int | None = Field(default=None, ge=0, lt=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = 1  # one choice per request
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0  # not supported: only the neutral value
    frequency_penalty: float = 0.0
    prediction: Prediction | None = None
    speculative: Speculative | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("this server returns one choice per request (n = 1); send n requests instead")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported by this server (they would change the target's distribution)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    def top_logprobs_asked(self) -> int | None:
        """Alternatives per token for the logprobs asked for (None: no logprobs)."""
        raise NotImplementedError


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCallIn] | None = None  # (before content: its check reads them)
    content: str | list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _assistants(cls, v: list[ToolCallIn] | None, info: ValidationInfo) -> list[ToolCallIn] | None:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _not_null(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and not info.data.get("tool_calls"):
            raise ValueError(
                "a message's content is text or a list of text parts, not null (null only in an "
                "assistant message with tool_calls)"
            )
        return v

    def text(self) -> str:
        return parts_text(self.content, "messages") if self.content is not None else ""

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        from .tools import history_message

        m: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            m["tool_call_id"] = self.tool_call_id
        if self.name:
            m["name"] = self.name
        return history_message(m)


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def check(self) -> None:
        """What the fields' own rules cannot see: how they go together."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise APIError(400, "tool_choice 'required' or a named function needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            t.function.name for t in self.tools or ()
        }:
            raise APIError(
                400, f"tool_choice names {choice.function.name!r}, which is not among the tools", param="tool_choice"
            )

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tools_on(self) -> bool:
        """Whether the model is told about the tools and its output parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = Field(default=False)
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this server")
        return v
