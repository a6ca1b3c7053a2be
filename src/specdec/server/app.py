"""The ASGI app: one function per route over a `Service` that owns the worker."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from ..api import LoadedModel, build_drafter, encode_prompt, prepare
from ..api import Request as ApiRequest
from ..drafters.base import DRAFTERS
from ..engine import ContextOverflowError, Delta, GenerationResult, TokenLogprob, plan_length
from ..plans import PlanError, name_of, plan_request
from ..tokenizer import Tokenizer
from .gate import Gate
from .metrics import ServerMetrics
from .page import add_routes
from .schemas import FINISH, NONE, APIError, ChatRequest, CompletionRequest, _Common
from .tools import ToolCallParser, forced_start, parse_all, template_renders_tools
from .worker import Job, ServeSettings, Worker

log = logging.getLogger("specdec.serve")


# -- what the routes share -----------------------------------------------------------------
class Service:
    """One server's models, settings, engine worker and metrics; the routes below call it."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, settings: ServeSettings) -> None:
        self.target, self.draft, self.settings = target, draft, settings
        self.metrics = ServerMetrics()
        self.worker = Worker(target, draft, settings, self.metrics)
        self.context = target.model.args.max_seq_len

    def methods(self) -> list[str]:
        """What a client may ask for here without more weights: plain decoding, the methods
        that need nothing, those of the draft model where the server has one, and the server's
        own default (a head it was started with: a request gets it by naming no method)."""
        usable = {
            name
            for name, spec in DRAFTERS.items()
            if spec.head is None and name != "prediction" and (spec.needs != "draft" or self.draft is not None)
        }
        if self.settings.method:
            usable.add(self.settings.method)
        return [NONE, *sorted(usable - {NONE})]

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist here; this server serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def encode(tokenizer_call: Any, param: str) -> list[int]:
        try:
            return tokenizer_call()
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=param) from exc

    def pool(self, request: Request) -> str:
        """Whose request it is, for what the server keeps from earlier requests (the suffix
        drafter's memory, `DraftSession.pool`; cached rows, `Engine.add`'s pool): one pool per API
        key (the Gate has checked it), one for all where the server has no key or pools them
        (--suffix-shared). The key itself is not kept: a digest names the pool."""
        if not self.settings.api_keys or self.settings.suffix_shared:
            return ""
        return "key-" + hashlib.sha256(request.headers.get("authorization", "").encode()).hexdigest()[:16]

    async def make_job(self, body: _Common, prompt_ids: list[int], max_tokens: int | None, pool: str = "") -> Job:
        """The request's settings checked (the engine's own length rule, in the API's words) and
        its drafter built on the engine thread, drafting from `pool`'s memory."""
        settings, spec = self.settings, body.speculative
        named = spec.method if spec is not None else None
        options = dict(spec.model_extra or {}) if spec is not None else dict(settings.options)
        if spec is not None and not options and named == settings.method:
            options = dict(settings.options)  # (the server's own method, named with k only: as configured)
        prediction = None
        if body.prediction is not None:
            text = body.prediction.text()
            prediction = self.target.tokenizer.encode_text(text) if text else None
        n = (
            max_tokens
            if max_tokens is not None
            else max(1, min(settings.default_max_tokens, self.context - len(prompt_ids)))
        )
        try:
            plan = plan_request(
                target=self.target.name,
                mode=self.target.model.mode,
                draft=self.draft.name if self.draft is not None else None,
                named=named,
                default=settings.method or NONE,
                k=spec.k if spec is not None and spec.k is not None else settings.k,
                predicted=prediction is not None,
                config={"max_new_tokens": n, "stop": body.stop or (), "ignore_eos": body.ignore_eos},
                sampling={"temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p, "seed": body.seed},
            )
        except PlanError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        cfg, sampling = plan.config, plan.sampling
        method = name_of(plan.drafter) or NONE
        if method != (named or settings.method or NONE):
            options = {}  # (a prediction's drafter, not the one the options were given for)
        try:
            plan_length(len(prompt_ids), cfg, self.context, length_name="max_tokens", fix="lower max_tokens")
        except ContextOverflowError as exc:
            too_long = len(prompt_ids) >= self.context
            param = ("messages" if isinstance(body, ChatRequest) else "prompt") if too_long else "max_tokens"
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from exc
        drafter = None
        if method != NONE:
            helper = self.draft if plan.uses_draft else None

            def built() -> Any:  # (on the engine thread: a head is loaded from disk the first time it is asked
                # for, and what the drafter times once per machine is timed before its request's clock starts)
                d = build_drafter(self.target, helper, method, **options)
                prepare(self.target, d)
                return d

            try:
                drafter = await self.worker.call(built)
            except (ValueError, TypeError) as exc:
                raise APIError(400, f"speculative: {exc}", param="speculative") from exc
        req = ApiRequest(prompt_ids, cfg, sampling, drafter, plan.k_source, prediction, body.top_logprobs_asked())
        return Job(req, method, asyncio.get_running_loop(), asyncio.Queue(), pool=pool)

    async def respond(self, request: Request, job: Job, body: _Common, kind: str) -> Response:
        """Run `job` and answer: a stream of server-sent events, or one JSON object."""
        self.worker.submit(job)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            steps = bool(body.stream_options and body.stream_options.include_steps)
            return StreamingResponse(
                self.stream(job, rid, created, kind, include_usage, steps),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        texts: list[str] = []
        lps: list[TokenLogprob] = []
        events = asyncio.ensure_future(self._drain(job, texts, lps))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({events, gone}, return_when=asyncio.FIRST_COMPLETED)
            if events not in done:  # the client left: free its sequence
                self.worker.cancel(job)
                return Response(status_code=499)
            result = events.result()
        finally:
            gone.cancel()
        text = "".join(texts)
        finish = FINISH[result.finish_reason]
        tok = self.target.tokenizer
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if job.tools is not None:
                content, calls = parse_all(text, job.tools, job.start, job.most_calls)
                message["content"] = content
                if calls:
                    message["tool_calls"] = [c.to_dict() for c in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            choice = {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": chat_logprobs(tok, lps) if job.req.logprobs is not None else None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": finish,
                "logprobs": completion_logprobs(tok, lps, 0) if job.req.logprobs is not None else None,
            }
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": created,
                "model": self.settings.model_name,
                "choices": [choice],
                "usage": usage(job, result),
            }
        )

    async def _drain(self, job: Job, texts: list[str], lps: list[TokenLogprob]) -> GenerationResult:
        while True:
            kind, value = await job.events.get()
            if kind == "error":
                raise value
            if kind == "done":
                self.metrics.e2e.observe(time.perf_counter() - job.arrived)
                return value
            self.observe_delta(job, value)
            texts.append(value.text)
            lps += value.logprobs or ()

    def observe_delta(self, job: Job, d: Delta) -> None:
        now = time.perf_counter()
        n = len(d.token_ids)
        if n:
            self.metrics.generated.inc(n)
            if job.last_token_at is None:
                self.metrics.ttft.observe(now - job.arrived)
            else:
                for _ in range(n):
                    self.metrics.itl.observe((now - job.last_token_at) / n)
            job.last_token_at = now

    async def stream(
        self, job: Job, rid: str, created: int, kind: str, include_usage: bool, steps: bool = False
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return (
                "data: "
                + json.dumps(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": self.settings.model_name,
                        "choices": choices,
                        **extra,
                    }
                )
                + "\n\n"
            )

        tok = self.target.tokenizer
        parser = (
            ToolCallParser(job.tools, job.start, job.most_calls) if kind == "chat" and job.tools is not None else None
        )
        calls = 0  # tool calls streamed so far
        offset = 0  # (completions' text_offset)

        def choice(
            text: str | None,
            finish: str | None,
            role: bool = False,
            lps: list[TokenLogprob] | None = None,
            call: Any = None,
        ) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {} if text is None else {"content": text}
                if role:
                    delta["role"] = "assistant"
                if call is not None:
                    delta["tool_calls"] = [call]
                return {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": chat_logprobs(tok, lps) if lps is not None else None,
                }
            return {
                "index": 0,
                "text": text or "",
                "finish_reason": finish,
                "logprobs": completion_logprobs(tok, lps, offset) if lps is not None else None,
            }

        def said(events: list[tuple[str, Any]], lps: list[TokenLogprob] | None, trace: dict[str, Any]) -> list[str]:
            """Chunks for what the tool-call parser lets through: text, and each call as OpenAI
            streams one (its id and name, then its arguments); the step's logprobs and trace on
            the first."""
            nonlocal calls
            out = []
            for ev, value in events or [("content", "")]:
                if ev == "content":
                    if value or lps is not None or trace:
                        out.append(chunk([choice(value, None, lps=lps)], **trace))
                else:
                    head = {
                        "index": calls,
                        "id": value.id,
                        "type": "function",
                        "function": {"name": value.name, "arguments": ""},
                    }
                    out.append(chunk([choice(None, None, lps=lps, call=head)], **trace))
                    out.append(
                        chunk([choice(None, None, call={"index": calls, "function": {"arguments": value.arguments}})])
                    )
                    calls += 1
                lps, trace = None, {}
            return out

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
                    self.metrics.e2e.observe(time.perf_counter() - job.arrived)
                    finish = FINISH[value.finish_reason]
                    if parser is not None:
                        for c in said(parser.finish(), None, {}):
                            yield c
                        finish = "tool_calls" if calls and finish == "stop" else finish
                    yield chunk([choice(None if kind == "chat" else "", finish)])
                    if include_usage:
                        yield chunk([], usage=usage(job, value))
                    break
                self.observe_delta(job, value)
                lps = list(value.logprobs) if job.req.logprobs is not None and value.logprobs else None
                trace = {"speculative": step_trace(tok, value)} if steps and value.token_ids else {}
                if parser is not None:
                    for c in said(parser.feed(value.text), lps, trace):
                        yield c
                elif value.text or lps or trace:
                    yield chunk([choice(value.text, None, lps=lps)], **trace)
                    offset += len(value.text)
            finished = True
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client disconnected mid-stream: its sequence ends at the next step
                self.worker.cancel(job)


def step_trace(tok: Tokenizer, d: Delta) -> dict[str, Any]:
    """A streamed chunk's `speculative` field (`stream_options.include_steps`): the pass that
    committed its tokens (`engine.Step`; pass 0: the prefill's first token), its tokens, and how
    many of the chunk's first characters are accepted drafts — the rest is the target's own
    token (the split is by the text the step released: approximate where a stop string held
    some back)."""
    step = d.step.to_dict() if d.step is not None else {"pass": 0, "proposed": 0, "accepted": 0, "by": None}
    drafted = min(step["accepted"], len(d.token_ids))
    own = len(tok.decode(d.token_ids[drafted:])) if drafted < len(d.token_ids) else 0
    return step | {"tokens": len(d.token_ids), "drafted_chars": max(0, len(d.text) - own) if drafted else 0}


def usage(job: Job, result: GenerationResult) -> dict[str, Any]:
    m = result.metrics
    predicted = m.drafter_info.get("prediction") or {}
    u: dict[str, Any] = {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": m.new_tokens,
        "total_tokens": m.prompt_tokens + m.new_tokens,
        "prompt_tokens_details": {"cached_tokens": m.cached_tokens},
        # the prediction's tokens the target verified and kept, and those it did not
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": predicted.get("accepted_tokens", 0),
            "rejected_prediction_tokens": predicted.get("rejected_tokens", 0),
        },
    }
    u["speculative"] = {
        "method": job.method,
        "k": job.req.config.k if job.method != NONE else None,
        "draft_tokens": m.proposed,
        "accepted_tokens": m.accepted,
        "target_passes": m.steps,
        "acceptance_rate": m.acceptance_rate,
        "tokens_per_pass": m.mean_accepted_tokens,
    }
    return u


