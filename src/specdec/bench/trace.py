"""`specdec bench serve --trace`: replay an agent trace through `specdec serve`, per method
against plain decoding.

An agent trace (JSONL, one request per line: `conversation`, `turn`, `messages`, `max_tokens`;
optionally `tools` and `tool_choice`, sent as they are, and `prediction`, the text the client
expects back) holds sessions in which every request resends the growing conversation, as a coding
agent does; the bundled one (`bench/prompts/agent_trace.jsonl`, built by `benchmarks/agent_trace.py`
from HumanEval tasks with the target itself, with tool calls) is the default, and `--trace edit`
replays the bundled edit trace (`bench/prompts/edit_trace.jsonl`, `benchmarks/edit_trace.py`: change
a small file, reply with the whole file). A line's `prediction` is sent only to the methods that
draft from it: `prediction`, and any method named with `+prediction` (`auto+prediction`); the others
replay the same requests without it. Each method gets a server of its own in this process (the app
`specdec serve` runs, on a free localhost port, prepared before it listens), started with no memory
of earlier requests, so what suffix decoding learns from one method's replay never drafts for
another's. Within a conversation the turns go one after another; `concurrency` conversations run at
once. Greedy (temperature 0): every method's answers are checked equal to plain decoding's. Plain
decoding runs first and again last (its second run against its first is the noise control). Reported
per method: completion tokens/s over the replay's wall time and its ratio to plain's, request
latency and time to first token (p50, p90), acceptance, and the memory suffix decoding holds after
the replay.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import registry
from ..server.worker import PREFIX_TOKENS
from .serve import RequestStat, one_request, percentiles

TRACE = Path(__file__).parent / "prompts" / "agent_trace.jsonl"
BUNDLED = {"agent": TRACE, "edit": Path(__file__).parent / "prompts" / "edit_trace.jsonl"}
PLAIN, NOISE = "none", "none-again"
WITH_PREDICTION = "+prediction"  # a method so named is sent the trace's predictions


def sends_prediction(method: str) -> bool:
    return method == "prediction" or method.endswith(WITH_PREDICTION)


@dataclass(frozen=True)
class TraceSettings:
    trace: str | None = None  # None: the bundled agent trace
    target: str = registry.DEFAULT_TARGET
    draft: str | None = None  # for draft-model and auto
    methods: tuple[str, ...] = ("suffix", "prompt-lookup", "auto")
    concurrency: int = 1  # conversations at once
    conversations: int | None = None  # the first N (None: all)
    dtype: str = "auto"
    timeout_s: float = 3600.0  # per method, at most
    prefix_tokens: int = PREFIX_TOKENS  # the server's cache of finished requests' rows (0: off)

    def __post_init__(self) -> None:
        from ..drafters import DRAFTERS

        unknown = [m for m in self.methods if m.removesuffix(WITH_PREDICTION) not in DRAFTERS]
        if unknown or not self.methods:
            raise ValueError(
                f"unknown methods {unknown}; choose from {', '.join(DRAFTERS)} (a name with "
                f"{WITH_PREDICTION}: sent the trace's predictions)"
            )
        if self.prefix_tokens < 0:
            raise ValueError(f"--prefix-cache-tokens must be >= 0 (0: off), got {self.prefix_tokens}")
        if self.concurrency < 1 or (self.conversations is not None and self.conversations < 1):
            raise ValueError("--concurrency and --conversations must be at least 1")


def load_trace(path: str | Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """Conversation -> its requests in turn order; errors name the line."""
    path = BUNDLED[str(path)] if str(path) in BUNDLED else Path(path) if path is not None else TRACE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror}") from None
    out: dict[str, list[dict[str, Any]]] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            conv, turn, messages, max_tokens = rec["conversation"], rec["turn"], rec["messages"], rec["max_tokens"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}:{n}: a trace line is a JSON object with conversation, turn, messages and "
                f"max_tokens ({type(exc).__name__}: {exc})"
            ) from None
        if not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)
        ):
            raise ValueError(f"{path}:{n}: messages must be a non-empty list of {{role, content}} objects")
        if not isinstance(rec.get("prediction", ""), str) or not isinstance(rec.get("tools", []), list):
            raise ValueError(f"{path}:{n}: a prediction is text and tools a list of tool definitions")
        if not isinstance(max_tokens, int) or max_tokens < 1 or not isinstance(turn, int):
            raise ValueError(f"{path}:{n}: turn must be an integer and max_tokens a positive integer")
        out.setdefault(str(conv), []).append(rec)
    if not out:
        raise ValueError(f"the trace {path} holds no requests")
    for reqs in out.values():
        reqs.sort(key=lambda r: r["turn"])
    return out


class _Server:
    """The app `specdec serve` runs, on a free localhost port, in a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            async def startup(inner, sockets: Any = None) -> None:  # noqa: N805
                await super().startup(sockets=sockets)
                self.ready.set()

        self.ready = threading.Event()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        if not self.ready.wait(300):
            raise RuntimeError("the server did not start")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(120)


