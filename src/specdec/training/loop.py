"""Training an EAGLE-3 head on cached target features, with the training-time test.

At draft time the head's first step reads the target's features, and each later step reads
the head's own previous output. EAGLE-3's "training-time test" trains exactly that: for every
anchor position i of a sequence (the last position whose target features are known), step 1
predicts the target's distribution after token i+1 from (token i+1, fc(features_i)); step j
predicts the one after token i+j from (token i+j, the head's step j-1 output at i), at
position i+j-1, attending to the step-1 keys of positions <= i and to its own chain's keys of
steps 2..j (one per step: the "diagonal" of the reference implementation's mask). Losses are
soft cross-entropies against the target's top-k probabilities (mapped into the draft
vocabulary), weighted 0.8^(j-1) as in the reference, counted where the predicted token is an
assistant answer's.

Runs as one process, or under `torchrun` with DistributedDataParallel (gloo on CPUs, NCCL on
GPUs): each rank takes every world-th sequence, gradients are averaged, rank 0 writes the
checkpoints. Seeded and resumable (`checkpoint.pt` beside the head: weights, optimizer, step,
RNG state); `minutes` bounds the wall time (rank 0 decides, all ranks stop together).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..networks.eagle3 import Eagle3Head
from .features import Example

DECAY = 0.8  # the reference implementation's weight of step j's loss: DECAY ** (j - 1)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3  # unrolled draft steps per anchor (training-time test)
    lr: float = 3e-4
    warmup: int = 20  # optimizer steps of linear warm-up, then cosine decay to 10%
    seqs_per_step: int = 8  # sequences per optimizer step, per rank
    epochs: float = 1.0
    minutes: float | None = None  # wall-time budget
    max_len: int = 1024  # longer sequences are cut
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_minutes: float = 10.0
    # share of the counted predictions that enter the loss each step (a seeded random subset):
    # the draft LM head dominates the cost, so fewer of them per step buys more steps per minute
    loss_fraction: float = 1.0
    # "auto": bfloat16 autocast where the CPU has bf16 matmul instructions (oneDNN runs bf16 on
    # AMX tiles or AVX512-BF16's dot products: 2.2x fp32's matmul throughput measured on a Zen 4
    # EPYC) or on CUDA, float32 elsewhere (bf16 emulated on AVX2 is no faster); or "bf16" / "fp32"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.steps < 1 or self.seqs_per_step < 1 or self.lr <= 0 or self.epochs <= 0:
            raise ValueError("steps, seqs_per_step, lr and epochs must be positive")
        if not 0 < self.loss_fraction <= 1:
            raise ValueError("loss_fraction must be in (0, 1]")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype must be auto, bf16 or fp32, not {self.dtype!r}")

    def autocast_bf16(self) -> bool:
        if self.dtype != "auto":
            return self.dtype == "bf16"
        from ..model.native import cpu_info

        flags = set(cpu_info().get("flags", "").split())
        return torch.cuda.is_available() or bool(flags & {"amx_bf16", "avx512_bf16"})


@dataclass
class StepStats:
    loss: float
    acc: list[float]  # per unrolled step: the head's top-1 equals the target's top-1
    tokens: int


def unroll(head: Eagle3Head, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs for every anchor and unrolled step (the training-time test's layout,
    see the module doc): tokens [L], features [L, 3H] -> per step j = 1..steps, g_j [L-1, H]
    (anchor i's step j predicts the target's distribution after token i+j; tokens past the
    end are clamped to the last, and their predictions are never counted)."""
    cfg = head.cfg
    L = int(tokens.numel())
    A = L - 1
    g = head.project(features[:A].float())[None]  # [1, A, H]
    anchors = torch.arange(A)
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    scale = cfg.head_dim**-0.5
    causal = torch.ones(A, A, dtype=torch.bool).tril()
    keys: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    outs = []
    for j in range(1, steps + 1):
        tok_idx = (anchors + j).clamp(max=L - 1)
        q, k, v = head.qkv(head.embed(tokens[tok_idx])[None], g, (anchors + j - 1)[None])
        q = q[0].transpose(0, 1)  # [nh, A, D]
        keys.append(k[0].transpose(0, 1).repeat_interleave(rep, 0))  # [nh, A, D]
        vals.append(v[0].transpose(0, 1).repeat_interleave(rep, 0))
        # step-1 keys of anchors <= i, then this anchor's own keys of steps 2..j (the diagonal)
        s1 = ((q @ keys[0].transpose(1, 2)) * scale).masked_fill(~causal, float("-inf"))  # [nh, A, A]
        diag = [((q * kk).sum(-1) * scale)[..., None] for kk in keys[1:]]  # each [nh, A, 1]
        p = torch.softmax(torch.cat([s1, *diag], -1), -1)
        out = p[..., :A] @ vals[0]
        for n, vv in enumerate(vals[1:]):
            out = out + p[..., A + n : A + n + 1] * vv
        g, _ = head.finish(g, out.transpose(0, 1)[None], logits=False)
        outs.append(g[0])
    return outs


