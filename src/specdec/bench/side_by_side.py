"""Our passes and llama.cpp's on the same GGUF file, interleaved round by round.

`specdec bench forward --model FILE.gguf` sets the q4k mode's passes beside llama.cpp's own
timer, `llama-bench` (built once by `specdec bench peers --build`), on the same file: the
one-token pass and passes over k = 2..16 tokens on top of `context` cached tokens (llama-bench's
`-n` and `-p k` at `-d context`), and prefills of N tokens from an empty cache (`-p N`). The
machine's memory speed moves by up to 2x from minute to minute, so neither side is timed in one
block: each round times ours, then runs llama-bench once, and the report takes each round's
ratio (ours / llama.cpp) and their median and band. Resident memory: our process's after its
passes against llama-bench's peak (its own rusage), beside the file's size.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from ..metrics import timer
from ..model.cache import KVCache
from ..model.transformer import Transformer


def llama_bench() -> Path | None:
    from .llama_server import binary

    return binary("llama-bench")


def unavailable() -> str:
    return (
        "llama.cpp's llama-bench is not built here; `specdec bench peers --build` builds it once from "
        "llama-cpp-python's vendored source (cmake and a C++ compiler; minutes)"
    )


def tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, min(vocab, 30000), (1, n), generator=torch.Generator().manual_seed(seed))


def pass_times(
    model: Transformer, cache: KVCache, new: torch.Tensor, *, context: int, ks: tuple[int, ...], repeats: int
) -> dict[int, list[float]]:
    """ms of `repeats` passes over k of the tokens `new` on the `context` tokens in `cache`, per k.
    Round by round over every k (the first round warms up each shape), not k by k: a k's ratio
    to the one-token pass of its own round is measured within a second, so it does not move with
    the machine's minute the way a k timed minutes after k = 1 did."""
    times: dict[int, list[float]] = {k: [] for k in ks}
    for r in range(repeats + 1):
        for k in ks:
            cache.truncate(context)
            with timer(model.device) as t:
                model(new[:, :k], cache)
            if r:
                times[k].append(t[0] * 1e3)
    return times


