"""`specdec train eagle3`: the whole recipe, from conversations to a head directory.

1. features: the target (its exact mode) over `tokens` tokens of conversations, cached in
   `out/features` (reused when the manifest matches: same target, data, mode, layers; a
   stopped extraction resumes, and a larger `tokens` grows the cache); under torchrun each
   rank extracts every world-th conversation into its own sub-directory;
2. the draft vocabulary: the `draft_vocab` tokens the target most often predicts in the data;
3. a seeded head shaped after the target, trained with the training-time test (`loop.py`);
4. the head, its config and the training record (command, data, seed, CPU time) in `out`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..networks.eagle3 import Eagle3Head, HeadConfig, config_for_target
from ..networks.vocabulary import attach
from . import features as fe
from .loop import TrainConfig, evaluate, train


@dataclass(frozen=True)
class Recipe:
    target: str
    out: Path
    data: str = "sharegpt"
    data_mode: str = "teacher"  # "teacher" | "self"
    tokens: int = 150_000  # target tokens of training data
    max_len: int = 1024
    draft_vocab: int = 32_000
    intermediate_size: int = 1536
    top_k: int = 8
    features: Path | None = None  # default: out/features
    regen_tokens: int = 384  # self-distillation: longest answer
    regen_batch: int = 32  # self-distillation: conversations per target pass

    def __post_init__(self) -> None:
        if self.data_mode not in ("teacher", "self"):
            raise ValueError(f"--data-mode must be teacher or self, not {self.data_mode!r}")
        if self.tokens < 1000:
            raise ValueError("--tokens must be at least 1000")
        if self.regen_tokens < 2 or self.regen_batch < 1:
            raise ValueError("--answer-tokens must be at least 2 and --gen-batch at least 1")


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _manifest_key(r: Recipe, layers: tuple[int, ...], mode: str) -> dict[str, Any]:
    key = {
        "target": r.target,
        "data": r.data,
        "data_mode": r.data_mode,
        "tokens_wanted": r.tokens,
        "max_len": r.max_len,
        "feature_layers": list(layers),
        "top_k": r.top_k,
        "mode": mode,
    }
    if r.data_mode == "self":
        key["max_answer_tokens"] = r.regen_tokens  # greedy answers do not depend on the batch size
    return key


def build_features(r: Recipe, lm: Any, layers: tuple[int, int, int], *, progress: bool = True) -> list[Path]:
    """Feature directories for this recipe (one per rank), extracted unless cached."""
    from .. import data

    rank, world = _rank_world()
    root = r.features or (r.out / "features")
    key = _manifest_key(r, layers, lm.model.mode)
    dirs = [root / (f"rank-{i}" if world > 1 else ".") for i in range(world)]
    mine = dirs[rank]
    manifest = mine / fe.MANIFEST
    if not (manifest.exists() and {k: json.loads(manifest.read_text()).get(k) for k in key} == key):

        def examples(done: frozenset[int]) -> Iterator[fe.Example]:
            convs = data.conversations(r.data, answered=r.data_mode == "teacher")
            mine_only = (c for i, c in enumerate(convs) if i % world == rank)
            if r.data_mode == "self":
                return fe.self_distill_examples(
                    lm,
                    mine_only,
                    layers=layers,
                    top_k=r.top_k,
                    max_len=r.max_len,
                    max_new_tokens=r.regen_tokens,
                    batch=r.regen_batch,
                    skip=done,
                )
            return fe.teacher_examples(lm, mine_only, layers=layers, top_k=r.top_k, max_len=r.max_len, skip=done)

        fe.extract(examples, mine, max_tokens=max(1, r.tokens // world), progress=progress and rank == 0, record=key)
    if world > 1:
        torch.distributed.barrier()
    return dirs


def run(r: Recipe, tc: TrainConfig, *, command: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Features, vocabulary, training; returns the training record."""
    from .. import store
    from ..api import load
    from .loop import _dist

    rank, world = _dist()
    lm = load(r.target)
    layers = HeadConfig.default_feature_layers(lm.model.args.n_layers)
    examples, val, record = prepare(r, lm, layers, seed=tc.seed, command=command, progress=progress)
    cfg = config_for_target(lm.model, r.target, draft_vocab_size=r.draft_vocab, intermediate_size=r.intermediate_size)
    head = Eagle3Head(cfg)
    head.init_weights(torch.Generator().manual_seed(tc.seed))
    head.set_vocab(fe.draft_vocabulary(examples, cfg.draft_vocab_size, cfg.target_vocab_size))
    attach(head, lm.model, store.resolve(r.target))
    result = train(head, examples, tc, r.out, record=record, progress=progress)
    if rank == 0:
        acc = evaluate(head, val, tc.steps, tc.max_len)
        result["validation_top1_by_step"] = acc
        head.save(r.out, extra={k: v for k, v in result.items() if k != "history"})
    if world > 1:
        # every rank leaves together, after rank 0 has written the head, and closes the process
        # group: a rank that exits with gloo's connections still open can abort (SIGABRT) at exit
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return result