def counted(
    lab: torch.Tensor, mask: torch.Tensor, L: int, fraction: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Which predictions count (index into `lab`): label row lab[i] holds the target's
    distribution predicting token lab[i] + 1, counted where that token exists and is an
    answer's; with `fraction` < 1 a random subset drawn from `generator` (at least one)."""
    valid = (lab + 1 <= L - 1) & mask[(lab + 1).clamp(max=L - 1)]
    idx = valid.nonzero()[:, 0]
    if fraction < 1.0 and idx.numel() > 1:
        keep = torch.rand(idx.numel(), generator=generator) < fraction
        idx = idx[keep] if bool(keep.any()) else idx[:1]
    return idx


def soft_loss(
    logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, t2d: torch.Tensor, t2d_index: torch.Tensor
) -> torch.Tensor:
    """Summed soft cross-entropy of draft-vocabulary logits [n, N] against the target's top-k
    (ids, probs [n, k]); ids outside the draft vocabulary (t2d) drop out. `t2d_index`: target
    id -> draft id (cumsum of t2d - 1)."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(probs * t2d[ids] * logp.gather(1, t2d_index[ids].clamp(min=0))).sum()


def soft_targets_loss(
    head: torch.nn.Module,
    ex: Example,
    count: int,
    max_len: int,
    states: Callable[[int], tuple[torch.Tensor, Iterable[torch.Tensor]]],
    fraction: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The loss every head type shares, on one sequence cut to `max_len` (L tokens): `states(L)`
    gives the anchors [A] and, per draft step or head j = 1..`count`, the head's output [A, H]
    there, which predicts the target's own distribution at anchor + j (its top-k mapped into the
    draft vocabulary): a soft cross-entropy weighted DECAY^(j-1), counted where the label is an
    answer token (a random `fraction` of those, drawn from `generator`). Returns the summed loss
    and per j (top-1 agreements, predictions)."""
    L = min(int(ex.tokens.numel()), max_len)
    # zero that still reaches every parameter: a backward (and DDP's all-reduce) always runs
    total = sum((p.reshape(-1)[0] * 0.0 for p in head.parameters() if p.requires_grad), torch.zeros(()))
    if L < 3:
        return total, [(0, 0)] * count
    mask, top_ids, top_p = ex.mask[:L], ex.top_ids[:L], ex.top_p[:L].float()
    t2d_index = torch.cumsum(head.t2d.long(), 0) - 1  # target id -> draft id (inside the draft vocabulary)
    anchors, outs = states(L)
    stats: list[tuple[int, int]] = []
    for j, g in enumerate(outs, start=1):
        lab = anchors + j
        idx = counted(lab, mask, L, fraction, generator)
        if idx.numel() == 0:
            stats.append((0, 0))
            continue
        logits = head.logits(g[idx])  # [n, N]
        ids, probs = top_ids[lab[idx]], top_p[lab[idx]]  # [n, K]
        total = total + DECAY ** (j - 1) * soft_loss(logits, ids, probs, head.t2d, t2d_index)
        pred = head.draft_ids[logits.argmax(-1)]
        stats.append((int((pred == ids[:, 0]).sum()), int(idx.numel())))
    return total, stats


def sequence_loss(
    head: Eagle3Head,
    ex: Example,
    steps: int,
    max_len: int,
    fraction: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """EAGLE-3's loss on one sequence: draft step j of the unrolled head at anchor t predicts
    token t + 1 + j (`soft_targets_loss`)."""
    return soft_targets_loss(
        head,
        ex,
        steps,
        max_len,
        lambda L: (torch.arange(L - 1), unroll(head, ex.tokens[:L], ex.features[:L], steps)),
        fraction,
        generator,
    )


# a head's loss on one sequence: (head, example, share of predictions counted, generator) ->
# (summed loss, per draft step or head: (top-1 agreements, predictions))
LossFn = Callable[
    [torch.nn.Module, Example, float, "torch.Generator | None"], tuple[torch.Tensor, list[tuple[int, int]]]
]


class _Loss(torch.nn.Module):
    """The head with the loss as its forward: what DistributedDataParallel wraps, so that
    gradient synchronisation follows every backward."""

    def __init__(
        self, head: torch.nn.Module, cfg: TrainConfig, generator: torch.Generator, fn: LossFn | None = None
    ) -> None:
        super().__init__()
        self.head, self.cfg, self.generator = head, cfg, generator
        self.fn = fn or (lambda h, ex, frac, gen: sequence_loss(h, ex, cfg.steps, cfg.max_len, frac, gen))

    def forward(self, ex: Example) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        c = self.cfg
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.autocast_bf16()):
            loss, stats = self.fn(self.head, ex, c.loss_fraction, self.generator)
        return loss.float(), stats


def _dist() -> tuple[int, int]:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def train(
    head: Any,
    examples: list[Example],
    cfg: TrainConfig,
    out_dir: str | Path,
    *,
    record: dict[str, Any] | None = None,
    progress: bool = True,
    log: Any = None,
    loss: LossFn | None = None,
    name: str = "eagle3",
) -> dict[str, Any]:
    """Train `head` (its vocabulary and target attachment set) and save it to `out_dir`;
    resumes from `out_dir/checkpoint.pt` when present. Returns the training record. The
    trainer every head shares: `loss` is the head's own (default: EAGLE-3's training-time
    test), `name` labels its progress; `head.save(dir, extra=)` writes it."""
    from tqdm import tqdm

    rank, world = _dist()
    out = Path(out_dir)
    torch.manual_seed(cfg.seed)
    order = list(range(len(examples)))
    random.Random(cfg.seed).shuffle(order)
    mine = order[rank::world]
    n_mine = len(mine)
    if world > 1:  # every rank takes the same number of steps: as many as the smallest share allows
        n = torch.tensor([n_mine])
        torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
        n_mine = int(n.item())
    per_epoch = max(1, n_mine // cfg.seqs_per_step)
    total_steps = max(1, math.ceil(per_epoch * cfg.epochs))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, total_steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    step, history, cpu0, wall0 = 0, [], 0.0, 0.0
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["opt"])
        step, history, cpu0, wall0 = state["step"], state["history"], state["cpu_seconds"], state["wall_seconds"]
        torch.set_rng_state(state["rng"])
    sampler = torch.Generator().manual_seed(cfg.seed * 1000 + rank + step)  # loss subsets (resumes reseed by step)
    model: torch.nn.Module = _Loss(head, cfg, sampler, loss)
    if world > 1:
        # the buffers (target embedding, vocabulary maps) are frozen and equal on every rank
        model = torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)
    t_wall, t_cpu, t_ckpt = time.time(), time.process_time(), time.time()
    bar = tqdm(total=total_steps, initial=step, unit="step", desc=name, disable=not progress or rank != 0)
    head.train()
    while step < total_steps:
        opt.zero_grad(set_to_none=True)
        batch = [mine[(step * cfg.seqs_per_step + n) % len(mine)] for n in range(cfg.seqs_per_step)]
        losses: list[float] = []
        counts: list[list[int]] = []
        n_tok = sum(min(int(examples[i].mask[1:].sum()), cfg.max_len) for i in batch)
        for n, i in enumerate(batch):
            sync = n == len(batch) - 1
            ctx = model.no_sync() if (world > 1 and not sync) else _Null()
            with ctx:
                loss, st = model(examples[i])
                # DDP averages gradients over ranks; scale so a step's gradient is the mean per token
                (loss / max(1, n_tok)).backward()
            losses.append(float(loss.detach()))
            counts += [[0, 0] for _ in range(len(st) - len(counts))]
            for s, (c, m) in enumerate(st):
                counts[s][0] += c
                counts[s][1] += m
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        step += 1
        acc = [c / m if m else 0.0 for c, m in counts]
        entry = {
            "step": step,
            "loss": sum(losses) / max(1, n_tok),
            "acc": acc,
            "tokens": n_tok,
            "minutes": (wall0 + time.time() - t_wall) / 60,
        }
        history.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", acc1=f"{acc[0]:.2f}", accN=f"{acc[-1]:.2f}")
        bar.update(1)
        if log is not None:
            log(entry)
        stop = cfg.minutes is not None and (wall0 + time.time() - t_wall) / 60 >= cfg.minutes
        if world > 1:
            flag = torch.tensor([1.0 if stop else 0.0])
            torch.distributed.broadcast(flag, 0)
            stop = bool(flag.item())
        if rank == 0 and (stop or time.time() - t_ckpt >= cfg.checkpoint_minutes * 60):
            _checkpoint(
                head, opt, step, history, cpu0 + time.process_time() - t_cpu, wall0 + time.time() - t_wall, ckpt
            )
            t_ckpt = time.time()
        if stop:
            break
    bar.close()
    head.eval()
    result = {
        **(record or {}),
        "train": asdict(cfg),
        "optimizer_steps": step,
        "world_size": world,
        "compute_dtype": "bf16" if cfg.autocast_bf16() else "fp32",
        "cpu_seconds": round(cpu0 + time.process_time() - t_cpu, 1),
        "wall_minutes": round((wall0 + time.time() - t_wall) / 60, 2),
        "sequences": len(examples),
        "history": history,
    }
    if rank == 0:
        head.save(out, extra={k: v for k, v in result.items() if k != "history"})
        (out / "history.json").write_text(__import__("json").dumps(history) + "\n")
        plot_history(history, out / "training.png")
        if step >= total_steps and ckpt.exists():
            ckpt.unlink()  # finished: the head itself is the result (a stopped run keeps it to resume)
    return result


