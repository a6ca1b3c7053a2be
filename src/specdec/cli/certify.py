"""`specdec certify`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import registry
from ..drafters import DRAFTERS
from ..model.kernels import AUTO, MODES
from .common import Help, add_draft_bits, add_drafter_options, drafter_options, load_draft_model, method_of


def parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "certify",
        help="a statistical certificate that a method samples exactly as the target does",
        formatter_class=Help,
        description="Draws N sampled continuations of a few tokens with plain decoding and N with the "
        "method (fixed prompts, independent seeds), compares them with a two-sample "
        "chi-square test, and runs the same test on a deliberately broken verifier to show "
        "it catches an error at this N. Every step drafts: k is fixed, and the tree "
        "drafters send a fixed tree (--tree-tokens, 8 unless given) instead of the cost "
        "model's choice. Prints a table (or JSON); exits 1 when the method fails, 4 when "
        "the broken control is not caught (too few samples to certify) or nothing was "
        "drafted.",
    )
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    p.add_argument("--draft", help="draft model (for the draft-model and auto drafters)")
    add_draft_bits(p)
    p.add_argument(
        "--drafter", choices=sorted(DRAFTERS), help="the method to certify (default: draft-model with --draft)"
    )
    add_drafter_options(p)
    p.add_argument("-k", type=int, help="draft tokens per step (default: as generate chooses)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--samples", type=int, default=1000, help="continuations per arm and prompt")
    p.add_argument("--tokens", type=int, default=4, help="length of each continuation")
    p.add_argument(
        "--prompt",
        action="append",
        help="a prompt (repeat for several; default: three built-in "
        "prompts with repetition in them, so every drafter proposes)",
    )
    p.add_argument("--alpha", type=float, default=0.01, help="significance level")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="first seed (plain: seed, seed+1, ...; the method and the "
        "control draw from seeds 10^7 and 2*10^7 further on)",
    )
    p.add_argument("--no-control", dest="control", action="store_false", help="skip the broken-verifier control")
    p.add_argument("--batch", type=int, default=32, help="continuations decoded together")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *MODES], help="precision/kernel mode")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    p.set_defaults(func=_cmd_certify)


def _cmd_certify(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..api import load
    from ..certify import PROMPTS, certify
    from ..config import SamplingParams

    method = method_of(ns)
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
    with tqdm(
        total=arms * ns.samples * len(prompts), desc="certify", unit="seq", disable=ns.json, file=sys.stderr
    ) as bar:
        cert = certify(
            target,
            method=method,
            assistant_model=draft,
            k=ns.k,
            temperature=ns.temperature,
            top_p=ns.top_p,
            samples=ns.samples,
            tokens=ns.tokens,
            prompts=prompts,
            alpha=ns.alpha,
            seed=ns.seed,
            control=ns.control,
            batch=ns.batch,
            options=options,
            progress=bar.update,
        )
    from ..bench.grid import machine

    cert.cpu = machine()
    data = cert.to_dict()
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data) if ns.json else cert.table())
    return {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 4}[cert.verdict]
