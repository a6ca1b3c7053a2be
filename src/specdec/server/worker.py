"""The engine thread: one `Engine` stepping every live request together."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..api import LoadedModel, Request, build_drafter
from ..api import submit as submit_request
from ..config import DEFAULT_K
from ..costs import batch_drafting_pays
from ..drafters.base import uses_draft_model
from ..engine import Engine
from .metrics import ServerMetrics
from .schemas import NONE, APIError

log = logging.getLogger("specdec.serve")


# Finished requests' rows kept for later prompts that begin the same way (`model.prefix`):
# ~0.9 GiB with the default 1.5B target's float32 cache.
PREFIX_TOKENS = 16384


@dataclass
class ServeSettings:
    model_name: str  # the id clients send as "model"
    method: str | None = None  # the default drafting method (None: plain decoding)
    options: dict[str, Any] = field(default_factory=dict)  # the default method's options
    k: int | None = None  # None: the method's own default (`drafters.base.resolve_k`)
    max_batch: int = 8
    max_queue: int = 256  # waiting requests beyond the batch; more get 429
    default_max_tokens: int = 512
    api_keys: tuple[str, ...] = ()  # accepted keys, one per client (none: open)
    # what the server keeps from requests (suffix memory, cached rows) is one pool for all keys
    suffix_shared: bool = False
    prefix_tokens: int = PREFIX_TOKENS  # finished requests' rows kept for later prompts (0: none)
    max_body_bytes: int = 1 << 20
    batch_guard: bool = True  # drafting off for steps whose batch leaves it no room


@dataclass
class Job:
    """A request between the HTTP handler (event loop) and the worker thread."""

    req: Request  # what the engine runs (`api.submit`): built as every front end builds one
    method: str  # "none" or a drafter name
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[str, Any]]  # ("delta", Delta) | ("done", GenerationResult) | ("error", APIError)
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None  # when its latest tokens reached the handler (None: none yet)
    seq_id: int | None = None
    cancelled: bool = False
    pool: str = ""  # whose earlier requests it may draw on (`Service.pool`)
    tools: frozenset[str] | None = None  # the functions offered, where the output is parsed for calls
    start: str = ""  # text the assistant's turn was started with (a forced tool call's opening)
    most_calls: int | None = None  # 1 where the request asked for no parallel tool calls

    def post(self, kind: str, value: Any) -> None:  # (from the worker thread)
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    """Owns the engine; runs steps while there is work, sleeps on its inbox otherwise."""

    def __init__(
        self, target: LoadedModel, draft: LoadedModel | None, settings: ServeSettings, metrics: ServerMetrics
    ) -> None:
        self.target, self.draft, self.settings, self.metrics = target, draft, settings, metrics
        self.engine = Engine(target.model, target.tokenizer, prefix_tokens=settings.prefix_tokens)
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

    def prepare(self, warm: bool = False) -> None:
        """What the first request would otherwise wait for, done before the server listens: the
        target's pass time per row count for the batch guard (timed once per machine, then read
        from the cache), and with `warm` the default drafter built once and prepared as every
        request's is (`api.prepare`: the pass table the step controllers read, a draft model's
        step timed, a head loaded). Nothing is generated, so no request learns from it."""
        from ..api import prepare
        from ..costs import pass_costs

        s = self.settings
        k = s.k if s.k is not None else DEFAULT_K
        guard_rows = min(64, s.max_batch * (k + 1)) if s.batch_guard and s.max_batch > 1 else 0
        if warm:
            drafter = None
            if s.method is not None:
                helper = self.draft if uses_draft_model(s.method) else None
                drafter = build_drafter(self.target, helper, s.method, **s.options)
            prepare(self.target, drafter)
        if guard_rows and self.costs is None:
            self.costs = pass_costs(self.target.model, guard_rows)

    # -- the thread ------------------------------------------------------------------------
    def run(self, keep_going: Any = None) -> None:
        """The loop, in the calling thread, until `stop` (or until `keep_going()` turns false,
        checked while idle: the HTTP thread died)."""
        self.running.set()
        try:
            self.prepare()
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
                job.seq_id = submit_request(self.engine, job.req, job.pool)
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
        # drafts per sequence, the plain ones counted as 0: the rows each has sent of late, or
        # before it has drafted, its k (a drafter that sizes its own trees: at most DEFAULT_K)
        k = sum(
            rows
            if (rows := self.engine.draft_rows(j.seq_id)) is not None
            # type: ignore[arg-type]
            else min(j.req.config.k, DEFAULT_K)
            for j in drafting
        ) / len(live)
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
            self.engine = Engine(self.target.model, self.target.tokenizer, prefix_tokens=self.settings.prefix_tokens)
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