async def _replay(
    url: str,
    model: str,
    convs: dict[str, list[dict[str, Any]]],
    concurrency: int,
    timeout_s: float,
    prediction: bool = False,
) -> tuple[float, dict[tuple[str, int], RequestStat]]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    stats: dict[tuple[str, int], RequestStat] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def conversation(name: str, reqs: list[dict[str, Any]]) -> None:
            async with sem:
                for r in reqs:  # (each turn after the one before: the agent waits for its answer)
                    extra = {k: r[k] for k in ("tools", "tool_choice") if k in r}
                    if prediction and r.get("prediction"):
                        extra["prediction"] = {"type": "content", "content": r["prediction"]}
                    stats[(name, r["turn"])] = await one_request(
                        client, model, r["messages"], r["max_tokens"], 0.0, extra=extra
                    )

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(conversation(n, rs) for n, rs in convs.items())), timeout_s)
        return time.perf_counter() - t0, stats


def run(s: TraceSettings, progress: Any = None) -> dict[str, Any]:
    from ..api import load, load_draft
    from ..drafters.base import uses_draft_model
    from ..drafters.suffix import STORE
    from ..engine import PREFIXES
    from ..memory import pools_of
    from ..runtime import forget
    from ..server import ServeSettings, create_app
    from .grid import machine

    convs = load_trace(s.trace)
    if s.conversations is not None:
        convs = dict(list(convs.items())[: s.conversations])
    target = load(s.target, dtype=s.dtype)
    draft = load_draft(s.draft, dtype=s.dtype) if s.draft else None
    if draft is None and any(
        m.removesuffix(WITH_PREDICTION) != "auto" and uses_draft_model(m.removesuffix(WITH_PREDICTION))
        for m in s.methods
    ):
        raise ValueError("the draft-model method needs a draft model (--draft NAME)")
    runs: dict[str, dict[str, Any]] = {}
    plain_texts: dict[tuple[str, int], str] = {}
    memory: dict[str, Any] = {}
    prefixes: dict[str, Any] = {}
    for method in (PLAIN, *s.methods, NOISE):
        forget(target.model)  # no memory of another method's replay (suffix stores, acceptance)
        name = None if method in (PLAIN, NOISE) else method.removesuffix(WITH_PREDICTION)
        helper = draft if name is not None and uses_draft_model(name) else None
        settings = ServeSettings(target.name, name, {}, max_batch=max(8, s.concurrency), prefix_tokens=s.prefix_tokens)
        app = create_app(target, helper, settings)
        app.state.worker.prepare(warm=True)
        server = _Server(app)
        try:
            if progress:
                progress(f"{method}: {sum(len(r) for r in convs.values())} requests in {len(convs)} conversations")
            wall, stats = asyncio.run(
                _replay(server.url, target.name, convs, s.concurrency, s.timeout_s, prediction=sends_prediction(method))
            )
        finally:
            server.close()
        if method == PLAIN:
            plain_texts = {key: st.text for key, st in stats.items()}
        px = PREFIXES.get(target.model)
        if px is not None:
            prefixes[method] = {"tokens": px.tokens, "reused_tokens": px.reused, "hits": px.hits}
        stores = [st for m in pools_of(target.model).pools.values() if (st := m.get(STORE)) is not None]
        if stores:
            memory[method] = {
                "tokens": sum(st.tokens for st in stores),
                "bytes": sum(st.bytes() for st in stores),
            }
        runs[method] = _summary(wall, stats, plain_texts)
    base = runs[PLAIN]["tokens_per_second"]
    for r in runs.values():
        r["speedup"] = r["tokens_per_second"] / base if base else None
    forget(target.model)
    return {
        "settings": asdict(s),
        "machine": machine(),
        "mode": target.model.mode,
        "model": target.name,
        "requests": sum(len(r) for r in convs.values()),
        "conversations": len(convs),
        "methods": runs,
        "suffix_memory": memory,
        "prefix_cache": prefixes,
    }