def _ours(model: Transformer, *, context: int, ks: tuple[int, ...], prefill: tuple[int, ...], repeats: int) -> dict:
    """Median ms of each k-token pass on `context` cached tokens (k = 1: the one-token pass,
    `pass_times`) and of each prefill from an empty cache."""
    prompt = tokens(context, model.args.vocab_size, 0)
    new = tokens(max(ks), model.args.vocab_size, 1)
    cache = model.new_cache(context + max(ks))
    model(prompt, cache, last_only=True)
    times = pass_times(model, cache, new, context=context, ks=ks, repeats=repeats)
    out = {f"k{k}": statistics.median(v) for k, v in times.items()}
    for n in prefill:
        ids = tokens(n, model.args.vocab_size, 2)
        ms = []
        for _ in range(max(1, repeats // 2)):
            pcache = model.new_cache(n)
            with timer(model.device) as t:
                model(ids, pcache, last_only=True)
            ms.append(t[0] * 1e3)
            del pcache
        out[f"pp{n}"] = statistics.median(ms)
    return out


def _run_llama_bench(args: list[str]) -> tuple[list[dict], int]:
    """One llama-bench process: its JSON rows and its peak resident memory (bytes)."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = proc.stdout.read() if proc.stdout else b""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {proc.returncode}: {' '.join(args)}")
    return json.loads(out.decode() or "[]"), usage.ru_maxrss * 1024


def _theirs(gguf: Path, *, context: int, ks: tuple[int, ...], prefill: tuple[int, ...], repeats: int) -> dict:
    """llama-bench's ms for the same passes (k = 1 from `-n`, k > 1 from `-p k`, both at depth
    `context`; prefills `-p N` at depth 0), and its peak resident memory."""
    exe = str(llama_bench())
    threads = str(torch.get_num_threads())
    base = [exe, "-m", str(gguf), "-t", threads, "-r", str(repeats), "-o", "json"]
    multi = ",".join(str(k) for k in ks if k > 1)
    rows, rss = _run_llama_bench([*base, "-d", str(context), "-n", "8", *(["-p", multi] if multi else ["-p", "0"])])
    if prefill:
        more, rss2 = _run_llama_bench([*base, "-d", "0", "-n", "0", "-p", ",".join(map(str, prefill))])
        rows, rss = rows + more, max(rss, rss2)
    out: dict[str, Any] = {"rss": rss}
    for row in rows:
        ms = row["avg_ns"] / 1e6
        if row["n_gen"]:
            out["k1"] = ms / row["n_gen"]
        elif row["n_depth"] == context and row["n_prompt"] in ks:
            out[f"k{row['n_prompt']}"] = ms
        else:
            out[f"pp{row['n_prompt']}"] = ms
    out["build"] = f"{rows[0].get('build_commit', '?')} ({rows[0].get('cpu_info', '')}, {rows[0].get('backends', '')})"
    return out


def rss_bytes() -> int:
    """This process's resident memory now (file-backed pages of mapped weights included)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def compare(
    model: Transformer,
    gguf: Path,
    *,
    context: int,
    ks: tuple[int, ...],
    prefill: tuple[int, ...] = (),
    rounds: int = 3,
    repeats: int = 3,
    progress=print,  # noqa: ANN001
) -> dict[str, Any]:
    """Ours and llama.cpp's passes, `rounds` rounds of (ours, llama-bench); per measurement the
    medians of each side over rounds and of the per-round ratio ours / llama.cpp, with its band."""
    from ..model import sparse

    ours: list[dict] = []
    theirs: list[dict] = []
    with sparse.full(gguf):  # llama.cpp reads every block from the file (see `sparse`)
        for r in range(rounds):
            progress(f"round {r + 1}/{rounds}: ours, then llama-bench ...")
            t0 = time.perf_counter()
            ours.append(_ours(model, context=context, ks=ks, prefill=prefill, repeats=repeats))
            theirs.append(_theirs(gguf, context=context, ks=ks, prefill=prefill, repeats=repeats))
            progress(f"  ({time.perf_counter() - t0:.0f} s)")
    keys = [f"k{k}" for k in ks] + [f"pp{n}" for n in prefill]
    rows = {}
    for key in keys:
        a = [o[key] for o in ours]
        b = [t[key] for t in theirs if key in t]
        if len(b) != len(a):
            continue
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        rows[key] = {
            "ours_ms": statistics.median(a),
            "llama_cpp_ms": statistics.median(b),
            "ratio": statistics.median(ratios),
            "band": [min(ratios), max(ratios)],
        }
    return {
        "rounds": rounds,
        "repeats": repeats,
        "context": context,
        "rows": rows,
        "rss": {"ours": rss_bytes(), "llama_cpp": max(t["rss"] for t in theirs), "file": gguf.stat().st_size},
        "llama_cpp_build": theirs[0]["build"],
        "gguf": gguf.name,
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'pass':10s}{'ours ms':>10s}{'llama.cpp':>11s}{'ours/theirs':>13s}  band (per round)"]
    for key, r in result["rows"].items():
        name = f"k={key[1:]}" if key.startswith("k") else f"prefill {key[2:]}"
        lines.append(
            f"{name:10s}{r['ours_ms']:10.1f}{r['llama_cpp_ms']:11.1f}{r['ratio']:13.2f}  "
            f"{r['band'][0]:.2f}-{r['band'][1]:.2f}"
        )
    rss = result["rss"]
    lines.append(
        f"resident memory: ours {rss['ours'] / 1e9:.2f} GB, llama.cpp {rss['llama_cpp'] / 1e9:.2f} GB (peak); "
        f"file {rss['file'] / 1e9:.2f} GB"
    )
    lines.append(
        f"({result['gguf']}; {result['rounds']} rounds of ours then llama-bench, {result['repeats']} repeats "
        f"each, medians; k-token passes on {result['context']} cached tokens; llama.cpp {result['llama_cpp_build']})"
    )
    return "\n".join(lines)
