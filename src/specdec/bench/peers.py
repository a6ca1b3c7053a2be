"""Peers on the same prompts and models, greedy: transformers `generate` (plain, with
`assistant_model` = the same draft, with `prompt_lookup_num_tokens`), llama-cpp-python
(plain and with its prompt-lookup drafter, on the same GGUF file) and llama.cpp's own server,
plain and with its draft-model speculation on the same two GGUF files (`llama_server`).

A peer that is not installed is skipped with the reason; a peer that fails is recorded with
its error and never stops the run. llama.cpp runs in a worker process (`python -m
specdec.bench.peers`), so a crash inside the native library (seen with its prompt lookup on
long prompts) costs only the request that crashed: the worker is restarted for the rest.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PEERS = (
    "transformers",
    "transformers-assisted",
    "transformers-prompt-lookup",
    "llama.cpp",
    "llama.cpp-prompt-lookup",
    "llama-server",
    "llama-server-speculative",
)
WORKER_TIMEOUT_S = 3600


@dataclass
class PeerRun:
    tokens: list[int] | None  # None: failed
    seconds: float
    error: str | None = None
    drafted: int = 0  # the peer's own draft counts, where it reports them (llama-server)
    accepted: int = 0


def unavailable(peer: str, *, has_draft: bool, gguf: Path | None) -> str | None:
    """Why `peer` cannot run here (None: it can)."""
    if peer.startswith("transformers"):
        if peer == "transformers-assisted" and not has_draft:
            return "needs the draft model (the draft-model method)"
        return None  # transformers is a dependency
    if peer.startswith("llama-server"):
        from . import llama_server

        if peer == "llama-server-speculative" and not has_draft:
            return "needs the draft model (the draft-model method)"
        why = llama_server.unavailable()
        if why is None and (gguf is None or not gguf.exists()):
            why = "no GGUF file for this target"
        return why
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    if gguf is None or not gguf.exists():
        return "no GGUF file for this target"
    return None


class TransformersPeers:
    """The target (and draft) in bf16, transformers' own `generate`, greedy."""

    def __init__(self, target_dir: Path, draft_dir: Path | None, k: int) -> None:
        from transformers import AutoModelForCausalLM

        from ..model.convert import float_weights  # transformers reads float weights (made on first use)

        self.target = AutoModelForCausalLM.from_pretrained(float_weights(target_dir), dtype=torch.bfloat16)
        self.draft = (
            AutoModelForCausalLM.from_pretrained(float_weights(draft_dir), dtype=torch.bfloat16) if draft_dir else None
        )
        self.k = k

    def run(self, peer: str, ids: list[int], max_new_tokens: int) -> PeerRun:
        extra: dict[str, Any] = {}
        if peer == "transformers-assisted":
            extra = {
                "assistant_model": self.draft,
                "num_assistant_tokens": self.k,
                "num_assistant_tokens_schedule": "constant",
            }
        elif peer == "transformers-prompt-lookup":
            extra = {"prompt_lookup_num_tokens": self.k}
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        try:
            out = self.target.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False, **extra
            )
        except Exception as exc:  # noqa: BLE001 (a peer's failure is a result, not our crash)
            return PeerRun(None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
        return PeerRun(out[0, len(ids) :].tolist(), time.perf_counter() - t0)


def run_llama_cpp(gguf: Path, lookup: bool, requests: list[dict[str, Any]], k: int) -> dict[str, PeerRun]:
    """Run requests ({id, ids, max_new_tokens, eos}) in worker processes; a crash fails only
    the request it happened in."""
    from ..model import sparse

    with sparse.full(gguf):  # llama.cpp reads every block from the file (see `sparse`)
        return _run_llama_cpp(gguf, lookup, requests, k)


def _run_llama_cpp(gguf: Path, lookup: bool, requests: list[dict[str, Any]], k: int) -> dict[str, PeerRun]:
    results: dict[str, PeerRun] = {}
    pending = list(requests)
    n_ctx = max(len(r["ids"]) + r["max_new_tokens"] for r in requests) + 16
    while pending:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(
                {
                    "gguf": str(gguf),
                    "lookup": lookup,
                    "k": k,
                    "n_ctx": n_ctx,
                    "threads": torch.get_num_threads(),
                    "requests": pending,
                },
                fh,
            )
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "specdec.bench.peers", fh.name],
                capture_output=True,
                text=True,
                timeout=WORKER_TIMEOUT_S,
            )
            stdout, code, err = proc.stdout, proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""
            stdout, code, err = out.decode() if isinstance(out, bytes) else out, -1, "timed out"
        finally:
            Path(fh.name).unlink(missing_ok=True)
        for line in stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                results[r["id"]] = PeerRun(r.get("tokens"), r["seconds"], r.get("error"))
        pending = [r for r in pending if r["id"] not in results]
        if pending and code != 0:  # the worker died inside the first unfinished request
            tail = err.strip().splitlines()[-1:] if err else []
            results[pending[0]["id"]] = PeerRun(
                None, 0.0, f"llama.cpp worker crashed (exit {code}) {' '.join(tail)}".strip()
            )
            pending = pending[1:]
        elif pending:
            for r in pending:
                results[r["id"]] = PeerRun(None, 0.0, "llama.cpp worker gave no result")
            pending = []
    return results


def run_llama_server(gguf: Path, draft: Path | None, requests: list[dict[str, Any]], k: int) -> dict[str, PeerRun]:
    """Requests ({id, ids, max_new_tokens}) through llama.cpp's server, plain (`draft` None) or
    speculative. Each prompt is sent once untimed first, so its rows are cached there as ours
    are in the suite: what is timed is generation (the server's own `predicted_ms`)."""
    from . import llama_server

    n_ctx = max(len(r["ids"]) + r["max_new_tokens"] for r in requests) + 64
    out: dict[str, PeerRun] = {}
    try:
        with (
            llama_server.whole(gguf, draft),
            llama_server.LlamaServer(gguf, draft, k=k, n_ctx=n_ctx, threads=torch.get_num_threads()) as server,
        ):
            for r in requests:
                server.complete(r["ids"], 1)  # (untimed: reads the prompt)
                c = server.complete(r["ids"], r["max_new_tokens"])
                out[r["id"]] = PeerRun(c.tokens, c.seconds, c.error, c.drafted, c.accepted)
    except RuntimeError as exc:
        return {r["id"]: PeerRun(None, 0.0, str(exc)) for r in requests}
    return out


def _worker(spec_file: str) -> int:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    spec = json.loads(Path(spec_file).read_text())
    draft = LlamaPromptLookupDecoding(num_pred_tokens=spec["k"]) if spec["lookup"] else None
    llm = llama_cpp.Llama(
        model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_threads=spec["threads"], verbose=False, draft_model=draft
    )
    for req in spec["requests"]:
        eos = set(req["eos"])
        tokens: list[int] = []
        t0 = time.perf_counter()
        try:
            for tok in llm.generate(req["ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
                tokens.append(int(tok))
                if tok in eos or len(tokens) >= req["max_new_tokens"]:
                    break
            row = {"id": req["id"], "tokens": tokens, "seconds": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001 (recorded; the worker goes on with the next request)
            row = {
                "id": req["id"],
                "tokens": None,
                "seconds": time.perf_counter() - t0,
                "error": f"{type(exc).__name__}: {exc}",
            }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