def _checkpoint(head, opt, step, history, cpu, wall, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "head": head.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "history": history,
            "cpu_seconds": cpu,
            "wall_seconds": wall,
            "rng": torch.get_rng_state(),
        },
        tmp,
    )
    os.replace(tmp, path)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def evaluate(head: Eagle3Head, examples: list[Example], steps: int, max_len: int) -> list[float]:
    """Per unrolled step, how often the head's top-1 equals the target's (teacher-forced)."""
    counts = [[0, 0] for _ in range(steps)]
    with torch.no_grad():
        for ex in examples:
            _, st = sequence_loss(head, ex, steps, max_len)
            for s, (c, m) in enumerate(st):
                counts[s][0] += c
                counts[s][1] += m
    return [c / m if m else 0.0 for c, m in counts]


def moving_average(xs: list[float], window: int) -> list[float]:
    """Mean of each value with up to `window` - 1 values before it (training curves)."""
    return [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]


def plot_history(history: list[dict[str, Any]], path: Path, window: int = 20) -> Path:
    """Top-1 agreement with the target by unrolled step against training minutes (a moving
    average over `window` optimizer steps), and the loss: the head's learning curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [h["minutes"] for h in history]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for j in range(len(history[0]["acc"]) if history else 0):
        a1.plot(minutes, moving_average([h["acc"][j] for h in history], window), label=f"draft step {j + 1}")
    a1.set_xlabel("training minutes")
    a1.set_ylabel("top-1 agreement with the target")
    a1.set_title(f"training batches, mean of {window} steps", fontsize=9)
    a1.legend()
    a2.plot(minutes, moving_average([h["loss"] for h in history], window))
    a2.set_xlabel("training minutes")
    a2.set_ylabel("loss per answer token")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
