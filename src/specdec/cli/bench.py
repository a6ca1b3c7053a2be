"""`specdec bench` and its subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import registry, store
from ..config import DEFAULT_K
from ..drafters import DRAFTERS
from ..drafters.base import draft_model_method, needs_draft_model
from ..drafters.prediction import PREDICTION_READERS
from ..model.kernels import AUTO, MODES
from .common import Help, add_draft_bits, draft_bits


def parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks (speed measured side by side in one run)",
        description="Without a subcommand: every method over the prompt suite, side by side with "
        "plain decoding; writes DIR/results.json, DIR/report.md, DIR/report.html (the report with its plots "
        "inside) and PNG plots.",
        formatter_class=Help,
    )
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one prompt per category, 40 new tokens, 3 repeats in alternating order (minutes, not hours)",
    )
    p.add_argument("--prompts", type=Path, help="JSONL prompt file (id, category, turns) instead of the bundled suite")
    p.add_argument(
        "--sharegpt",
        type=int,
        metavar="N",
        help="instead of the suite, N first turns drawn from ShareGPT (`specdec data install sharegpt`): English, "
        "at most 1,500 tokens, each its own category; needs --sample-seed; the sample is written to OUT/prompts.jsonl",
    )
    p.add_argument("--sample-seed", type=int, help="with --sharegpt: the seed of the draw (a new one per measurement)")
    p.add_argument("--categories", nargs="+", help="only these categories")
    p.add_argument("--per-category", type=int, help="at most this many prompts per category")
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model")
    p.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="draft model for the draft-model method")
    add_draft_bits(p)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="the draft's vocabulary for draft-model and auto (0 = whole; default: the drafter's)",
    )
    p.add_argument(
        "--pairs",
        nargs="+",
        metavar="TARGET[:DRAFT]",
        help="several model pairs, one grid each (instead of --target/--draft)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=list(DRAFTERS),
        help="drafting methods to run, each beside plain decoding (default: every drafter; eagle3, "
        "medusa and hydra where heads ship for the target)",
    )
    p.add_argument(
        "--temperatures",
        nargs="+",
        type=float,
        default=[0.0, 1.0],
        help="sampling temperatures to run (0 = greedy, checked token for token against plain decoding)",
    )
    p.add_argument("-k", type=int, help=f"draft tokens per step (default: the method's own, else {DEFAULT_K})")
    p.add_argument("--max-new-tokens", type=int, help="tokens per generation (default 128; 40 with --quick)")
    p.add_argument(
        "--repeats",
        type=int,
        help="repeats of every run, in alternating order (ABBA): each cell's median with its band (default 3)",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed of the sampled runs (seed + prompt index)")
    p.add_argument(
        "--dtype",
        default=AUTO,
        choices=[AUTO, *MODES],
        help="precision/kernel mode of every model; auto = the fastest exact mode for the device",
    )
    p.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run transformers and llama-cpp-python (where installed) on the same prompts, greedy",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="store the cost model's best k per method where `specdec generate` uses it when -k is unset",
    )
    p.add_argument(
        "--adaptive-k",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the methods as `generate` does, never-slower guard on (--no-adaptive-k: k drafts every "
        "step, what the cost model's per-k predictions assume)",
    )
    p.add_argument(
        "--noise-control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run plain decoding once more among the methods of every prompt (`plain-again`, timed like "
        "a method): the spread of its ratios is this run's noise floor",
    )
    p.set_defaults(func=_cmd_bench)
    bsub = p.add_subparsers(dest="bench_cmd")
    fwd = bsub.add_parser(
        "forward", help="ms per target forward for k new tokens, per precision/kernel mode", formatter_class=Help
    )
    fwd.add_argument("--model", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    fwd.add_argument("--modes", nargs="+", choices=list(MODES), help="modes to time (default: all for the device)")
    fwd.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    fwd.add_argument("--repeats", type=int, default=5, help="timed repeats per k (median reported)")
    fwd.add_argument("--device", default=None)
    fwd.add_argument(
        "--draft",
        help="also time one drafted token of this draft model (as drafting runs it) against "
        "the target's one-token pass (`draft_ratio` in --json)",
    )
    add_draft_bits(fwd)
    fwd.add_argument(
        "--draft-vocab",
        type=int,
        nargs="+",
        metavar="N",
        help="with --draft: the draft vocabularies to time (0 = whole; default: the default and 0)",
    )
    fwd.add_argument(
        "--peer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a .gguf model, time llama.cpp's llama-bench on the same file beside the q4k mode, "
        "interleaved by rounds (built by `specdec bench peers --build`)",
    )
    fwd.add_argument("--rounds", type=int, default=3, help="rounds of ours-then-llama.cpp (--peer)")
    fwd.add_argument(
        "--prefill",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="also time prefills of N tokens from an empty cache, ours and llama.cpp's (--peer), e.g. 512 2048",
    )
    fwd.add_argument("--json", action="store_true", help="print one JSON object")
    fwd.set_defaults(func=_cmd_bench_forward)
    bat = bsub.add_parser(
        "batch",
        help="aggregate tokens/s with several sequences in flight, per method",
        description="B different prompts decoded together (greedy), plain decoding and each "
        "method side by side at every batch size; prints a table, writes "
        "DIR/batch.json, DIR/batch.png and DIR/batch.html (both as one page) with --out.",
        formatter_class=Help,
    )
    from ..bench.batch import METHODS as BATCH_METHODS
    from ..bench.batch import PLAIN

    bat.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model")
    bat.add_argument("--draft", help="draft model (default: the registered pair of the target, else the target itself)")
    bat.add_argument("--batch", nargs="+", type=int, default=[1, 2, 4, 8], help="batch sizes")
    bat.add_argument(
        "--methods",
        nargs="+",
        default=list(BATCH_METHODS),
        choices=[PLAIN, *DRAFTERS],
        help="plain decoding is always run as the reference",
    )
    bat.add_argument("-k", type=int, default=DEFAULT_K, help="draft tokens per step")
    bat.add_argument("--max-new-tokens", type=int, default=64, help="tokens per sequence")
    bat.add_argument("--max-prompt-tokens", type=int, default=512, help="skip suite prompts longer than this")
    bat.add_argument("--repeats", type=int, default=1, help="repeats (medians reported)")
    bat.add_argument("--prompts", type=Path, help="JSONL prompt file instead of the bundled suite")
    bat.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES], help="precision/kernel mode")
    bat.add_argument("--out", type=Path, help="write DIR/batch.json, DIR/batch.png and DIR/batch.html")
    bat.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bat.set_defaults(func=_cmd_bench_batch)
    proj = bsub.add_parser(
        "project",
        help="PROJECTION: a real pair's greedy runs re-priced with a bigger target's pass table",
        description="Re-prices the runs of `specdec bench` (results.json: each run's target passes by rows, "
        "its drafting time, its tokens; greedy runs checked identical to plain) with the pass table of "
        "another target (`specdec bench forward --json`, e.g. on a SYNTHETIC file at a 7B shape): the "
        "decoding speedup that target would get with the real pair's acceptance. Printed as a "
        "projection with its inputs; the best priced k per method and category.",
        formatter_class=Help,
    )
    proj.add_argument("passes", type=Path, help="`specdec bench forward --json` output of the bigger target")
    proj.add_argument(
        "runs", type=Path, nargs="+", help="results.json of `specdec bench` (greedy runs; several: one k each)"
    )
    proj.add_argument("--name", default=None, help="what the pass table is of (default: its model)")
    proj.add_argument("--json", type=Path, default=None, help="also write the projection to this JSON file")
    proj.set_defaults(func=_cmd_bench_project)
    pr = bsub.add_parser(
        "peers",
        help="the peers `specdec bench` runs beside ours: which can run here, and why not",
        description="Lists the peers (transformers, llama-cpp-python, llama.cpp's server plain and "
        "with its draft-model speculation) and whether each can run here. --build "
        "builds llama.cpp's server once into the specdec cache from the pinned "
        "source that llama-cpp-python's source distribution vendors.",
    )
    pr.add_argument(
        "--build", action="store_true", help="build llama.cpp's server now (cmake and a C++ compiler; minutes)"
    )
    pr.set_defaults(func=_cmd_bench_peers)
    srv = bsub.add_parser(
        "serve",
        help="load-test a running `specdec serve` on this machine",
        description="Streaming chat requests at each concurrency level (prompts of the bundled "
        "suite); throughput, time to first token and latency percentiles as a table, "
        "DIR/serve.json, DIR/serve.png and DIR/serve.html (both as one page). Localhost only; "
        "bounded in count and time.",
        formatter_class=Help,
    )
    srv.add_argument("--url", default="http://127.0.0.1:8000", help="the server (a loopback address)")
    srv.add_argument(
        "--concurrency",
        nargs="+",
        type=int,
        help="requests in flight, per level (default 1 4 16; with --trace: conversations at once, 1)",
    )
    srv.add_argument("--requests", type=int, default=32, help="requests per level (at most 1000)")
    srv.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    srv.add_argument("--model", help="model id (default: the server's first)")
    srv.add_argument(
        "--method", help='send "speculative": {"method": METHOD} (e.g. none, prompt-lookup; default: the server\'s own)'
    )
    srv.add_argument("-k", type=int, help="with --method: draft tokens per step")
    srv.add_argument("--temperature", type=float, default=0.0)
    srv.add_argument("--api-key", help="the server's API key")
    srv.add_argument(
        "--timeout", type=float, help="seconds per level, at most (default 600; with --trace: per method, 3600)"
    )
    srv.add_argument("--out", type=Path, default=Path("bench-out/serve"), help="output directory")
    tr = srv.add_argument_group(
        "agent trace (--trace): each method through a server of its own in this process, against plain decoding"
    )
    tr.add_argument(
        "--trace",
        nargs="?",
        const="agent",
        metavar="FILE",
        help="replay a trace (JSONL: conversation, turn, messages, max_tokens; optional tools, tool_choice, "
        "prediction) instead of the load test; no FILE or 'agent': the bundled HumanEval coding-agent "
        "sessions with tool calls; 'edit': the bundled edit requests with predictions",
    )
    tr.add_argument("--target", default=registry.DEFAULT_TARGET, help="with --trace: the model to serve")
    tr.add_argument("--draft", help="with --trace: draft model for draft-model and auto")
    tr.add_argument(
        "--methods",
        nargs="+",
        choices=[*DRAFTERS, *(m + "+prediction" for m in PREDICTION_READERS if m != "prediction")],
        default=["suffix", "prompt-lookup", "auto"],
        metavar="METHOD",
        help="with --trace: methods to replay, each beside plain decoding; prediction and NAME+prediction "
        "are sent the trace's predictions (e.g. auto+prediction), the others not",
    )
    tr.add_argument("--conversations", type=int, help="with --trace: the first N conversations (default: all)")
    tr.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES], help="with --trace: precision/kernel mode")
    tr.add_argument(
        "--prefix-cache-tokens",
        type=int,
        metavar="N",
        help="with --trace: the servers' cache of finished requests' rows, as serve's (0: off)",
    )
    srv.set_defaults(func=_cmd_bench_serve)


def _cmd_bench(ns: argparse.Namespace) -> int:
    from ..bench import report
    from ..bench.grid import QUICK, GridSettings, run_grid

    quick = QUICK if ns.quick else {}
    if ns.sharegpt is not None:
        ns.prompts = _sharegpt_prompts(ns)
    if ns.methods is None:
        from ..bench.grid import shipped

        named = [p.partition(":")[0] for p in ns.pairs] if ns.pairs else [ns.target]
        ns.methods = [m for m in DRAFTERS if all(shipped(m, t) for t in named)]
    pairs = [_pair(p, ns.methods) for p in ns.pairs] if ns.pairs else [(ns.target, ns.draft)]
    # every pair's settings are checked before the first (long) run starts
    settings = [
        GridSettings(
            target=target,
            draft=draft,
            methods=tuple(ns.methods),
            temperatures=tuple(ns.temperatures),
            k=ns.k,
            max_new_tokens=ns.max_new_tokens or quick.get("max_new_tokens", 128),
            repeats=ns.repeats or quick.get("repeats", 3),
            seed=ns.seed,
            per_category=ns.per_category or quick.get("per_category"),
            categories=tuple(ns.categories) if ns.categories else None,
            prompts_file=str(ns.prompts) if ns.prompts else None,
            dtype=ns.dtype,
            peers=ns.peers,
            adaptive_k=ns.adaptive_k,
            noise_control=ns.noise_control,
            draft_bits=draft_bits(ns),
            draft_vocab=ns.draft_vocab,
        )
        for target, draft in pairs
    ]
    results = []
    for s in settings:
        print(
            f"== {s.target}" + (f" + {s.draft}" if s.draft and any(map(needs_draft_model, s.methods)) else ""),
            file=sys.stderr,
        )
        result = run_grid(s, progress=lambda msg: print(msg, file=sys.stderr))
        print(report.table(result))
        results.append(result)
    for path in report.write(results, ns.out):
        print(f"wrote {path}", file=sys.stderr)
    if ns.tune:
        from .. import tuning

        for result in results:
            for key, entry in tuning.save(result).items():
                print(f"tuned {key}: k = {entry['k']} (predicted {entry['predicted_speedup']:.2f}x)", file=sys.stderr)
        print(f"wrote {tuning.tuned_path()}", file=sys.stderr)
    return 0


def _sharegpt_prompts(ns: argparse.Namespace) -> Path:
    """`--sharegpt N --sample-seed S`: the drawn sample as OUT/prompts.jsonl."""
    from .. import data
    from ..bench.suite import sharegpt_sample, write_prompts
    from ..tokenizer import Tokenizer

    if ns.sample_seed is None:
        raise ValueError("--sharegpt draws a sample by a seed: add --sample-seed S (a new S for every measurement)")
    if ns.prompts is not None or ns.pairs:
        raise ValueError("--sharegpt replaces --prompts and takes one --target; drop --prompts / --pairs")
    if not data.is_installed("sharegpt"):
        raise ValueError("the ShareGPT data is not installed; run `specdec data install sharegpt` first")
    tok = Tokenizer.from_dir(store.resolve(ns.target))

    def tokens(text: str) -> int:
        turn = [{"role": "user", "content": text}]
        return len(tok.encode_chat(turn) if tok.has_chat_template else tok.encode(text))

    prompts = sharegpt_sample(ns.sharegpt, ns.sample_seed, tokens, data.conversations("sharegpt"))
    path = write_prompts(prompts, ns.out / "prompts.jsonl")
    print(f"ShareGPT sample: {len(prompts)} first turns, seed {ns.sample_seed}, written to {path}", file=sys.stderr)
    return path


def _pair(text: str, methods: list[str]) -> tuple[str, str | None]:
    target, _, draft = text.partition(":")
    if not target or (":" in text and not draft):
        raise ValueError(f"--pairs takes TARGET or TARGET:DRAFT, got {text!r}")
    if not draft and any(map(needs_draft_model, methods)):
        raise ValueError(
            f"pair {text!r} has no draft; write TARGET:DRAFT or leave {draft_model_method()} out of --methods"
        )
    return target, draft or None


def _cmd_bench_project(ns: argparse.Namespace) -> int:
    from ..bench import projection

    for path in (*ns.runs, ns.passes):
        if not path.exists():
            raise FileNotFoundError(f"no file {path}")
    forward = json.loads(ns.passes.read_text())
    if "q4k" not in forward.get("modes", {}):
        raise ValueError(
            f"{ns.passes} has no q4k pass table; run `specdec bench forward --modes q4k --json` on the target"
        )
    runs = [projection.load(p) for p in ns.runs]
    result = projection.project(runs, projection.pass_table(forward), projection.source_table(runs[0]))
    name = ns.name or str(forward.get("model", ns.passes.name))
    result |= {"name": name, "runs": [str(p) for p in ns.runs], "passes": str(ns.passes), "kind": "projection"}
    print(projection.table(result, name))
    if ns.json is not None:
        ns.json.write_text(json.dumps(result, indent=1))
    return 0


def _cmd_bench_peers(ns: argparse.Namespace) -> int:
    from ..bench import llama_server, peers

    if ns.build:
        llama_server.build(log=lambda s: print(s, file=sys.stderr))
    for peer in peers.PEERS:
        why = peers.unavailable(
            peer, has_draft=True, gguf=Path(__file__)
        )  # (any existing file: the GGUF is per target)
        print(f"{peer:26s} {'ready' if why is None else 'skipped: ' + why}")
    return 0


def _cmd_bench_forward(ns: argparse.Namespace) -> int:
    from ..api import draft_bits as api_draft_bits
    from ..bench import forward
    from ..model.load import resolve_device

    if ns.context < 1 or ns.repeats < 1 or ns.rounds < 1:
        raise ValueError("--context, --repeats and --rounds must be >= 1")
    if any(n < 1 for n in ns.prefill):
        raise ValueError("--prefill lengths must be >= 1 token")
    if ns.draft_vocab and not ns.draft:
        raise ValueError("--draft-vocab times a draft model's vocabularies; add --draft MODEL")
    if any(n < 0 for n in ns.draft_vocab or ()):
        raise ValueError("--draft-vocab sizes must be >= 0 (0 = the whole vocabulary)")
    path = store.resolve(ns.model)
    modes = ns.modes or forward.default_modes(resolve_device(ns.device))
    gguf = store.gguf_path(registry.MODELS[ns.model]) if ns.model in registry.MODELS else Path(ns.model)
    result = forward.run(
        str(path),
        modes=modes,
        context=ns.context,
        repeats=ns.repeats,
        device=ns.device,
        progress=lambda s: print(s, file=sys.stderr),
        gguf=gguf if gguf.suffix == ".gguf" else None,
        draft=str(store.resolve(ns.draft)) if ns.draft else None,
        draft_vocabs=ns.draft_vocab,
        draft_bits=api_draft_bits(ns.draft, draft_bits(ns), device=ns.device) if ns.draft else None,
        peer=ns.peer,
        rounds=ns.rounds,
        prefill=tuple(ns.prefill),
    )
    result["model"] = ns.model
    if ns.draft:
        result["draft"]["name"] = ns.draft
    print(json.dumps(result) if ns.json else forward.table(result))
    return 0


def _cmd_bench_batch(ns: argparse.Namespace) -> int:
    from ..bench.batch import PLAIN, BatchSettings, run_batch, table, write

    methods = (PLAIN, *[m for m in ns.methods if m != PLAIN])
    settings = BatchSettings(
        target=ns.target,
        draft=ns.draft,
        batches=tuple(ns.batch),
        methods=methods,
        k=ns.k,
        max_new_tokens=ns.max_new_tokens,
        max_prompt_tokens=ns.max_prompt_tokens,
        repeats=ns.repeats,
        dtype=ns.dtype,
        prompts_file=str(ns.prompts) if ns.prompts else None,
    )
    result = run_batch(settings, progress=lambda msg: print(msg, file=sys.stderr))
    print(json.dumps(result.to_dict()) if ns.json else table(result))
    if ns.out is not None:
        write(result, ns.out)
    return 0


def _cmd_bench_serve(ns: argparse.Namespace) -> int:
    from ..bench import serve as sb

    if ns.trace is not None:
        return _bench_trace(ns)

    if ns.k is not None and ns.method is None:
        raise ValueError("-k goes with --method (the server's own k applies otherwise)")
    spec = None if ns.method is None else {"method": ns.method, **({"k": ns.k} if ns.k is not None else {})}
    settings = sb.ServeBenchSettings(
        url=ns.url,
        concurrency=tuple(ns.concurrency or (1, 4, 16)),
        requests=ns.requests,
        max_tokens=ns.max_tokens,
        model=ns.model,
        speculative=spec,
        temperature=ns.temperature,
        api_key=ns.api_key,
        level_timeout_s=ns.timeout or 600.0,
    )
    result = sb.run(settings, progress=lambda msg: print(msg, file=sys.stderr))
    print(sb.table(result))
    sb.write(result, ns.out)
    return 0


def _bench_trace(ns: argparse.Namespace) -> int:
    from ..bench import trace as bt

    if ns.url != "http://127.0.0.1:8000" or ns.method is not None or ns.k is not None:
        raise ValueError("--trace starts its own server per method: drop --url, --method and -k (use --methods)")
    if ns.concurrency is not None and len(ns.concurrency) != 1:
        raise ValueError("with --trace, --concurrency takes one number: the conversations replayed at once")
    settings = bt.TraceSettings(
        trace=ns.trace,
        target=ns.target,
        draft=ns.draft,
        methods=tuple(ns.methods),
        concurrency=ns.concurrency[0] if ns.concurrency else 1,
        conversations=ns.conversations,
        dtype=ns.dtype,
        timeout_s=ns.timeout or 3600.0,
        **({} if ns.prefix_cache_tokens is None else {"prefix_tokens": ns.prefix_cache_tokens}),
    )
    result = bt.run(settings, progress=lambda msg: print(msg, file=sys.stderr))
    print(bt.table(result))
    bt.write(result, ns.out)
    return 0
