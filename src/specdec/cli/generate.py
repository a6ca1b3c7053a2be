"""`specdec generate`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import registry
from ..adaptive import REPORT, steps_text
from ..config import DEFAULT_K, GenerationConfig, SamplingParams, add_arguments, from_namespace
from ..drafters import DRAFTERS
from ..drafters.base import describe as describe_run
from ..engine import Delta
from ..model.kernels import AUTO, MODES
from ..plans import CONFIG_FIELDS, choose_drafter
from .common import (
    Help,
    add_auto_draft,
    add_draft_bits,
    add_drafter_options,
    auto_draft,
    drafter_options,
    load_draft_model,
    method_of,
    read_prompt,
    read_text,
)


def parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text, speculatively when a draft or drafter is given", formatter_class=Help
    )
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    p.add_argument(
        "--draft", help="draft model (its tokenizer the target's, or another: drafts across); omit for plain decoding"
    )
    add_draft_bits(p)
    add_auto_draft(p)
    p.add_argument(
        "--drafter",
        choices=sorted(DRAFTERS),
        help="drafting method (unset: draft-model when --draft is given, else plain decoding): "
        + "; ".join(f"{s.name}: {s.help}" for s in DRAFTERS.values()),
    )
    add_drafter_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file ('-' for stdin)")
    p.add_argument(
        "--prediction-file",
        type=Path,
        help="the output you expect, mostly (the file you asked the model to edit): drafted from with a "
        "pointer that realigns after the edits (OpenAI's predicted outputs); the drafter is "
        "prediction, or auto with --draft, unless --drafter names one of them",
    )
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's log-probability under the target and its N likeliest alternatives "
        "(0..20; plain decoding's numbers)",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the model's chat template (unset: when the model has one)",
    )
    add_arguments(p, GenerationConfig)
    add_arguments(p, SamplingParams)
    p.set_defaults(k=None)  # unset: the k stored by `specdec bench --tune`, else DEFAULT_K
    p.add_argument(
        "--dtype",
        default=AUTO,
        choices=[AUTO, *MODES],
        help="precision/kernel mode; auto = fastest exact mode for the device (q4k on CPU)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--compare", action="store_true", help="also run plain decoding and report the speedup")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --compare: run both sides this many times in alternating order (plain first, then "
        "speculative first, ...) and report the median speedup with its lowest and highest pair",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--explain",
        action="store_true",
        help="after the run, a table per member of auto (or the one drafter) and plain steps: steps taken, "
        "tokens per pass, ms per step, share of the time (each step's offers and pick are in --json's drafter_info)",
    )
    p.add_argument("--stream", action="store_true", help="print the text as it is committed, step by step")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(ns: argparse.Namespace) -> int:
    from ..api import Request, compare_requests, load, request, run_request

    prediction = read_text(ns.prediction_file, "prediction") if ns.prediction_file is not None else None
    if prediction is not None:  # (the drafter for a prediction: the one rule of every front end)
        ns.drafter = choose_drafter(ns.drafter, None, bool(ns.draft), predicted=True)
    if ns.logprobs is not None and not ns.json:
        raise ValueError("--logprobs is printed in the JSON object; add --json")
    method = method_of(ns)
    auto_draft(ns, method)
    if ns.compare and method is None:
        raise ValueError("--compare needs --draft or --drafter (it compares speculative decoding with plain decoding)")
    if ns.repeats != 1 and not ns.compare:
        raise ValueError("--repeats repeats a comparison; add --compare (or drop --repeats)")
    if ns.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {ns.repeats})")
    if ns.stream and ns.json:
        raise ValueError("--stream prints text as it is committed and --json one object at the end; choose one")
    options = drafter_options(ns, method)
    k_given = ns.k
    ns.k = ns.k if ns.k is not None else DEFAULT_K
    cfg = from_namespace(GenerationConfig, ns)  # checked once, before any model loads
    sampling = from_namespace(SamplingParams, ns)
    prompt = read_prompt(ns)
    target = load(ns.target, dtype=ns.dtype, device=ns.device)
    draft = load_draft_model(ns)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in CONFIG_FIELDS}

    def build() -> Request:  # (a comparison's every speculative run gets a drafter of its own)
        return request(
            target,
            prompt,
            assistant_model=draft,
            drafter=method,
            drafter_options=options,
            sampling=sampling,
            k=k_given,
            chat=ns.chat,
            prediction=prediction,
            logprobs=ns.logprobs,
            **fields,
        )

    req = build()
    drafter = req.drafter
    header = {
        "target": ns.target,
        "drafter": method,
        "draft": ns.draft,
        "k": req.config.k if drafter else None,
        "k_source": req.k_source,
        "dtype": target.model.mode,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "exact": sampling.exact or drafter is None,
    }
    if not header["exact"]:
        print(
            f"specdec: NOT EXACT: typical acceptance (epsilon {sampling.epsilon}, delta {sampling.delta}) verifies "
            "the drafts; the output is not distributed as the target's own (drop --acceptance typical for exact "
            "sampling)",
            file=sys.stderr,
        )
    show = _shower(ns.stream, len(req.prompt_ids))
    describe = functools.partial(describe_run, drafter.name if drafter is not None else None)
    if ns.compare:
        made = iter([req])  # (the first run is the request built above)
        cmp = compare_requests(target, lambda: next(made, None) or build(), draft, on_delta=show, repeats=ns.repeats)
        if ns.json:
            _note(describe(cmp.speculative.metrics.drafter_info, brief=True))
            print(json.dumps({**header, **cmp.to_dict()}))
        else:
            _print_result(cmp.speculative, describe, streamed=ns.stream, extra=cmp)
        if ns.explain:
            print(explain(cmp.speculative.metrics.drafter_info), file=sys.stderr)
        return 0
    result = run_request(target, req, on_delta=show)
    if ns.json:
        _note(describe(result.metrics.drafter_info, brief=True))
        m = result.metrics
        print(
            json.dumps(
                {
                    **header,
                    "acceptance_rate": m.acceptance_rate,
                    "mean_accepted_tokens": m.mean_accepted_tokens,
                    "tokens_per_second": m.tokens_per_second,
                    **result.to_dict(),
                }
            )
        )
    else:
        _print_result(result, describe, streamed=ns.stream)
    if ns.explain:
        print(explain(result.metrics.drafter_info), file=sys.stderr)
    return 0


def explain(info: dict[str, Any]) -> str:
    """The per-member table of a run's chooser (`adaptive.members`), as text."""
    rep = info.get(REPORT)
    if not rep:
        return "specdec: --explain: no chooser ran (plain decoding, --no-adaptive-k, or a self-scheduling drafter)"
    lines = [f"{'member':<16}{'steps':>7}{'tokens/pass':>13}{'ms/step':>10}{'time':>7}"]
    for name, r in rep["members"].items():
        lines.append(
            f"{name:<16}{r['steps']:>7}{r['tokens_per_pass']:>13.2f}{r['ms_per_step']:>10.1f}{100 * r['share']:>6.0f}%"
        )
    return "\n".join(lines)


