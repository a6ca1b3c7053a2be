"""The request bodies the server accepts, and its errors, in OpenAI's shapes."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import MAX_K
from ..drafters import DRAFTERS


NONE = "none"  # the `speculative.method` that asks for plain decoding
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}

# -- errors --------------------------------------------------------------------------------
class APIError(Exception):
    """An error the client caused or should know about, in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:  # fmt: skip
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


class _Common(BaseModel):
    """What both endpoints take. Unknown fields are ignored (OpenAI clients send some we do not
    use); fields we cannot honour are refused where set to anything but their neutral value."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)  # an extra field (vLLM's spelling); 0 = off
    seed: int | None = Field(default=None, ge=0, lt=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = 1  # one choice per request
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0  # not supported: only the neutral value
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
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

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v:
            raise ValueError("logprobs are not supported by this server")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]]

    @field_validator("content", mode="before")
    @classmethod
    def _not_null(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("a message's content is text or a list of text parts, not null")
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = Field(default=False)
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this server")
        return v