def run_heads(
    r: Recipe,
    tc: TrainConfig,
    kind: str,
    num_heads: int,
    *,
    hydra_inner: int = 512,
    command: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """`specdec train medusa|hydra`: features, vocabulary, training, per-head accuracies;
    returns the training record.
    The recipe is EAGLE-3's (`run`), with the target's last layer as the features."""
    from .. import store
    from ..api import load
    from ..networks.medusa import MedusaHeads, config_for_target
    from .loop import _dist
    from .medusa import heads_loss, topk_accuracy

    rank, world = _dist()
    lm = load(r.target)
    examples, val, record = prepare(
        r, lm, (lm.model.args.n_layers - 1,), seed=tc.seed, command=command, progress=progress
    )
    cfg = config_for_target(
        lm.model, r.target, kind, num_heads=num_heads, draft_vocab_size=r.draft_vocab, hydra_inner=hydra_inner
    )
    heads = MedusaHeads(cfg)
    heads.init_weights(torch.Generator().manual_seed(tc.seed))
    heads.set_vocab(fe.draft_vocabulary(examples, cfg.draft_vocab_size, cfg.target_vocab_size))
    attach(heads, lm.model, store.resolve(r.target))
    norm = lm.model.model.norm
    for p in norm.parameters():
        p.requires_grad_(False)

    def loss(h: Any, ex: fe.Example, fraction: float, gen: torch.Generator | None) -> Any:
        return heads_loss(h, ex, norm, tc.max_len, fraction, gen)

    result = train(heads, examples, tc, r.out, record=record, progress=progress, loss=loss, name=kind)
    if rank == 0:
        acc = topk_accuracy(heads, val, norm, tc.max_len)
        result["validation_topk_accuracy"] = acc  # [head][rank]: the tree's input
        heads.save(r.out, extra={k: v for k, v in result.items() if k != "history"})
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return result


def prepare(
    r: Recipe, lm: Any, layers: tuple[int, ...], *, seed: int, command: str | None = None, progress: bool = True
) -> tuple[list[fe.Example], list[fe.Example], dict[str, Any]]:
    """What every head's training starts from: this recipe's features of `layers` (extracted
    unless cached), split into training and held-out examples (the last 2%, at least one), and
    the training record's common part (command, data, feature counts and CPU time, seed, CPU)."""
    t0 = time.process_time()
    dirs = build_features(r, lm, layers, progress=progress)  # type: ignore[arg-type]
    feature_cpu = time.process_time() - t0
    examples: list[fe.Example] = []
    manifests = []
    for d in dirs:
        m, ex = fe.load_examples(d)
        manifests.append(m)
        examples += ex
    n_val = max(1, len(examples) // 50)
    val, examples = examples[-n_val:], examples[:-n_val]
    record = {
        "command": command or " ".join(sys.argv),
        "target_name": r.target,
        "data": _data_record(r.data),
        "data_mode": r.data_mode,
        "feature_tokens": sum(m["tokens"] for m in manifests),
        "feature_conversations": sum(m["conversations"] for m in manifests),
        "feature_cpu_seconds": round(sum(m["cpu_seconds"] for m in manifests), 1),
        "this_run_feature_cpu_seconds": round(feature_cpu, 1),
        "seed": seed,
        "torch": torch.__version__,
        "cpu": _cpu(),
        "validation_sequences": len(val),
    }
    return examples, val, record


def _data_record(source: str) -> str:
    """The data as pinned packages (name==version, sha256) or the file it came from."""
    from ..registry import DATASETS

    spec = DATASETS.get(source)
    if spec is None:
        return str(source)
    pins = ", ".join(sorted({f"{p.package}=={p.version}" for p in spec.parts}))
    return f"{spec.name}: {pins} (sha256 {spec.sha256[:16]}...)"


def _cpu() -> str:
    from ..model.native import build_name, cpu_info

    return f"{cpu_info().get('model name', '?')} ({build_name()})"