def _alternatives(tok: Tokenizer, lp: TokenLogprob) -> list[dict[str, Any]]:
    return [{"token": _text(tok, t), "logprob": v, "bytes": list(tok.token_bytes(t))} for t, v in lp.top]


def _text(tok: Tokenizer, token: int) -> str:
    return tok.token_bytes(token).decode("utf-8", errors="replace")


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprob]) -> dict[str, Any]:
    """Chat completions' `logprobs`: per token its text, logprob, bytes and alternatives."""
    return {
        "content": [
            {
                "token": _text(tok, lp.token),
                "logprob": lp.logprob,
                "bytes": list(tok.token_bytes(lp.token)),
                "top_logprobs": _alternatives(tok, lp),
            }
            for lp in lps
        ],
        "refusal": None,
    }


def completion_logprobs(tok: Tokenizer, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Legacy completions' `logprobs`: parallel lists (and each token's offset in the text)."""
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(_text(tok, lp.token))
    return {
        "tokens": [_text(tok, lp.token) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_text(tok, t): v for t, v in lp.top} for lp in lps] if any(lp.top for lp in lps) else None,
        "text_offset": offsets,
    }


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


def _service(request: Request) -> Service:
    return request.app.state.service


# -- the routes ----------------------------------------------------------------------------
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    svc = _service(request)
    svc.check_model(body.model)
    body.check()
    messages = [m.for_template() for m in body.messages]
    tokenizer = svc.target.tokenizer
    if not tokenizer.has_chat_template:
        raise APIError(400, f"{svc.settings.model_name} has no chat template; use /v1/completions", param="messages")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()] if body.tools_on() else None
    if tools and not template_renders_tools(tokenizer.hf.chat_template):
        raise APIError(
            400,
            f"the chat template of {svc.settings.model_name} does not render tools; send the "
            "request without tools (or with tool_choice 'none')",
            param="tools",
        )
    ids = svc.encode(lambda: tokenizer.encode_chat(messages, tools=tools), "messages")
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice
    start = forced_start(choice, [t["function"]["name"] for t in tools]) if tools else ""
    if start:  # the turn starts with the call's opening; the model writes the rest
        ids += tokenizer.encode_text(start)
    job = await svc.make_job(body, ids, body.max_completion_tokens or body.max_tokens, svc.pool(request))
    if tools:
        job.tools, job.start = frozenset(t["function"]["name"] for t in tools), start
        job.most_calls = None if body.parallel_tool_calls else 1
    return await svc.respond(request, job, body, "chat")


async def completions(body: CompletionRequest, request: Request) -> Response:
    svc = _service(request)
    svc.check_model(body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (n = 1)", param="prompt")
        prompt = prompt[0]
    if body.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix")
    ids = svc.encode(lambda: encode_prompt(svc.target.tokenizer, prompt, chat=False), "prompt")  # type: ignore[arg-type]
    job = await svc.make_job(body, ids, body.max_tokens, svc.pool(request))
    return await svc.respond(request, job, body, "completion")


async def list_models(request: Request) -> dict[str, Any]:
    svc = _service(request)
    return {
        "object": "list",
        "data": [
            {
                "id": svc.settings.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "specdec",
                "max_model_len": svc.context,
            }
        ],
    }


async def health(request: Request) -> dict[str, Any]:
    svc = _service(request)
    worker = svc.worker
    if not worker.alive():
        raise APIError(503, "the engine thread is not running", type="server_error")
    return {
        "status": "ok",
        "model": worker.settings.model_name,
        "batch": len(worker.jobs),
        "queue": len(worker.waiting),
        # (for the page: whether to ask for a key, and the methods it may offer)
        "keys": bool(worker.settings.api_keys),
        "method": worker.settings.method or NONE,
        "methods": svc.methods(),
        "draft": svc.draft.name if svc.draft is not None else None,
    }


async def prometheus(request: Request) -> Response:
    return Response(generate_latest(_service(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
    msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    return APIError(400, f"{'.'.join(loc) or 'body'}: {msg}", param=".".join(loc) or None).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("request failed:\n%s", traceback.format_exc())
    return APIError(500, "internal server error", type="server_error").response()


# -- the app -------------------------------------------------------------------------------
def create_app(
    target: LoadedModel, draft: LoadedModel | None, settings: ServeSettings, engine_thread: bool = True
) -> FastAPI:
    """The ASGI app. `engine_thread`: its worker runs in a thread of its own from startup to
    shutdown; otherwise the caller runs `app.state.worker.run()` (as `serve` does, on the main
    thread) and shutdown stops it."""
    service = Service(target, draft, settings)
    worker = service.worker

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine_thread:
            worker.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.worker, app.state.metrics, app.state.settings = worker, service.metrics, settings
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    add_routes(app)
    app.add_middleware(Gate, limit=settings.max_body_bytes, api_keys=settings.api_keys, metrics=service.metrics)  # type: ignore[arg-type]
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
        sock.listen(2048)  # from here a client's connection waits in the queue, never refused
    except OSError as exc:
        raise ValueError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host"
        ) from exc
    app = create_app(target, draft, settings, engine_thread=False)
    log.info("preparing %s (pass times, the default drafter) before listening", settings.model_name)
    app.state.worker.prepare(warm=True)
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