def _summary(
    wall: float, stats: dict[tuple[str, int], RequestStat], plain: dict[tuple[str, int], str]
) -> dict[str, Any]:
    ok = [st for st in stats.values() if st.ok]
    tokens = sum(st.tokens for st in ok)
    drafted = sum((st.speculative or {}).get("draft_tokens") or 0 for st in ok)
    accepted = sum((st.speculative or {}).get("accepted_tokens") or 0 for st in ok)
    details = [st.details or {} for st in ok]
    return {
        "requests": len(stats),
        "failed": len(stats) - len(ok),
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "latency_s": percentiles(sorted(st.latency for st in ok if st.latency is not None)),
        "ttft_s": percentiles(sorted(st.ttft for st in ok if st.ttft is not None)),
        "acceptance_rate": accepted / drafted if drafted else None,
        "identical": all(plain.get(key) == st.text for key, st in stats.items()) if plain else None,
        "prediction_tokens": {
            "accepted": sum(d.get("accepted_prediction_tokens") or 0 for d in details),
            "rejected": sum(d.get("rejected_prediction_tokens") or 0 for d in details),
        },
        "tool_calls": sum(st.tool_calls for st in ok),
        "requests_with_tool_calls": sum(st.tool_calls > 0 for st in ok),
        "errors": sorted({st.error for st in stats.values() if st.error})[:5],
        # (each request, to tell which conversations and turns a method wins or loses)
        "per_request": [
            {
                "conversation": conv,
                "turn": turn,
                "ok": st.ok,
                "tokens": st.tokens,
                "latency_s": None if st.latency is None else round(st.latency, 3),
                "ttft_s": None if st.ttft is None else round(st.ttft, 3),
                "drafted": (st.speculative or {}).get("draft_tokens"),
                "accepted": (st.speculative or {}).get("accepted_tokens"),
            }
            for (conv, turn), st in stats.items()
        ],
    }


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'method':19s} {'ok/all':>7s} {'tok/s':>7s} {'speedup':>8s} {'lat p50':>8s} {'p90':>7s} "
        f"{'TTFT p50':>9s} {'alpha':>6s} {'pred. acc/rej':>13s} {'calls':>5s} identical"
    )
    lines = [
        f"trace: {result['requests']} requests in {result['conversations']} conversations, "
        f"{result['model']} ({result['mode']}), concurrency {result['settings']['concurrency']}",
        head,
        "-" * len(head),
    ]

    def f(x: float | None, fmt: str) -> str:
        return "–".rjust(int(fmt.split(".")[0])) if x is None else format(x, fmt)

    for method, r in result["methods"].items():
        ok = f"{r['requests'] - r['failed']}/{r['requests']}"
        same = "–" if r["identical"] is None else "yes" if r["identical"] else "NO"
        pred = r.get("prediction_tokens") or {}
        pred_s = f"{pred['accepted']}/{pred['rejected']}" if pred.get("accepted") or pred.get("rejected") else "–"
        lines.append(
            f"{method:19s} {ok:>7s} {r['tokens_per_second']:7.1f} {f(r['speedup'], '7.2f')}x "
            f"{f(r['latency_s']['p50'], '8.2f')} {f(r['latency_s']['p90'], '7.2f')} "
            f"{f(r['ttft_s']['p50'], '9.2f')} {f(r['acceptance_rate'], '6.2f')} {pred_s:>13s} "
            f"{r.get('tool_calls', 0):5d} {same}"
        )
        for e in r["errors"]:
            lines.append(f"     error: {e}")
    for method, m in result.get("prefix_cache", {}).items():
        lines.append(
            f"prefix cache after {method}: {m['reused_tokens']} prompt tokens reused in {m['hits']} requests, "
            f"{m['tokens']} tokens held"
        )
    for method, m in result["suffix_memory"].items():
        lines.append(f"suffix memory after {method}: {m['tokens']} tokens, {m['bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)


def write(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """trace.json, trace.png (tokens/s per method against plain) and trace.html (the table and the
    plot as one page)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import save_figure, write_page

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "trace.json"
    path.write_text(json.dumps(result, indent=1))
    names = list(result["methods"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [result["methods"][n]["speedup"] or 0 for n in names], color="C0")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="tokens/s against plain", title=f"agent trace through specdec serve ({result['model']})")
    png = save_figure(fig, out_dir / "trace.png")
    page = write_page(out_dir, "trace.html", f"specdec bench trace: {result['model']}", table(result), png)
    print(f"wrote {path}\nwrote {png}\nwrote {page}", file=sys.stderr)
    return [path, png, page]