def _shower(stream: bool, prompt_len: int) -> Callable[[Delta], None] | None:
    """What each step's delta prints: with --stream its text; on a terminal, the progress of
    reading a long prompt (on stderr, one line rewritten, erased when the first token comes)."""
    progress = sys.stderr.isatty()
    if not stream and not progress:
        return None
    started = time.perf_counter()
    shown = [False]

    def show(d: Delta) -> None:
        if d.prefilled is not None:
            if progress:
                rate = d.prefilled / max(time.perf_counter() - started, 1e-9)
                print(
                    f"\rreading the prompt: {d.prefilled}/{prompt_len} tokens ({rate:.0f} tok/s, Ctrl-C stops)",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
                shown[0] = True
            return
        if shown[0]:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
            shown[0] = False
        if stream:
            print(d.text, end="", flush=True)

    return show


def _note(notes: list[str]) -> None:
    """With --json, what the drafter chose for itself still goes to stderr (the JSON has it too,
    under drafter_info): the early-exit layer, or that the request ran as plain decoding."""
    if notes:
        print("specdec: " + "; ".join(notes), file=sys.stderr)


def _print_result(
    result: Any, describe: Callable[[dict[str, Any]], list[str]], streamed: bool, extra: Any = None
) -> None:
    """The text (unless it was streamed already), then one line of figures on stderr: the
    run's, the drafter's own (`describe`), and the step controller's."""
    print("" if streamed else result.text, flush=True)
    m = result.metrics
    line = f"\n[{m.new_tokens} tokens, {m.tokens_per_second:.2f} tok/s"
    if m.prefill_time > 0:  # reading the prompt and generating, apart
        line += (
            f" ({m.decode_tokens_per_second:.2f} tok/s generating; prompt of {m.prompt_tokens} tokens read in "
            f"{m.prefill_time:.2f} s, {m.prompt_tokens / m.prefill_time:.0f} tok/s)"
        )
    if m.acceptance_rate is not None:
        line += f", acceptance {m.acceptance_rate:.2f}, tokens/pass {m.mean_accepted_tokens:.2f}"
    if extra is not None:
        line += f"; plain {extra.plain.metrics.tokens_per_second:.2f} tok/s, speedup {extra.speedup:.2f}x"
        if len(extra.pairs) > 1:
            lo, hi = extra.band
            line += f" (median of {len(extra.pairs)} alternating pairs, {lo:.2f}-{hi:.2f})"
        if extra.identical is not None:
            line += f", identical to plain: {extra.identical}"
    info = m.drafter_info
    line += "".join(f"; {text}" for text in describe(info))
    if info.get(REPORT):
        line += "; steps: " + steps_text(info[REPORT]["steps"])
    if not m.exact:
        line += "; NOT EXACT (typical acceptance)"
    print(line + "]", file=sys.stderr)
