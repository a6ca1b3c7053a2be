"""The server's goals, measured side by side in one run (issue: `specdec serve`).

1. Single stream: tokens/s of `specdec serve` (a subprocess, requests one at a time through
   HTTP, timed by the client: prefill, HTTP and JSON included) against `specdec.generate`
   in this process with the same method, k and prompts, interleaved prompt by prompt.
2. Concurrency: aggregate tokens/s of C requests at once (plain decoding and the method)
   against one stream of plain decoding; `--repeats` alternating rounds, the median reported.
3. Optionally the same prompts against `llama-cpp-python`'s OpenAI server on the same GGUF
   (`--llama-python PYTHON`: an interpreter that has `llama-cpp-python[server]`), plain and
   with its prompt-lookup drafting, one stream and C at once.

All requests greedy, non-streamed (`usage.completion_tokens` counts the tokens), the shorter
prompts of the bundled suite (chat template), `--max-tokens` each. Prints a table and writes
DIR/serve_goals.json.

    python benchmarks/serve_goals.py --method prompt-lookup --prompts 8 --max-tokens 96 \
        [--llama-python /path/to/venv/bin/python] --out bench-out/serve-goals
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

import specdec
from specdec.bench.suite import load_prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: see {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not start in 600 s")


def request(url: str, model: str, messages: list[dict[str, str]], n: int, extra: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=600,
        json={"model": model, "messages": messages, "max_tokens": n, "temperature": 0, **extra},
    )
    r.raise_for_status()
    body = r.json()
    return {
        "s": time.perf_counter() - t0,
        "tokens": body["usage"]["completion_tokens"],
        "text": body["choices"][0]["message"]["content"],
    }


def concurrent(
    url: str, model: str, convs: list[list[dict[str, str]]], n: int, extra: dict[str, Any]
) -> dict[str, Any]:
    async def one(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> int:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": n, "temperature": 0, **extra},
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    async def everyone() -> list[int]:
        limits = httpx.Limits(max_connections=len(convs))
        async with httpx.AsyncClient(base_url=url, timeout=1200, limits=limits) as client:
            return await asyncio.gather(*(one(client, m) for m in convs))

    t0 = time.perf_counter()
    tokens = asyncio.run(everyone())
    wall = time.perf_counter() - t0
    return {
        "concurrency": len(convs),
        "tokens": sum(tokens),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(tokens) / wall, 2),
    }


def serial_rate(rows: list[dict[str, Any]]) -> float:
    return sum(r["tokens"] for r in rows) / sum(r["s"] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default=None, help="a draft model for --method draft-model")
    ap.add_argument("--method", default="prompt-lookup")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the concurrent runs (the median is reported)")
    ap.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python[server] installed")
    ap.add_argument("--out", type=Path, default=Path("bench-out/serve-goals"))
    ns = ap.parse_args()

    convs = [list(p.turns) for p in load_prompts()]
    convs.sort(key=lambda t: sum(len(m["content"]) for m in t))
    convs = convs[: ns.prompts]
    target = specdec.load(ns.target)
    draft = specdec.load(ns.draft) if ns.draft else None
    spec_kw: dict[str, Any] = {"assistant_model": draft} if ns.method == "draft-model" else {"drafter": ns.method}

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ns.out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "specdec.cli",
        "serve",
        "--target",
        ns.target,
        "--port",
        str(port),
        "-k",
        str(ns.k),
        "--max-batch",
        str(max(ns.concurrency, 1)),
    ]
    cmd += ["--draft", ns.draft] if ns.draft else []
    server = start(cmd, url, ns.out / "server.log")
    result: dict[str, Any] = {
        "target": ns.target,
        "method": ns.method,
        "k": ns.k,
        "max_tokens": ns.max_tokens,
        "prompts": len(convs),
        "machine": specdec_machine(),
    }
    try:
        spec = {"speculative": {"method": ns.method, "k": ns.k}}
        plain = {"speculative": {"method": "none"}}
        request(url, ns.target, convs[0], 8, plain)  # warm-ups: first shapes, first requests
        specdec.generate(target, convs[0], max_new_tokens=8, temperature=0.0)
        rows: dict[str, list[dict[str, Any]]] = {
            "generate_method": [],
            "serve_method": [],
            "generate_plain": [],
            "serve_plain": [],
        }
        same = 0
        for i, messages in enumerate(convs):
            print(f"prompt {i + 1}/{len(convs)}", file=sys.stderr)
            for name, fn in (
                ("generate_method", lambda messages=messages: _gen(target, messages, ns.max_tokens, k=ns.k, **spec_kw)),
                ("serve_method", lambda messages=messages: request(url, ns.target, messages, ns.max_tokens, spec)),
                ("generate_plain", lambda messages=messages: _gen(target, messages, ns.max_tokens)),
                ("serve_plain", lambda messages=messages: request(url, ns.target, messages, ns.max_tokens, plain)),
            ):
                rows[name].append(fn())
            same += rows["serve_method"][-1]["text"] == rows["generate_method"][-1]["text"]
        rates = {name: round(serial_rate(r), 2) for name, r in rows.items()}
        result["single_stream_tokens_per_s"] = rates
        result["single_stream_identical_texts"] = f"{same}/{len(convs)}"
        result["serve_over_generate"] = {
            "method": round(rates["serve_method"] / rates["generate_method"], 3),
            "plain": round(rates["serve_plain"] / rates["generate_plain"], 3),
        }
        group = [convs[i % len(convs)] for i in range(ns.concurrency)]
        rounds: dict[str, list[dict[str, Any]]] = {"plain": [], "method": []}
        for _ in range(ns.repeats):  # alternating, so a passing slowdown of the machine hits both
            rounds["plain"].append(concurrent(url, ns.target, group, ns.max_tokens, plain))
            rounds["method"].append(concurrent(url, ns.target, group, ns.max_tokens, spec))
        result["concurrent"] = {
            name: {
                **sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2],
                "tokens_per_s_all": [r["tokens_per_s"] for r in rs],
            }
            for name, rs in rounds.items()
        }  # (the median round)
        result["concurrent_over_single_plain"] = {
            k: round(v["tokens_per_s"] / rates["serve_plain"], 2) for k, v in result["concurrent"].items()
        }
        result["server_metrics_drafting"] = [
            line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith("specdec_steps_total")
        ]
    finally:
        server.terminate()
        server.wait(60)
    if ns.llama_python:
        result["llama_cpp_python"] = llama(ns, convs)
    (ns.out / "serve_goals.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"wrote {ns.out / 'serve_goals.json'}", file=sys.stderr)
    return 0


def _gen(target: Any, messages: list[dict[str, str]], n: int, **kw: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = specdec.generate(target, messages, max_new_tokens=n, temperature=0.0, **kw)
    return {"s": time.perf_counter() - t0, "tokens": out.metrics.new_tokens, "text": out.text}


def specdec_machine() -> dict[str, Any]:
    from specdec.bench.grid import machine
    from specdec.model import native

    return {**machine(), "kernel_build": native.build_id()}


def llama(ns: argparse.Namespace, convs: list[list[dict[str, str]]]) -> dict[str, Any]:
    """llama-cpp-python's server on the target's own GGUF, plain and with its prompt lookup."""
    from specdec import store
    from specdec.registry import get_spec

    gguf = store.gguf_path(get_spec(ns.target))
    if not gguf.exists():
        raise SystemExit(f"{gguf} is not in the cache; llama-cpp-python needs the GGUF (models install keeps it)")
    out: dict[str, Any] = {"gguf": gguf.name}
    for label, extra in (
        ("plain", []),
        ("prompt-lookup", ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", str(ns.k)]),
    ):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            ns.llama_python,
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf),
            "--port",
            str(port),
            "--n_ctx",
            "4096",
            "--n_threads",
            str(os.cpu_count()),
            "--model_alias",
            ns.target,
            *extra,
        ]
        proc = start(cmd, url, ns.out / f"llama-{label}.log")
        try:
            request(url, ns.target, convs[0], 8, {})
            rows = [request(url, ns.target, m, ns.max_tokens, {}) for m in convs]
            group = [convs[i % len(convs)] for i in range(ns.concurrency)]
            out[label] = {
                "single_stream_tokens_per_s": round(serial_rate(rows), 2),
                "concurrent": concurrent(url, ns.target, group, ns.max_tokens, {}),
            }
        finally:
            proc.terminate()
            proc.wait(60)
    return out


def table(r: dict[str, Any]) -> str:
    s = r["single_stream_tokens_per_s"]
    c = r["concurrent"]
    where = f"{r['machine']['cpu']}, {r['machine']['torch_threads']} threads, kernels {r['machine']['kernel_build']}"
    lines = [
        f"{r['target']}, {r['prompts']} prompts x {r['max_tokens']} tokens, greedy; {where}",
        f"{'':34s} {'tokens/s':>9s}",
        f"{'generate, plain':34s} {s['generate_plain']:9.2f}",
        f"{'serve, plain, 1 stream':34s} {s['serve_plain']:9.2f}   x{r['serve_over_generate']['plain']:.3f} of "
        "generate",
        f"{'generate, ' + r['method']:34s} {s['generate_method']:9.2f}",
        f"{'serve, ' + r['method'] + ', 1 stream':34s} {s['serve_method']:9.2f}   "
        f"x{r['serve_over_generate']['method']:.3f} of generate (texts identical {r['single_stream_identical_texts']})",
        f"{'serve, plain, ' + str(c['plain']['concurrency']) + ' at once':34s} {c['plain']['tokens_per_s']:9.2f}   "
        f"x{r['concurrent_over_single_plain']['plain']:.2f} of one plain stream",
        f"{'serve, ' + r['method'] + ', ' + str(c['method']['concurrency']) + ' at once':34s} "
        f"{c['method']['tokens_per_s']:9.2f}   x{r['concurrent_over_single_plain']['method']:.2f} of one plain stream",
    ]
    for label, v in (r.get("llama_cpp_python") or {}).items():
        if isinstance(v, dict):
            lines.append(f"{'llama-cpp-python, ' + label + ', 1 stream':34s} {v['single_stream_tokens_per_s']:9.2f}")
            lines.append(
                f"{'llama-cpp-python, ' + label + ', ' + str(v['concurrent']['concurrency']) + ' at once':34s} "
                f"{v['concurrent']['tokens_per_s']:9.2f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
