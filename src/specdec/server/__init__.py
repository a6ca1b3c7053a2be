"""`specdec serve`: an OpenAI-compatible HTTP server over the engine's stepper.

    specdec serve --target qwen2.5-coder-1.5b --drafter prompt-lookup --port 8000
    # any OpenAI client: base_url="http://127.0.0.1:8000/v1"

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both streamed as server-sent
events in the OpenAI chunk format, or not), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus). A request may pick its own drafting method with an extra body field,
``"speculative": {"method": "prompt-lookup", "k": 6}`` (``{"method": "none"}``: plain
decoding); the server's own method (`--drafter`/`--draft`) is the default.

Two threads: the ASGI event loop (uvicorn) parses, validates and streams; the engine thread owns the
`Engine` and steps every live sequence together (continuous batching: a request joins the batch at
the next step and leaves it when it ends; at most `max_batch` decode at once, the rest wait in
order). The engine thread hands each step's deltas to the request's asyncio queue. All torch work
happens on that one thread (drafters are built there too): OpenMP keeps a thread pool per calling
thread, and on a machine with as many cores as one pool has threads, a second pool throttles the
spinning of both, which cost a third of the decoding speed here. `serve` therefore runs the engine
on the main thread, the one that loaded the models, and uvicorn beside it. Each step it asks the
cost model whether drafting still pays at this batch size (`costs.batch_drafting_pays`: a large
batch fills the target pass with rows already) and runs a plain step for all when it does not —
exactly as lossless as any other step.

Every sequence is decoded exactly as `specdec generate` decodes it alone (bitwise in the exact
modes), whatever else shares its steps: greedy output is the same token for token.
"""

from .app import create_app, serve
from .worker import ServeSettings

__all__ = ["ServeSettings", "create_app", "serve"]
