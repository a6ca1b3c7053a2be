"""One home for trained heads (EAGLE-3, Medusa, Hydra): which one ships for a target, loading and
attaching it once per target (kept in the target's `state`), and running its linear layers on
specdec's kernels with its measured call time.

A trained-head drafter needs three things from here: `load` (its head and runner for a target),
a `HeadRunner` subclass (how its head's stages run on the kernels), and its registration with
`head=KIND` (so the benchmark and auto know it needs a trained head)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..model.transformer import Transformer
from ..networks.vocabulary import attach
from ..runtime import per_model

SHIPPED = Path(__file__).resolve().parent.parent / "heads"  # heads that ship with specdec, one directory each
CONFIGS = {"specdec_eagle3.json": "eagle3", "specdec_medusa.json": None}  # config file -> kind (None: in the file)


def _index() -> list[tuple[str, str, Path]]:
    """(kind, target name, directory) of every shipped head."""
    out = []
    for d in sorted(SHIPPED.iterdir()) if SHIPPED.exists() else ():
        for config, kind in CONFIGS.items():
            if (d / config).exists():
                cfg = json.loads((d / config).read_text())
                out.append((kind or cfg.get("kind", ""), cfg.get("target", ""), d))
    return out


def registered_name(target: Transformer) -> str | None:
    """The registered model `target` was loaded from (matched by its directory), if any."""
    from ..registry import MODELS
    from ..store import converted_dir

    src = target.source_dir
    if src is None:
        return None
    for name, spec in MODELS.items():
        if converted_dir(spec.sha256).resolve() == Path(src).resolve():
            return name
    return None


def shipped(kind: str, *, name: str | None = None, target: Transformer | None = None) -> Path | None:
    """The directory of the `kind` head that ships trained for the registered model `name`, or
    for `target` (the registered model it was loaded from); None where none ships."""
    if name is None and target is not None:
        name = registered_name(target)
    return next((d for k, n, d in _index() if k == kind and n == name), None) if name else None


HEADS = per_model(memory=False)  # per target: heads loaded for it and their runners, by (kind, source)

H = TypeVar("H")
R = TypeVar("R")


def load(
    kind: str,
    target: Transformer,
    head: str | Path | H | None,
    read: Callable[[Path], H],
    runner: Callable[[H, Transformer], R],
) -> tuple[H, R]:
    """`head` (a directory, a head object, or None: the one shipped for the target) with its
    target's embedding attached, and its runner for `target`: built once per head and target
    (one load, one quantization, one timing) and kept in the target's state."""
    if head is None or isinstance(head, (str, Path)):
        where = Path(head) if head is not None else shipped(kind, target=target)
        if where is None:
            from .base import DRAFTERS

            auto = any(s.head == kind and s.auto_head for s in DRAFTERS.values())
            raise ValueError(
                f"no {kind} head ships for this target; train one (`specdec train {kind} --target NAME "
                "--out DIR`) and pass it with --head DIR" + (" (with --drafter auto: --auto-head DIR)" if auto else "")
            )
        key = (kind, str(where.resolve()))
    else:
        where, key = None, (kind, f"object {id(head)}")  # (the state holds the object: its id stays its own)
    per: dict[tuple[str, str], tuple[Any, Any]] = HEADS.of(target, dict)
    known = per.get(key)
    if known is None:
        obj = read(where) if where is not None else head
        if obj.embed_weight.numel() == 0:  # type: ignore[attr-defined]
            attach(obj, target)
        known = per[key] = (obj, runner(obj, target))  # type: ignore[arg-type]
    return known  # type: ignore[return-value]


class HeadRunner:
    """A head's linear layers on specdec's q4k kernel where the native kernels run (Q4_K, the LM
    head "lm" Q6_K; else the head's own float weights), its call time measured as it drafts (a
    moving average) and as stored once per machine, and the target's pass table its trees are
    sized by: one per head and target, shared by every drafter of them."""

    kind = ""

    def __init__(self, target: Transformer, linears: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        from ..model.native import library_or_none

        self.kernels: dict[str, Any] = {}
        lib = library_or_none()
        if lib is not None and target.mode in ("q4k", "int8"):
            from ..model import kquant as kq

            for name, (weight, bias) in linears.items():
                blocks = kq.quantize(weight.detach().float().numpy(), kq.Q6K if name == "lm" else kq.Q4K, lib)
                self.kernels[name] = kq.KQuantKernel.from_blocks(blocks, bias, in_features=weight.shape[1], lib=lib)
        self.pass_ms: Any = None  # specdec.costs.Costs of the target, read at first use
        self.call_ms: float | None = None  # one head call, ms (a moving average)
        self._stored_ms: float | None = None

    def timed(self, t0: float) -> None:
        """A call that began at `t0` (perf_counter) ended now."""
        ms = (time.perf_counter() - t0) * 1e3
        self.call_ms = ms if self.call_ms is None else 0.8 * self.call_ms + 0.2 * ms

    def weights(self) -> Iterable[torch.Tensor]:
        """The tensors that make this head what it is (its fingerprint for the stored timing)."""
        raise NotImplementedError

    def probe(self) -> None:
        """One call over one row, as drafting makes it."""
        raise NotImplementedError

    def stored_call_ms(self, target: Transformer) -> float:
        """`probe` as timed once per machine (`costs.head_call_ms`, keyed by a fingerprint of the
        weights): the clock-free cost a seeded sampled request decides by."""
        if self._stored_ms is None:
            from ..costs import head_call_ms

            self._stored_ms = head_call_ms(target, self.kind, self.weights(), self.probe)
        return self._stored_ms
