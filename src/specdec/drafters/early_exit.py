"""Self-speculation: the target's own first L blocks, its final norm and its LM head draft.

No second model, no training (the early-exit drafts of LayerSkip, Elhoushi et al. 2024,
without its training recipe). What makes it pay is reuse: the drafter writes the early
blocks' KV for the last committed token and for every draft token straight into the target's
cache and hands their residual stream to the verification pass, which then runs only blocks
[L, N) for the new rows — the early blocks are never recomputed. In the batch-invariant modes
(q4k, int8) a block computes bitwise the same for a row whether it runs alone or in a batch,
so the reused values are exactly what the target would compute itself, and greedy output
equals plain decoding token for token.

L is chosen by a short measured calibration unless given: how often the exit at each
candidate L agrees with the full model (teacher-forced on the end of the prompt), what a
draft step and the remaining verification cost there (timed at the lowest and highest
candidate, linear in L between them: every block costs the same), and the expected-tokens
formula of Leviathan et al. (E = (1 - a^(k+1)) / (1 - a)) give a predicted speedup; the best
L wins. The choice and the figures are in `info` (and in the generation's metrics), and kept
in the specdec cache (`early_exit.json`, keyed by model, mode, kernel build, CPU, k): later
processes on this machine reuse it instead of paying the calibration again.

Never slower than plain decoding: where the calibration predicts that even the best L is
slower than plain decoding (speedup < 1), the drafter proposes nothing for the request — the
engine then runs plain steps — and says so in `info["fallback"]`, unless built with
`force=True` (`--force`). An exit layer the user sets is used as given.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..costs import expected_tokens
from ..model.cache import KVCache
from ..model.transformer import Segment, Transformer
from ..runtime import per_model
from ..sampling import probs, sample
from .base import Draft, Drafter, DraftSession, Feedback, Option, one_batch, register

CALIBRATION_TOKENS = 32  # prompt tail used to measure agreement
CALIBRATION_REPEATS = 3  # timed repeats per measurement (median)
CALIBRATIONS = per_model(memory=False)  # per target: calibrations by (k, greedy, candidates)

# Calibrations done in this process are kept by the target (`state.calibrations`, by k and
# greedy/sampled): one drafter object serves one sequence, the calibration every sequence.


def _describe(info: dict[str, Any], brief: bool) -> list[str]:
    if "layer" not in info:
        return []
    how = "calibrated" if info.get("calibrated") else "set"
    text = f"early exit after layer {info['layer']} of {info['n_layers']} ({how})"
    if info.get("calibrated") and not brief:
        text += f", predicted speedup {info['candidates'][info['layer']]['predicted_speedup']:.2f}x"
    return [text]


@register(
    "early-exit",
    describe=_describe,
    needs="target",
    help="the target's own first L layers draft (self-speculation); L calibrated unless --exit-layer",
    options=(
        Option(
            "layer",
            "early-exit: draft with the target's first L layers (unset: calibrated, and reported)",
            "--exit-layer",
        ),
        Option(
            "force",
            "early-exit: draft even where the calibration predicts a slowdown (default: plain decoding then)",
            "--force",
        ),
    ),
)
class EarlyExitDrafter(Drafter):
    """Drafts with blocks [0, layer) of `target`, sharing its KV cache. `layer=None`:
    calibrated on the first proposal (for its k) and kept for later sequences of the target."""

    # its calibration predicts whether drafting pays (plain decoding if not, unless forced);
    # the engine's step guard would misjudge its steps, whose verification skips layers [0, L)
    own_schedule = True

    def __init__(
        self,
        target: Transformer,
        layer: int | None = None,
        candidates: tuple[int, ...] | None = None,
        force: bool = False,
    ) -> None:
        super().__init__()
        self.force = force
        n = target.args.n_layers
        if n < 2:
            raise ValueError("early-exit self-speculation needs a target with at least 2 layers")
        for value in ([layer] if layer is not None else []) + list(candidates or ()):
            if not 1 <= value < n:
                raise ValueError(
                    f"early-exit layer {value} is out of range: this target has {n} layers, so choose L in [1, {n - 1}]"
                )
        self.model = target
        self.layer = layer
        # default candidates: the upper half, where a plain exit starts agreeing with the model
        self.candidates = tuple(sorted(set(candidates))) if candidates else tuple(range(max(1, n // 2), n))
        self.info = {"layer": layer, "n_layers": n, "calibrated": False}
        self.session: DraftSession | None = None
        self.cache: KVCache | None = None
        self._last = 0  # the last committed token (not yet in the cache)
        self._context_tail: list[int] = []  # end of the committed tokens, for the calibration

    def begin(self, session: DraftSession) -> None:
        if session.target is not self.model or session.target_cache is None:
            raise ValueError("this early-exit drafter was built for a different target model; build it from the target")
        self.session, self.cache = session, session.target_cache
        self._last = session.context[-1]
        self._context_tail = session.context[-CALIBRATION_TOKENS - 1 :]

    def _ensure_layer(self, k: int) -> int:
        """The exit layer: given, or calibrated for this k (once per target, then kept)."""
        if self.session is None or self.cache is None:
            raise RuntimeError("EarlyExitDrafter.propose() called before begin()")
        if self.layer is None:
            key = (max(k, 1), self.session.sampling.greedy, self.candidates)
            per: dict[tuple, dict[str, Any]] = CALIBRATIONS.of(self.model, dict)
            known = per.get(key)
            if known is None:
                known = _stored_calibration(self.model, key)
            if known is None:
                self.calibrate(self._context_tail, max(k, 1))
                _store_calibration(self.model, key, self.info)
                known = dict(self.info)
            per[key] = known
            self.info = dict(known)
            self.layer = self.info["layer"]
            predicted = self.info["candidates"][self.layer]["predicted_speedup"]
            if predicted < 1.0 and not self.force:
                self.info["fallback"] = (
                    f"plain decoding: early exit predicted {predicted:.2f}x of plain at best (--force drafts anyway)"
                )
        return self.layer

    @property
    def off(self) -> bool:
        """The calibration found no layer that pays and the user did not force it."""
        return "fallback" in self.info

    def batch_key(self) -> Hashable:
        return ("early-exit", id(self.model))

    def propose(self, k: int) -> Draft:
        return self.propose_batch([self], [k])[0]

    @classmethod
    def propose_batch(cls, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Draft]:
        """Drafters of one target draft together: each draft step runs blocks [0, L) once for
        every sequence's row (drafters with different exit layers in separate groups)."""
        group: list[EarlyExitDrafter] = one_batch(cls, drafters)  # one target
        by_layer: dict[int, list[int]] = {}
        out: list[Draft | None] = [None] * len(group)
        for i, (d, k) in enumerate(zip(group, ks, strict=True)):
            L = d._ensure_layer(k)
            if d.off:
                out[i] = Draft.empty()  # a plain step
            else:
                by_layer.setdefault(L, []).append(i)
        for L, idx in by_layer.items():
            for i, draft in zip(idx, cls._draft([group[i] for i in idx], [ks[i] for i in idx], L), strict=True):
                out[i] = draft
        return out  # type: ignore[return-value]

    @staticmethod
    def _draft(group: list[EarlyExitDrafter], ks: list[int], L: int) -> list[Draft]:
        model = group[0].model
        dev = model.device
        bases = [d.cache.length for d in group]  # type: ignore[union-attr]  # slot of each last committed token
        x = [d._last for d in group]
        tokens: list[list[int]] = [[] for _ in group]
        qs: list[list[torch.Tensor]] = [[] for _ in group]
        hidden: list[list[torch.Tensor]] = [[] for _ in group]  # residual entering block L, one [1, 1, D] per row
        for step in range(max(ks) + 1):
            # k draft rows, then the last draft's early blocks too: verification needs every row's residual
            live = [i for i, k in enumerate(ks) if step <= k]
            segs = [Segment(torch.tensor([x[i]], device=dev), group[i].cache) for i in live]  # type: ignore[arg-type]
            outs = model.forward_batch(segs, hi=L, head=any(step < ks[i] for i in live))
            for i, out in zip(live, outs, strict=True):
                d = group[i]
                d.forwards += 1
                hidden[i].append(out.residual)
                if step == ks[i]:
                    continue
                logits = out.logits[:, -1]  # [1, V] the early exit
                sampling = d.session.sampling  # type: ignore[union-attr]
                if sampling.greedy:
                    x[i] = int(logits.argmax(-1))
                else:
                    q = probs(logits, sampling)  # [1, V]
                    x[i] = int(sample(q, d.session.generator))  # type: ignore[union-attr]
                    qs[i].append(q)
                tokens[i].append(x[i])
        drafts = []
        for i, d in enumerate(group):
            d.cache.truncate(bases[i])  # type: ignore[union-attr]  # the early KV stays in the slots; the verification pass owns the length
            q_all = None
            if not d.session.sampling.greedy:  # type: ignore[union-attr]
                q_all = torch.cat(qs[i]) if qs[i] else torch.zeros(0, model.args.vocab_size, device=dev)
            toks = torch.tensor(tokens[i], dtype=torch.long, device=dev)
            drafts.append(Draft(toks, q_all, hidden=torch.cat(hidden[i], dim=1)[0], from_layer=L))
        return drafts

    def accepted(self, feedback: Feedback) -> None:
        self._last = feedback.next_token

    # -- calibration ----------------------------------------------------------------------
    def calibrate(self, context: list[int], k: int) -> int:
        """Pick L with the best predicted speedup for drafts of k tokens; fills `info`."""
        model, N = self.model, self.model.args.n_layers
        dev = model.device
        ids = torch.tensor([context], device=dev)
        scratch = model.new_cache(len(context) + k + 2)
        out = model(ids, scratch, output_layers=tuple(c - 1 for c in self.candidates))
        final = out.logits[0, :-1]  # [T-1, V] teacher-forced predictions of the full model
        sampling = self.session.sampling if self.session is not None else None
        alphas = {}
        for L in self.candidates:
            early = model.head_logits(model.model.norm(out.layers[L - 1][:, :-1]))[0]  # [T-1, V]
            if sampling is None or sampling.greedy:
                alphas[L] = float((early.argmax(-1) == final.argmax(-1)).float().mean())
            else:  # expected acceptance of speculative sampling: sum_x min(p, q)
                alphas[L] = float(torch.minimum(probs(final, sampling), probs(early, sampling)).sum(-1).mean())
        prefix = len(context) - 1
        scratch.truncate(prefix)
        one = torch.tensor([[context[-1]]], device=dev)
        rows = torch.tensor([context[-1:] * (k + 1)], device=dev)

        def timed(fn) -> float:
            times = []
            for _ in range(CALIBRATION_REPEATS):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
                scratch.truncate(prefix)
            return statistics.median(times)

        t_plain = timed(lambda: model(one, scratch))
        D = model.args.dim
        h = torch.zeros(1, k + 1, D, dtype=model.dtype, device=dev)

        def measure(L: int) -> tuple[float, float, float]:
            """A draft step through [0, L) with the head, the same without it, and the
            verification of k + 1 rows through [L, N)."""
            return (
                timed(lambda: model(one, scratch, blocks=(0, L))),
                timed(lambda: model(one, scratch, blocks=(0, L), head=False)),
                timed(lambda: model(rows, scratch, blocks=(L, N), hidden_in=h)),
            )

        # every block costs the same (same shapes), so each of the three times is linear in L:
        # timing the lowest and the highest candidate gives the rest (a sixth of the passes of
        # timing each, which was most of a first early-exit request's time)
        ends = sorted({self.candidates[0], self.candidates[-1]})
        measured = {L: measure(L) for L in ends}

        def times(L: int) -> tuple[float, float, float]:
            if L in measured:
                return measured[L]
            lo, hi = ends
            w = (L - lo) / (hi - lo)
            return tuple((1 - w) * a + w * b for a, b in zip(measured[lo], measured[hi], strict=True))  # type: ignore[return-value]

        table: dict[int, dict[str, float]] = {}
        for L in self.candidates:
            t_draft, t_early, t_late = times(L)
            a = min(alphas[L], 0.999)
            expected = expected_tokens(a, k)
            step = k * t_draft + t_early + t_late
            table[L] = {
                "alpha": round(alphas[L], 3),
                "draft_ms": round(1e3 * t_draft, 2),
                "verify_ms": round(1e3 * (t_early + t_late), 2),
                "predicted_speedup": round(expected * t_plain / step, 3),
            }
        best = max(table, key=lambda L: table[L]["predicted_speedup"])
        self.info = {
            "layer": best,
            "n_layers": N,
            "calibrated": True,
            "k": k,
            "plain_ms": round(1e3 * t_plain, 2),
            "timed_layers": ends,
            "candidates": table,
        }
        return best


def _disk_key(model: Transformer, key: tuple) -> str | None:
    from ..costs import machine_key

    base = machine_key(model)
    return None if base is None else f"{base}|k={key[0]}|{'greedy' if key[1] else 'sampled'}|{list(key[2])}"


def _stored_calibration(model: Transformer, key: tuple) -> dict[str, Any] | None:
    """A calibration this machine did before for the same model, mode, build and k."""
    from ..costs import stored

    k = _disk_key(model, key)
    entry = stored("early_exit.json", k) if k is not None else None
    if not isinstance(entry, dict) or "candidates" not in entry:
        return None
    entry = dict(entry)
    entry["candidates"] = {int(L): row for L, row in entry["candidates"].items()}
    if entry.get("layer") not in entry["candidates"]:
        return None
    return entry


def _store_calibration(model: Transformer, key: tuple, info: dict[str, Any]) -> None:
    from ..costs import store_measurement

    k = _disk_key(model, key)
    if k is not None:
        store_measurement(
            "early_exit.json", k, {**info, "candidates": {str(L): r for L, r in info["candidates"].items()}}
        )
