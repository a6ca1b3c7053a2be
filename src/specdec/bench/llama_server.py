"""llama.cpp's own server as a peer: its plain decoding and its draft-model speculation
(`llama-server -md DRAFT --spec-type draft-simple`) on the same GGUF files as ours, greedy.

This is the peer a CPU user who wants speculation would pick. It is built once, from
llama.cpp's source as llama-cpp-python's source distribution vendors it (a pinned version,
fetched by pip from the package registry), into the specdec cache (`specdec bench peers
--build`); nothing is built unless asked. Requests go to its `/completion` endpoint as token
ids, so both sides read the same prompt; its reply carries the tokens, the generation time
apart from the prompt's (`timings.predicted_ms`) and its own draft counts.

Our GGUF files keep the blocks the q4k packing holds as holes (`model.sparse`): llama.cpp
reads every block, so the files are made whole while a server runs (`sparse.full`). (Without
it llama.cpp decodes zeros and writes token 0 at every step.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"  # the source distribution whose vendored llama.cpp is built
START_TIMEOUT_S = 300


def home() -> Path:
    from .. import store

    return store.cache_root() / "peers" / f"llama.cpp-{LLAMA_CPP_PYTHON}"


# What `build` makes: the server (the peer of `specdec serve` and of speculation) and
# llama-bench (llama.cpp's own timer of one-token passes and prefill: `specdec bench forward`).
TARGETS = ("llama-server", "llama-bench")


def binary(name: str = "llama-server") -> Path | None:
    """A built llama.cpp program (`TARGETS`), or None."""
    path = home() / "bin" / name
    return path if path.exists() else None


def unavailable() -> str | None:
    """Why the peer cannot run here (None: it can)."""
    if binary() is None:
        return (
            "llama.cpp's server is not built here; `specdec bench peers --build` builds it once from "
            f"llama-cpp-python {LLAMA_CPP_PYTHON}'s vendored source (cmake and a C++ compiler; minutes)"
        )
    return None


def build(log: Callable[[str], None] = print) -> Path:
    """Fetch the pinned source distribution, build `llama-server` (native CPU flags, static
    libraries) and keep it in the cache; returns the binary. Safe to run twice."""
    if all(binary(t) is not None for t in TARGETS):
        log(f"llama.cpp is built already: {home() / 'bin'}")
        return binary()
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool}; install it (e.g. Debian's {tool} package) and retry")
    with tempfile.TemporaryDirectory(prefix="specdec-llama-") as tmp:
        work = Path(tmp)
        log(f"fetching llama-cpp-python {LLAMA_CPP_PYTHON}'s source distribution")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                str(work),
            ],
            check=True,
        )
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        log("configuring llama.cpp (cmake, native CPU flags)")
        subprocess.run(
            [
                "cmake",
                "-S",
                str(src),
                "-B",
                str(work / "build"),
                *gen,
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF",
                "-DLLAMA_BUILD_UI=OFF",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        log(f"building {' and '.join(TARGETS)} on {os.cpu_count()} cores (minutes)")
        subprocess.run(
            ["cmake", "--build", str(work / "build"), "--target", *TARGETS, "-j", str(os.cpu_count() or 1)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        out = home() / "bin"
        out.mkdir(parents=True, exist_ok=True)
        for target in TARGETS:
            shutil.copy2(work / "build" / "bin" / target, out / f"{target}.tmp")
            (out / f"{target}.tmp").replace(out / target)
    log(f"built {', '.join(str(out / t) for t in TARGETS)}")
    return out / "llama-server"


@dataclass
class Completion:
    tokens: list[int] | None  # None: failed
    seconds: float  # generation after the prompt (the server's own timing)
    prompt_seconds: float
    drafted: int = 0
    accepted: int = 0
    error: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One `llama-server` process on `gguf` (with `draft`: its draft-model speculation, k
    drafts per step at most), for the duration of a `with` block."""

    def __init__(
        self, gguf: Path, draft: Path | None = None, *, k: int = 4, threads: int = 2, n_ctx: int = 4096
    ) -> None:
        path = binary()
        if path is None:
            raise RuntimeError(unavailable())
        self.port = _free_port()
        self.cmd = [
            str(path),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(n_ctx),
            "-np",
            "1",
            "--no-webui",
        ]
        if draft is not None:
            self.cmd += [
                "-md",
                str(draft),
                "--spec-type",
                "draft-simple",
                "--spec-draft-n-max",
                str(k),
                "--threads-draft",
                str(threads),
                "--threads-batch-draft",
                str(threads),
            ]
        self._stack = contextlib.ExitStack()
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self.log = self._stack.enter_context(tempfile.TemporaryFile())
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace").strip().splitlines()[-3:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not answer within {START_TIMEOUT_S} s")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._stack.close()

    def complete(self, ids: list[int], max_new_tokens: int) -> Completion:
        """Greedy continuation of `ids` (the server keeps the prompt's rows for the next request
        that begins the same way, as ours does)."""
        body = {
            "prompt": ids,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": True,
            "return_tokens": True,
            "stream": False,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                out = json.loads(r.read())
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
            return Completion(None, 0.0, 0.0, error=f"{type(exc).__name__}: {exc}")
        t = out.get("timings", {})
        return Completion(
            [int(x) for x in out.get("tokens", [])],
            t.get("predicted_ms", 0.0) / 1e3,
            t.get("prompt_ms", 0.0) / 1e3,
            int(t.get("draft_n", 0)),
            int(t.get("draft_n_accepted", 0)),
        )


@contextlib.contextmanager
def whole(*files: Path | None) -> Iterator[None]:
    """The GGUF files whole (their q4k-packed blocks restored) for the duration."""
    from ..model import sparse

    with contextlib.ExitStack() as stack:
        for f in dict.fromkeys(p for p in files if p is not None):
            stack.enter_context(sparse.full(f))
        yield


@contextlib.contextmanager
def servers(gguf: Path, draft: Path | None, **kw: Any) -> Iterator[tuple[LlamaServer, LlamaServer | None]]:
    """Plain and (with a draft) speculative servers side by side, the GGUF files whole meanwhile."""
    with whole(gguf, draft), LlamaServer(gguf, **kw) as plain:
        if draft is None:
            yield plain, None
            return
        with LlamaServer(gguf, draft, **kw) as spec:
            yield plain, spec
