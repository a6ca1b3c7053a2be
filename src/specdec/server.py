"""`specdec serve`: an OpenAI-compatible HTTP server over the engine's stepper.

    specdec serve --target qwen2.5-coder-1.5b --drafter prompt-lookup --port 8000
    # any OpenAI client: base_url="http://127.0.0.1:8000/v1"

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both streamed as server-sent
events in the OpenAI chunk format, or not), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus). A request may pick its own drafting method with an extra body field,
``"speculative": {"method": "prompt-lookup", "k": 6}`` (``{"method": "none"}``: plain
decoding); the server's own method (`--drafter`/`--draft`) is the default.

Two threads: the ASGI event loop (uvicorn) parses, validates and streams; the engine thread
owns the `Engine` and steps every live sequence together (continuous batching: a request
joins the batch at the next step and leaves it when it ends; at most `max_batch` decode at
once, the rest wait in order). The engine thread hands each step's deltas to the request's
asyncio queue. All torch work happens on that one thread (drafters are built there too):
OpenMP keeps a thread pool per calling thread, and on a machine with as many cores as one
pool has threads, a second pool throttles the spinning of both, which cost a third of the
decoding speed here. `serve` therefore runs the engine on the main thread, the one that
loaded the models, and uvicorn beside it. Each step it asks the cost model whether drafting still pays at this batch size
(`adaptive.batch_drafting_pays`: a large batch fills the target pass with rows already) and
runs a plain step for all when it does not — exactly as lossless as any other step.

Every sequence is decoded exactly as `specdec generate` decodes it alone (bitwise in the exact
modes), whatever else shares its steps: greedy output is the same token for token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .adaptive import PRIOR_ALPHA, batch_drafting_pays
from .api import LoadedModel, build_drafter, encode_prompt
from .config import GenerationConfig, SamplingParams
from .drafters import DRAFTERS, uses_draft_model
from .drafters.base import Drafter
from .engine import Delta, Engine, GenerationResult

log = logging.getLogger("specdec.serve")

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
    k: int | None = Field(default=None, ge=1, le=64)

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
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
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
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
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


# -- the server's settings and metrics -----------------------------------------------------
@dataclass
class ServeSettings:
    model_name: str  # the id clients send as "model"
    method: str | None = None  # the default drafting method (None: plain decoding)
    options: dict[str, Any] = field(default_factory=dict)  # the default method's options
    k: int = 4
    max_batch: int = 8
    max_queue: int = 256  # waiting requests beyond the batch; more get 429
    default_max_tokens: int = 512
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    batch_guard: bool = True  # drafting off for steps whose batch leaves it no room


class ServerMetrics:
    """Prometheus metrics, in a registry of their own (one per app)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "requests by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated = Counter("specdec_generated_tokens", "tokens generated", registry=r)
        lat = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10, 20, 40)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "request arrival to its first token", buckets=lat,
                              registry=r)  # fmt: skip
        self.itl = Histogram("specdec_inter_token_latency_seconds", "time per token after the first", buckets=lat,
                             registry=r)  # fmt: skip
        self.e2e = Histogram("specdec_request_latency_seconds", "request arrival to its last token", buckets=lat, registry=r)
        self.batch = Gauge("specdec_batch_size", "sequences in the running batch", registry=r)
        self.queue = Gauge("specdec_queue_depth", "requests waiting for a place in the batch", registry=r)
        self.drafting = Gauge("specdec_drafting_enabled", "1 while the batch leaves drafting room to pay, else 0", registry=r)
        self.steps = Counter("specdec_steps", "engine steps, by whether drafting was on", ["drafting"], registry=r)
        self.drafted = Counter("specdec_draft_tokens", "draft tokens verified, by method", ["method"], registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "draft tokens accepted, by method", ["method"], registry=r)
        self.passes = Counter("specdec_target_passes", "target verification passes, by method", ["method"], registry=r)
        self.pass_tokens = Counter("specdec_pass_tokens", "tokens committed by verification passes, by method", ["method"],
                                   registry=r)  # fmt: skip
        self.alpha = Gauge("specdec_acceptance_rate", "accepted / drafted tokens so far, by method", ["method"], registry=r)
        self.tau = Gauge("specdec_tokens_per_pass", "tokens per target verification pass so far, by method", ["method"],
                         registry=r)  # fmt: skip
        self.drafting.set(1)
        self._sums: dict[str, list[float]] = {}  # method -> [drafted, accepted, passes, pass tokens]

    def finished(self, method: str, result: GenerationResult) -> None:
        m = result.metrics
        self.prompt_tokens.inc(m.prompt_tokens)
        s = self._sums.setdefault(method, [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((m.proposed, m.accepted, m.steps, m.step_tokens)):
            s[i] += v
        self.drafted.labels(method).inc(m.proposed)
        self.accepted.labels(method).inc(m.accepted)
        self.passes.labels(method).inc(m.steps)
        self.pass_tokens.labels(method).inc(m.step_tokens)
        if s[0]:
            self.alpha.labels(method).set(s[1] / s[0])
        if s[2]:
            self.tau.labels(method).set(s[3] / s[2])

    def acceptance(self) -> float:
        """Acceptance over every speculative request so far (a prior before there is any)."""
        drafted = sum(s[0] for s in self._sums.values())
        accepted = sum(s[1] for s in self._sums.values())
        return (accepted + PRIOR_ALPHA * 16) / (drafted + 16)


# -- one request in flight -----------------------------------------------------------------
@dataclass
class Job:
    """A request between the HTTP handler (event loop) and the worker thread."""

    prompt_ids: list[int]
    config: GenerationConfig
    sampling: SamplingParams
    method: str  # "none" or a drafter name
    drafter: Drafter | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[str, Any]]  # ("delta", Delta) | ("done", GenerationResult) | ("error", APIError)
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None  # when its latest tokens reached the handler (None: none yet)
    seq_id: int | None = None
    cancelled: bool = False

    def post(self, kind: str, value: Any) -> None:  # (from the worker thread)
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    """Owns the engine; runs steps while there is work, sleeps on its inbox otherwise."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, settings: ServeSettings,
                 metrics: ServerMetrics) -> None:  # fmt: skip
        self.target, self.draft, self.settings, self.metrics = target, draft, settings, metrics
        self.engine = Engine(target.model, target.tokenizer)
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.waiting: deque[Job] = deque()
        self.jobs: dict[int, Job] = {}
        self.costs: Any = None  # the target's pass time per row count, for the batch guard
        self.drafting_on = True
        self.running = threading.Event()  # set while the loop runs (whichever thread runs it)
        self.finished = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the loop in a thread of its own (`run` runs it in the caller's thread)."""
        self.thread = threading.Thread(target=self.run, name="specdec-engine", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.running.is_set() and not self.finished.is_set()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is still running or waiting, and end the loop."""
        self.inbox.put(("stop", None))
        if self.running.is_set():
            self.finished.wait(timeout)

    def submit(self, job: Job) -> None:
        if len(self.waiting) + self.inbox.qsize() >= self.settings.max_queue:
            raise APIError(429, "the server's queue is full; retry later", type="server_error", code="queue_full")
        self.inbox.put(("add", job))

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self.inbox.put(("cancel", job))

    async def call(self, fn: Any) -> Any:
        """`fn()` on the engine thread between two steps (building a drafter may run torch)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.inbox.put(("call", (fn, loop, future)))
        return await future

    # -- the thread ------------------------------------------------------------------------
    def run(self, keep_going: Any = None) -> None:
        """The loop, in the calling thread, until `stop` (or until `keep_going()` turns false,
        checked while idle: the HTTP thread died)."""
        self.running.set()
        try:
            if self.settings.batch_guard and self.settings.max_batch > 1:
                from .costs import pass_costs

                self.costs = pass_costs(self.target.model, min(64, self.settings.max_batch * (self.settings.k + 1)))
            self._loop(keep_going)
        finally:
            self.finished.set()

    def _loop(self, keep_going: Any) -> None:
        while True:
            idle = not self.engine.has_work() and not self.waiting
            try:
                self._take(block=idle)
            except _Stop:
                break
            if idle and keep_going is not None and not keep_going():
                break
            self._admit()
            self.metrics.batch.set(len(self.engine.live()))
            self.metrics.queue.set(len(self.waiting))
            if self.engine.has_work():
                self._step()
        for job in [*self.jobs.values(), *self.waiting]:
            if job.seq_id is not None and job.seq_id in self.engine.live():
                self.engine.cancel(job.seq_id)
            job.post("error", APIError(503, "the server is shutting down", type="server_error", code="shutdown"))
        self.jobs.clear()
        self.waiting.clear()

    def _take(self, block: bool) -> None:
        """Everything in the inbox (waiting up to a second for the first item when idle)."""
        try:
            item = self.inbox.get(block=block, timeout=1.0 if block else 0)
        except queue.Empty:
            return
        while True:
            kind, job = item
            if kind == "stop":
                raise _Stop
            if kind == "call":
                self._call(*job)
            elif kind == "add":
                self.waiting.append(job)
            elif kind == "cancel":
                if job in self.waiting:
                    self.waiting.remove(job)
                elif job.seq_id is not None and job.seq_id in self.jobs:
                    self.engine.cancel(job.seq_id)
                    self.engine.result(job.seq_id)
                    del self.jobs[job.seq_id]
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _call(fn: Any, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
        def settle(ok: bool, value: Any) -> None:
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        try:
            value, ok = fn(), True
        except Exception as exc:  # (handed to the request that asked)
            value, ok = exc, False
        loop.call_soon_threadsafe(settle, ok, value)

    def _admit(self) -> None:
        while self.waiting and len(self.engine.live()) < self.settings.max_batch:
            job = self.waiting.popleft()
            if job.cancelled:
                continue
            try:
                job.seq_id = self.engine.add(job.prompt_ids, job.config, job.sampling, job.drafter)
            except (ValueError, TypeError) as exc:  # (checked in the handler already; kept as a safety net)
                job.post("error", APIError(400, str(exc)))
                continue
            self.jobs[job.seq_id] = job

    def _drafting(self) -> bool:
        """Whether this step drafts: unless the batch is large enough that speculation no longer
        pays (measured pass times per row count, the acceptance seen so far)."""
        live = [self.jobs[s] for s in self.engine.live() if s in self.jobs]
        drafting = [j for j in live if j.method != NONE]
        if self.costs is None or len(live) <= 1 or not drafting:
            return True
        k = sum(j.config.k for j in drafting) / len(live)  # drafts per sequence, the plain ones counted as 0
        return batch_drafting_pays(self.costs, len(live), k, self.metrics.acceptance())

    def _step(self) -> None:
        drafting = self._drafting()
        if drafting != self.drafting_on:
            log.info("drafting %s at batch size %d", "on" if drafting else "off", len(self.engine.live()))
            self.drafting_on = drafting
        self.metrics.drafting.set(1 if drafting else 0)
        self.metrics.steps.labels("on" if drafting else "off").inc()
        try:
            deltas = self.engine.step(drafting=drafting)
        except Exception:  # a bug must not take the server down: fail this batch, start afresh
            log.error("engine step failed:\n%s", traceback.format_exc())
            for job in self.jobs.values():
                job.post("error", APIError(500, "internal error while decoding this request", type="server_error"))
            self.jobs.clear()
            self.engine = Engine(self.target.model, self.target.tokenizer)
            return
        for d in deltas:
            job = self.jobs.get(d.seq_id)
            if job is None:
                continue
            job.post("delta", d)
            if d.finished:
                result = self.engine.result(d.seq_id)
                self.metrics.finished(job.method, result)
                del self.jobs[d.seq_id]
                job.post("done", result)


class _Stop(Exception):
    pass


# -- what happens before a handler: body limit, API key, counting --------------------------
class Gate:
    """Pure ASGI (so streaming and disconnects pass through untouched): refuses bodies over
    `limit` bytes (413, whether they announce their length or not), `/v1/` requests without
    the API key (401), and counts `/v1/` responses by status."""

    def __init__(self, app: ASGIApp, limit: int, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app, self.limit, self.api_key, self.metrics = app, limit, api_key, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        counted = path.startswith("/v1/")
        headers = dict(scope.get("headers") or [])

        async def refuse(err: APIError) -> None:
            if counted:
                self.metrics.requests.labels(path, str(err.status)).inc()
            await err.response()(scope, receive, send)

        if self.api_key is not None and counted:
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                await refuse(APIError(401, "missing or wrong API key (send the header 'Authorization: Bearer KEY')",
                                      code="invalid_api_key"))  # fmt: skip
                return
        too_big = APIError(413, f"the request body is over this server's limit of {self.limit} bytes",
                           code="body_too_large")  # fmt: skip
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await refuse(too_big)
            return
        body, more = b"", True
        while more:  # read the whole body first (it is small): a chunked body is limited too
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                await refuse(too_big)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then: the client's disconnect, when it comes

        async def counting_send(msg: Message) -> None:
            if counted and msg["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(msg["status"])).inc()
            await send(msg)

        await self.app(scope, replay, counting_send)


# -- the app -------------------------------------------------------------------------------
def create_app(target: LoadedModel, draft: LoadedModel | None, settings: ServeSettings,
               engine_thread: bool = True) -> FastAPI:  # fmt: skip
    """The ASGI app. `engine_thread`: its worker runs in a thread of its own from startup to
    shutdown; otherwise the caller runs `app.state.worker.run()` (as `serve` does, on the main
    thread) and shutdown stops it."""
    import contextlib

    metrics = ServerMetrics()
    worker = Worker(target, draft, settings, metrics)
    context = target.model.args.max_seq_len

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine_thread:
            worker.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.settings = worker, metrics, settings

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
        msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
        return APIError(400, f"{'.'.join(loc) or 'body'}: {msg}", param=".".join(loc) or None).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("request failed:\n%s", traceback.format_exc())
        return APIError(500, "internal server error", type="server_error").response()

    def check_model(name: str) -> None:
        if name != settings.model_name:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    async def make_job(body: _Common, prompt_ids: list[int], max_tokens: int | None) -> Job:
        spec = body.speculative
        method = spec.method if spec is not None else (settings.method or NONE)
        options = dict(spec.model_extra or {}) if spec is not None else dict(settings.options)
        if method == "draft-model" and draft is None:
            raise APIError(400, "this server has no draft model (start it with --draft NAME)", param="speculative")
        k = spec.k if spec is not None and spec.k is not None else settings.k
        if len(prompt_ids) >= context:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens but the model's context is {context}",
                           param="messages" if isinstance(body, ChatRequest) else "prompt",
                           code="context_length_exceeded")  # fmt: skip
        if max_tokens is not None and len(prompt_ids) + max_tokens > context:
            raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                f"context of {context}; lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")  # fmt: skip
        n = max_tokens if max_tokens is not None else min(settings.default_max_tokens, context - len(prompt_ids))
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            cfg = GenerationConfig(max_new_tokens=n, k=k, stop=stops)
            sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        drafter = None
        if method != NONE:
            helper = draft if uses_draft_model(method) else None
            try:  # (on the engine thread: a head is loaded from disk the first time it is asked for)
                drafter = await worker.call(lambda: build_drafter(target, helper, method, **options))
            except (ValueError, TypeError) as exc:
                raise APIError(400, f"speculative: {exc}", param="speculative") from exc
        return Job(prompt_ids, cfg, sampling, method, drafter, asyncio.get_running_loop(), asyncio.Queue())

    def encode(tokenizer_call: Any, param: str) -> list[int]:
        try:
            return tokenizer_call()
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=param) from exc

    async def run(request: Request, job: Job, body: _Common, kind: str) -> Response:
        worker.submit(job)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(job, rid, created, kind, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        texts, result = [], None
        events = asyncio.ensure_future(_drain(job, texts))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({events, gone}, return_when=asyncio.FIRST_COMPLETED)
            if events not in done:  # the client left: free its sequence
                worker.cancel(job)
                return Response(status_code=499)
            result = events.result()
        finally:
            gone.cancel()
        text = "".join(texts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": FINISH[result.finish_reason]} if kind == "chat" else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": FINISH[result.finish_reason]})  # fmt: skip
        return JSONResponse({"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                             "created": created, "model": settings.model_name, "choices": [choice],
                             "usage": usage(job, result)})  # fmt: skip

    async def _drain(job: Job, texts: list[str]) -> GenerationResult:
        while True:
            kind, value = await job.events.get()
            if kind == "error":
                raise value
            if kind == "done":
                metrics.e2e.observe(time.perf_counter() - job.arrived)
                return value
            observe_delta(job, value)
            texts.append(value.text)

    async def _disconnected(request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    def observe_delta(job: Job, d: Delta) -> None:
        now = time.perf_counter()
        n = len(d.token_ids)
        if n:
            metrics.generated.inc(n)
            if job.last_token_at is None:
                metrics.ttft.observe(now - job.arrived)
            else:
                for _ in range(n):
                    metrics.itl.observe((now - job.last_token_at) / n)
            job.last_token_at = now

    async def stream(job: Job, rid: str, created: int, kind: str, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": settings.model_name,
                                          "choices": choices, **extra}) + "\n\n"  # fmt: skip

        def choice(text: str, finish: str | None, role: bool = False) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        finished = False
        try:
            if kind == "chat":
                yield chunk([choice("", None, role=True)])
            while True:
                ev, value = await job.events.get()
                if ev == "error":
                    yield "data: " + json.dumps(value.body()) + "\n\n"
                    break
                if ev == "done":
                    metrics.e2e.observe(time.perf_counter() - job.arrived)
                    yield chunk([choice("", FINISH[value.finish_reason])])
                    if include_usage:
                        yield chunk([], usage=usage(job, value))
                    break
                observe_delta(job, value)
                if value.text:
                    yield chunk([choice(value.text, None)])
            finished = True
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client disconnected mid-stream: its sequence ends at the next step
                worker.cancel(job)

    def usage(job: Job, result: GenerationResult) -> dict[str, Any]:
        m = result.metrics
        u: dict[str, Any] = {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.new_tokens,
                             "total_tokens": m.prompt_tokens + m.new_tokens}  # fmt: skip
        u["speculative"] = {"method": job.method, "k": job.config.k if job.method != NONE else None,
                            "draft_tokens": m.proposed, "accepted_tokens": m.accepted, "target_passes": m.steps,
                            "acceptance_rate": m.acceptance_rate, "tokens_per_pass": m.mean_accepted_tokens}  # fmt: skip
        return u

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        if not target.tokenizer.has_chat_template:
            raise APIError(400, f"{settings.model_name} has no chat template; use /v1/completions", param="messages")
        ids = encode(lambda: encode_prompt(target.tokenizer, messages), "messages")
        job = await make_job(body, ids, body.max_completion_tokens or body.max_tokens)
        return await run(request, job, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (n = 1)", param="prompt")
            prompt = prompt[0]
        if body.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        ids = encode(lambda: encode_prompt(target.tokenizer, prompt, chat=False), "prompt")  # type: ignore[arg-type]
        job = await make_job(body, ids, body.max_tokens)
        return await run(request, job, body, "completion")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": context}]}  # fmt: skip

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if not worker.alive():
            raise APIError(503, "the engine thread is not running", type="server_error")
        return {"status": "ok", "model": settings.model_name, "batch": len(worker.jobs), "queue": len(worker.waiting)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Gate, limit=settings.max_body_bytes, api_key=settings.api_key, metrics=metrics)  # type: ignore[arg-type]
    return app


def serve(target: LoadedModel, draft: LoadedModel | None, settings: ServeSettings, host: str, port: int) -> None:
    """Run the server until interrupted (Ctrl-C / SIGTERM: in-flight requests get up to 30 s to
    finish, then are cancelled). The engine runs on this (the main) thread, uvicorn beside it."""
    import signal
    import socket

    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host") from exc
    app = create_app(target, draft, settings, engine_thread=False)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30))
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specdec-http", daemon=True)

    def shut(signum: int, frame: Any) -> None:  # uvicorn in a thread installs no handlers: ours tell it
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, shut)
    http.start()
    log.info("serving %s on http://%s:%d/v1", settings.model_name, host if ":" not in host else f"[{host}]", port)
    app.state.worker.run(keep_going=http.is_alive)
    http.join(60)
