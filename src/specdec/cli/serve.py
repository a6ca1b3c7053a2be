"""`specdec serve`."""

from __future__ import annotations

import argparse
import sys

from .. import registry
from ..config import DEFAULT_K, GenerationConfig
from ..drafters import DRAFTERS, uses_draft_model
from ..model.kernels import AUTO, MODES
from ..server.worker import PREFIX_TOKENS
from .common import (
    Help,
    add_auto_draft,
    add_draft_bits,
    add_drafter_options,
    auto_draft,
    drafter_options,
    load_draft_model,
    method_of,
)


def parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat/completions, streaming, metrics)",
        formatter_class=Help,
        description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. "
        "Requests decode together (continuous batching); each may choose its own method "
        'with the extra body field "speculative": {"method": NAME, "k": K}.',
    )
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    p.add_argument("--draft", help="draft model for the draft-model and auto methods")
    add_draft_bits(p)
    add_auto_draft(p)
    p.add_argument(
        "--drafter",
        choices=sorted(DRAFTERS),
        help="the server's default method (unset: draft-model when --draft is given, else plain decoding)",
    )
    add_drafter_options(p)
    p.add_argument(
        "-k",
        "--num-draft-tokens",
        dest="k",
        type=int,
        help=f"draft tokens per step, unless a request says otherwise (default: the method's own, else {DEFAULT_K})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (anything but loopback exposes the server)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/ requests (repeat for several clients: what "
        "one client generated never drafts for another, see --suffix-shared)",
    )
    p.add_argument(
        "--suffix-shared",
        action="store_true",
        help="suffix decoding drafts from, and prompts reuse the cached rows of, every client's earlier "
        "requests, not each API key's own (a response's speed can then reveal what another client "
        "sent or generated)",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=PREFIX_TOKENS,
        metavar="N",
        help="keep up to N tokens' rows of finished requests, so a prompt that begins like an earlier "
        "conversation (a chat's next turn) prefills only the rest; outputs are unchanged. In the "
        "modes whose rows are bitwise the same in any pass (q4k, int8 on CPU); 0: off",
    )
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together at most; more wait in order")
    p.add_argument(
        "--max-tokens", dest="default_max_tokens", type=int, default=512, help="max_tokens of a request that gives none"
    )
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    p.add_argument("--served-model-name", help="the model id clients send (default: --target)")
    p.add_argument(
        "--batch-guard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="turn drafting off for steps whose batch is large enough that it no longer pays",
    )
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES], help="precision/kernel mode")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(ns: argparse.Namespace) -> int:
    from ..api import load
    from ..server import ServeSettings, serve

    method = method_of(ns, draft_for_others=True)
    auto_draft(ns, method)
    if ns.k is not None:
        GenerationConfig(k=ns.k)  # the one bound on k, as generate and each request have it
    if ns.prefix_cache_tokens < 0:
        raise ValueError(f"--prefix-cache-tokens must be >= 0 (0: off), got {ns.prefix_cache_tokens}")
    if ns.max_batch < 1 or ns.default_max_tokens < 1 or ns.max_body_bytes < 1:
        raise ValueError("--max-batch, --max-tokens and --max-body-bytes must be at least 1")
    if not 0 < ns.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {ns.port}")
    options = drafter_options(ns, method)
    if ns.host not in ("127.0.0.1", "localhost", "::1") and not ns.api_keys:
        print(
            f"specdec: warning: serving on {ns.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    target = load(ns.target, dtype=ns.dtype, device=ns.device)
    draft = load_draft_model(ns)
    if method is not None:  # fail now, not on the first request
        from ..api import build_drafter

        build_drafter(target, draft if uses_draft_model(method) else None, method, **options)
    settings = ServeSettings(
        ns.served_model_name or ns.target,
        method,
        options,
        ns.k,
        ns.max_batch,
        default_max_tokens=ns.default_max_tokens,
        api_keys=tuple(ns.api_keys or ()),
        suffix_shared=ns.suffix_shared,
        prefix_tokens=ns.prefix_cache_tokens,
        max_body_bytes=ns.max_body_bytes,
        batch_guard=ns.batch_guard,
    )
    serve(target, draft, settings, ns.host, ns.port)
    return 0
