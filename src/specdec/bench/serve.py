"""`specdec bench serve`: load-test a running `specdec serve` (or any OpenAI-compatible server)
on this machine.

For each concurrency level C, N streaming chat requests (prompts of the bundled suite, in
turn) are sent with at most C in flight; each request's time to first token, total latency
and completion tokens (from the stream's final usage chunk) are recorded. Reported per level:
aggregate completion tokens/s over the level's wall time, TTFT and latency p50/p90/p99, mean
inter-token latency, and the server's speculative figures where it reports them. A table on
stdout, DIR/serve.json and DIR/serve.png.

Bounded: localhost only (the URL's host must be a loopback address), at most MAX_REQUESTS
requests per level, a wall-clock limit per level after which what is still running is
cancelled and counted as failed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from . import save_figure, write_page
from .suite import load_prompts

MAX_REQUESTS = 1000


@dataclass(frozen=True)
class ServeBenchSettings:
    url: str = "http://127.0.0.1:8000"
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 32  # per concurrency level
    max_tokens: int = 64
    model: str | None = None  # default: the server's first model
    speculative: dict[str, Any] | None = None  # the extra body field, e.g. {"method": "none"}
    temperature: float = 0.0
    api_key: str | None = None
    level_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        host = urlparse(self.url).hostname
        if urlparse(self.url).scheme not in ("http", "https") or host is None:
            raise ValueError(f"--url must look like http://127.0.0.1:8000, got {self.url!r}")
        if not _loopback(host):
            raise ValueError(f"--url must point at this machine (a loopback address), got host {host!r}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("--concurrency takes levels >= 1")
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise ValueError(f"--requests must be in 1..{MAX_REQUESTS}")
        if self.max_tokens < 1 or self.level_timeout_s <= 0:
            raise ValueError("--max-tokens and --timeout must be positive")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


@dataclass
class RequestStat:
    ok: bool
    ttft: float | None = None
    latency: float | None = None
    tokens: int = 0
    error: str | None = None
    speculative: dict[str, Any] | None = None
    text: str = ""
    details: dict[str, Any] | None = None  # usage.completion_tokens_details (the prediction's counts)
    tool_calls: int = 0


@dataclass
class Level:
    concurrency: int
    wall_s: float
    stats: list[RequestStat] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.stats if s.ok]
        ttft = sorted(s.ttft for s in ok if s.ttft is not None)
        lat = sorted(s.latency for s in ok if s.latency is not None)
        tokens = sum(s.tokens for s in ok)
        itl = [(s.latency - s.ttft) / (s.tokens - 1) for s in ok if s.tokens > 1 and s.ttft is not None and s.latency]
        drafted = sum((s.speculative or {}).get("draft_tokens") or 0 for s in ok)
        accepted = sum((s.speculative or {}).get("accepted_tokens") or 0 for s in ok)
        return {
            "concurrency": self.concurrency,
            "requests": len(self.stats),
            "failed": len(self.stats) - len(ok),
            "wall_s": round(self.wall_s, 3),
            "completion_tokens": tokens,
            "tokens_per_second": tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "requests_per_second": len(ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_s": percentiles(ttft),
            "latency_s": percentiles(lat),
            "inter_token_s_mean": statistics.fmean(itl) if itl else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "errors": sorted({s.error for s in self.stats if s.error})[:5],
        }


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None}

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


async def one_request(
    client: Any,
    model: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
    temperature: float,
    speculative: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> RequestStat:
    """One streaming chat request: its time to first token, latency, completion tokens and text
    (tool calls streamed appended to it as `name(arguments)`, so that answers compare whole).
    `extra`: more body fields (prediction, tools, tool_choice)."""
    t0 = time.perf_counter()
    first = None
    usage = None
    texts: list[str] = []
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if speculative is not None:
        body["speculative"] = speculative
    body.update(extra or {})
    calls: dict[int, list[str]] = {}  # tool call index -> [name, arguments so far]
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestStat(False, error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestStat(False, error=str(chunk["error"].get("message")))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                delta = (choices[0].get("delta") or {}) if choices else {}
                content = delta.get("content")
                if content:
                    texts.append(content)
                for tc in delta.get("tool_calls") or ():
                    call = calls.setdefault(tc["index"], ["", ""])
                    call[0] += (tc.get("function") or {}).get("name") or ""
                    call[1] += (tc.get("function") or {}).get("arguments") or ""
                if (content or delta.get("tool_calls")) and first is None:
                    first = time.perf_counter() - t0
    except Exception as exc:  # a load test reports failures, it does not stop at the first
        return RequestStat(False, error=f"{type(exc).__name__}: {exc}")
    tokens = int((usage or {}).get("completion_tokens") or 0)
    said = "".join(texts) + "".join(f"\n{name}({args})" for name, args in (calls[i] for i in sorted(calls)))
    return RequestStat(
        True,
        first,
        time.perf_counter() - t0,
        tokens,
        speculative=(usage or {}).get("speculative"),
        text=said,
        details=(usage or {}).get("completion_tokens_details"),
        tool_calls=len(calls),
    )


async def _level(s: ServeBenchSettings, model: str, conversations: list[list[dict[str, str]]], c: int) -> Level:
    import httpx

    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient(base_url=s.url, headers=headers, timeout=s.level_timeout_s, limits=limits) as client:

        async def bounded(i: int) -> RequestStat:
            async with sem:
                return await one_request(
                    client, model, conversations[i % len(conversations)], s.max_tokens, s.temperature, s.speculative
                )

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(bounded(i)) for i in range(s.requests)]
        done, pending = await asyncio.wait(tasks, timeout=s.level_timeout_s)
        for t in pending:
            t.cancel()
        wall = time.perf_counter() - t0
        stats = [t.result() if t in done else RequestStat(False, error="timed out") for t in tasks]
    return Level(c, wall, stats)


def run(s: ServeBenchSettings, progress: Any = None) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    try:
        models = httpx.get(s.url + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ValueError(f"no server answers at {s.url} ({exc}); start one with `specdec serve`") from exc
    if models.status_code != 200:
        raise ValueError(f"{s.url}/v1/models answered HTTP {models.status_code}: {models.text[:200]}")
    model = s.model or models.json()["data"][0]["id"]
    conversations = [list(p.turns) for p in load_prompts()]
    conversations.sort(key=lambda t: sum(len(m["content"]) for m in t))
    conversations = conversations[
        : max(8, len(conversations) // 2)
    ]  # the shorter half: a load test, not a prefill test
    levels = []
    for c in s.concurrency:
        if progress:
            progress(f"concurrency {c}: {s.requests} requests")
        levels.append(asyncio.run(_level(s, model, conversations, c)))
    return {"settings": asdict(s), "model": model, "levels": [lv.summary() for lv in levels]}


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'conc':>4s} {'ok/all':>7s} {'tok/s':>7s} {'req/s':>6s} {'TTFT p50':>9s} {'p99':>7s} "
        f"{'lat p50':>8s} {'p99':>7s} {'ITL ms':>7s} {'alpha':>6s}"
    )
    lines = [
        f"{result['model']} at {result['settings']['url']}, max_tokens {result['settings']['max_tokens']}",
        head,
        "-" * len(head),
    ]

    def f(x: float | None, scale: float = 1.0, fmt: str = "7.2f") -> str:
        return "–".rjust(int(fmt.split(".")[0])) if x is None else format(x * scale, fmt)

    for lv in result["levels"]:
        ok = f"{lv['requests'] - lv['failed']}/{lv['requests']}"
        lines.append(
            f"{lv['concurrency']:4d} {ok:>7s} {lv['tokens_per_second']:7.1f} {lv['requests_per_second']:6.2f} "
            f"{f(lv['ttft_s']['p50'], fmt='9.2f')} {f(lv['ttft_s']['p99'])} {f(lv['latency_s']['p50'], fmt='8.2f')} "
            f"{f(lv['latency_s']['p99'])} {f(lv['inter_token_s_mean'], 1e3, '7.1f')} "
            f"{f(lv['acceptance_rate'], fmt='6.2f')}"
        )
        for e in lv["errors"]:
            lines.append(f"     error: {e}")
    return "\n".join(lines)


def write(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """serve.json, serve.png (throughput and latency percentiles by concurrency) and serve.html
    (the table and the plot as one page)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "serve.json"
    path.write_text(json.dumps(result, indent=1))
    lv = result["levels"]
    cs = [x["concurrency"] for x in lv]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(cs, [x["tokens_per_second"] for x in lv], marker="o")
    ax1.set(xlabel="concurrent requests", ylabel="completion tokens/s", title="throughput")
    for key, style in (("ttft_s", "--"), ("latency_s", "-")):
        for p, color in (("p50", "C0"), ("p99", "C3")):
            ax2.plot(
                cs,
                [x[key][p] for x in lv],
                ls=style,
                color=color,
                marker="o",
                label=f"{'TTFT' if key == 'ttft_s' else 'latency'} {p}",
            )
    ax2.set(xlabel="concurrent requests", ylabel="seconds", title="time to first token and request latency")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
    ax2.legend(fontsize=8)
    fig.suptitle(f"{result['model']} ({result['settings']['url']})", fontsize=9)
    png = save_figure(fig, out_dir / "serve.png")
    page = write_page(out_dir, "serve.html", f"specdec bench serve: {result['model']}", table(result), png)
    print(f"wrote {path}\nwrote {png}\nwrote {page}", file=sys.stderr)
    return [path, png, page]
