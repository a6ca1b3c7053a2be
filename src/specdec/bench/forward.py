"""`specdec bench forward`: milliseconds per target forward for k new tokens, per mode.

For each precision/kernel mode the model is loaded, a prompt of `context` tokens is
prefilled, and a pass over k new tokens (k = 1, 2, 4, 8, 16) is timed repeatedly on top of
it (the cache is rolled back between repeats, as a rejected draft would be). Each mode is
also checked for batch invariance: are the logits of one k-token pass bitwise equal to those
of k one-token passes? The q4k mode's passes are set against this machine's roofline (see
`roofline`): each k's floor max(bytes / bandwidth, multiply-adds / rate), for the whole pass,
the LM head and the attention.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..metrics import timer
from ..model.kernels import MODES
from ..model.load import load_transformer
from ..model.transformer import Transformer
from . import roofline, side_by_side
from .side_by_side import pass_times, tokens

KS = (1, 2, 4, 8, 16)


@dataclass
class ModeResult:
    mode: str
    ms: dict[int, float] = field(default_factory=dict)  # k -> median ms per pass
    # k -> the median over rounds of the k pass's time over the same round's one-token pass,
    # and the lowest and highest round: what compares across runs (the ms move with the machine)
    ratio: dict[int, float] = field(default_factory=dict)
    ratio_band: dict[int, list[float]] = field(default_factory=dict)
    batch_invariant: bool = False
    max_abs_diff: float = 0.0  # k-token pass vs one-token passes, logits
    roofline: dict[str, Any] | None = None  # q4k: per k, the pass and its parts against their floors

    def to_dict(self) -> dict[str, Any]:
        ms = {str(k): v for k, v in self.ms.items()}
        out = {
            "ms": ms,
            "ratio_to_k1": {str(k): v for k, v in self.ratio.items()},
            "ratio_band": {str(k): v for k, v in self.ratio_band.items()},
            "batch_invariant": self.batch_invariant,
            "max_abs_diff": self.max_abs_diff,
            "ratio_k8_k1": self.ratio.get(8),
        }
        if self.roofline is not None:
            out["roofline"] = self.roofline
        return out


def time_mode(model: Transformer, *, context: int, ks: tuple[int, ...], repeats: int, roof: bool = False) -> ModeResult:
    """`roof`: set the passes against this machine's roofline (q4k only). The probes run
    beside each k's timing and the best of them is the roof: on a machine whose memory and
    clock move from second to second, a floor from one early probe could be far off."""
    dev = model.device
    prompt = tokens(context, model.args.vocab_size, 0).to(dev)
    new = tokens(max(ks), model.args.vocab_size, 1).to(dev)
    cache = model.new_cache(context + max(ks))
    model(prompt, cache, last_only=True)
    result = ModeResult(model.mode)
    heads: dict[int, float] = {}
    attns: dict[int, float] = {}
    machine: roofline.Machine | None = None
    if roof:
        machine = roofline.best(machine, roofline.probe(rounds=3))
    times = pass_times(model, cache, new, context=context, ks=ks, repeats=repeats)
    base = ks[0]
    for k in ks:
        result.ms[k] = statistics.median(times[k])
        ratios = [a / b for a, b in zip(times[k], times[base], strict=True)]
        result.ratio[k] = statistics.median(ratios)
        result.ratio_band[k] = [min(ratios), max(ratios)]
    if roof:
        machine = roofline.best(machine, roofline.probe(rounds=3))
        for k in ks:
            heads[k], attns[k] = roofline.parts(model, cache, context, k, repeats)
    if machine is not None:
        result.roofline = roofline.rows(model, machine, result.ms, heads, attns, context)
    # Batch invariance: one 8-token pass vs eight 1-token passes over the same prefix.
    cache.truncate(context)
    together = model(new[:, :8], cache).logits
    cache.truncate(context)
    alone = torch.cat([model(new[:, i : i + 1], cache).logits for i in range(8)], dim=1)
    result.batch_invariant = bool(torch.equal(together, alone))
    result.max_abs_diff = float((together - alone).abs().max())
    return result


def time_draft(
    target: Transformer, draft: Transformer, vocabs: list[int], *, context: int, repeats: int, bridge: Any = None
) -> dict[str, Any]:
    """One drafted token as the draft-model drafter computes it (`draft_model.draft_step`: its
    one-row pass, and its LM head over each vocabulary of `vocabs`, 0 = the whole one; a draft
    of another tokenizer, `bridge`, over the tokens the pair shares, `vocab.shared_vocab`)
    beside the target's one-token pass, interleaved in one loop so both see the machine's same
    moments."""
    from ..drafters.draft_model import greedy_token
    from ..drafters.vocab import DEFAULT_VOCAB, draft_vocab, shared_vocab

    if bridge is None:
        heads = {n: draft_vocab(draft, n) for n in vocabs}
    else:
        heads = {n: shared_vocab(draft, n, bridge.shared_draft, ("shared", bridge)) for n in vocabs}
    tcache, dcache = target.new_cache(context + 1), draft.new_cache(context + 1)
    prompt = tokens(context, min(target.args.vocab_size, draft.args.vocab_size), 0)
    target(prompt, tcache, last_only=True, head=False)
    draft(prompt, dcache, last_only=True, head=False)
    new = tokens(1, draft.args.vocab_size, 1)
    t_ms: list[float] = []
    d_ms: dict[int, list[float]] = {n: [] for n in vocabs}
    for r in range(repeats + 1):
        tcache.truncate(context)
        with timer(target.device) as t:
            target(new, tcache)
        if r:
            t_ms.append(t[0] * 1e3)
        for n, vocab in heads.items():
            dcache.truncate(context)
            with timer(draft.device) as t:
                greedy_token(draft, vocab, new[0], dcache)
            if r:
                d_ms[n].append(t[0] * 1e3)
    target_ms = statistics.median(t_ms)
    rows = {
        str(n): {
            "tokens": heads[n].size if heads[n] is not None else draft.args.vocab_size,
            "coverage": round(heads[n].freq.coverage(heads[n].size), 4) if heads[n] and heads[n].freq else 1.0,
            "ms": statistics.median(d_ms[n]),
            "ratio": statistics.median(d_ms[n]) / target_ms,
        }
        for n in vocabs
    }
    default = str(DEFAULT_VOCAB) if str(DEFAULT_VOCAB) in rows else str(vocabs[0])
    return {
        "target_ms": target_ms,
        "mode": draft.mode,
        "vocab": rows,
        "default_vocab": int(default),
        "draft_ratio": rows[default]["ratio"],
    }


def run(
    path: str,
    *,
    modes: list[str],
    context: int = 128,
    ks: tuple[int, ...] = KS,
    repeats: int = 5,
    device: str | None = None,
    progress=print,
    gguf: Path | None = None,
    draft: str | None = None,
    draft_vocabs: list[int] | None = None,
    draft_bits: int | None = None,
    peer: bool = True,
    rounds: int = 3,
    prefill: tuple[int, ...] = (),
) -> dict[str, Any]:
    """`gguf`: the file behind `path`; with `peer`, the q4k mode's passes are set beside
    llama.cpp's on it (`side_by_side`, `rounds` interleaved rounds, `prefill` lengths too)."""
    out: dict[str, Any] = {
        "context": context,
        "ks": list(ks),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "modes": {},
    }
    for mode in modes:
        model = load_transformer(path, dtype=mode, device=device)
        roof = mode == "q4k"
        progress(f"timing {mode}{' against the roofline (streaming read, dot products)' if roof else ''} ...")
        out["modes"][mode] = time_mode(model, context=context, ks=ks, repeats=repeats, roof=roof).to_dict()
        out["device"] = str(model.device)
        if mode == "q4k" and peer and gguf is not None and gguf.exists():
            if side_by_side.llama_bench() is None:
                out["llama_cpp"] = {"unavailable": side_by_side.unavailable()}
            else:
                progress(f"timing llama.cpp (llama-bench) beside the q4k mode on {gguf.name}, interleaved ...")
                out["llama_cpp"] = side_by_side.compare(
                    model, gguf, context=context, ks=ks, prefill=prefill, rounds=rounds, progress=progress
                )
        del model
        gc.collect()
    from ..info import collect

    machine = collect(bandwidth=False)
    out["cpu"], out["kernels"] = machine["cpu"]["model"], machine["kernels"]  # which path produced the numbers
    if draft is not None:
        from ..drafters.vocab import DEFAULT_VOCAB

        vocabs = list(dict.fromkeys(draft_vocabs or [DEFAULT_VOCAB, 0]))
        progress(f"timing one drafted token of {Path(draft).name} beside the target's one-token pass ...")
        target = load_transformer(path, dtype="auto", device=device)
        dmodel = load_transformer(draft, dtype="auto", device=device, bits=draft_bits)
        across = _bridge(path, draft, target, dmodel)
        out["draft"] = {"name": draft, "bits": draft_bits, "tokenizer": "across" if across else "same"} | time_draft(
            target, dmodel, vocabs, context=context, repeats=max(repeats, 9), bridge=across
        )
        del target, dmodel
        gc.collect()
    if peer and "llama_cpp" not in out:
        out["llama_cpp"] = {
            "unavailable": "llama.cpp is timed on a .gguf file in the q4k mode; this run has "
            + ("no .gguf file" if gguf is None or not gguf.exists() else "no q4k mode")
        }
    return out


def _bridge(path: str, draft: str, target: Transformer, dmodel: Transformer) -> Any:
    """The pair's `cross.Bridge` where the draft speaks another tokenizer (None: the same one)."""
    from ..drafters import cross
    from ..tokenizer import Tokenizer, tokenizers_equal

    toks = Tokenizer.from_dir(path), Tokenizer.from_dir(draft)
    if tokenizers_equal(*toks):
        return None
    return cross.bridge(*toks, target.args.vocab_size, dmodel.args.vocab_size)


def table(result: dict[str, Any]) -> str:
    ks = result["ks"]
    head = f"{'mode':8s}" + "".join(f"{'k=' + str(k):>10s}" for k in ks) + f"{'k8/k1':>8s}  batch-invariant"
    lines = [head]
    for mode, r in result["modes"].items():
        ratio = r["ratio_k8_k1"]
        lines.append(
            f"{mode:8s}"
            + "".join(f"{r['ms'][str(k)]:10.1f}" for k in ks)
            + (f"{ratio:8.2f}" if ratio else f"{'':8s}")
            + f"  {'yes' if r['batch_invariant'] else 'no (max diff ' + format(r['max_abs_diff'], '.1e') + ')'}"
        )
        if r.get("ratio_band"):
            lines.append(
                f"{'':8s}over k={ks[0]}: "
                + ", ".join(
                    f"k={k} {r['ratio_to_k1'][str(k)]:.2f} "
                    f"({r['ratio_band'][str(k)][0]:.2f}-{r['ratio_band'][str(k)][1]:.2f})"
                    for k in ks[1:]
                )
            )
    k = result.get("kernels") or {}
    where = f"; {result['cpu']}, native kernels {k.get('build') or 'unavailable'}: {k.get('why', '')}" if k else ""
    text = "\n".join(lines) + (
        f"\n(ms per target forward, median; 'over k=1': each k's pass over the one-token pass of "
        f"the same round, median (lowest-highest round), rounds interleaved over k{where})"
    )
    roof = (result["modes"].get("q4k") or {}).get("roofline")
    text = text + "\n\n" + roofline.table(roof) if roof else text
    peer = result.get("llama_cpp")
    if peer and "rows" in peer:
        from .side_by_side import table as peer_table

        text += "\n\nbeside llama.cpp on the same file (q4k mode):\n" + peer_table(peer)
    elif peer:
        text += f"\n\nllama.cpp: not timed ({peer['unavailable']})"
    d = result.get("draft")
    if d:
        bits = f", {d['bits']}-bit packing" if d.get("bits") else ""
        lines = [
            f"draft {d['name']} ({d['mode']}{bits}): one drafted token as drafting computes it, beside the target's "
            f"one-token pass ({d['target_ms']:.1f} ms)"
            + (
                "; another tokenizer: its head over the tokens both spell the same"
                if d.get("tokenizer") == "across"
                else ""
            ),
            f"{'vocabulary':>12s}{'tokens':>9s}{'coverage':>10s}{'ms':>8s}{'x target':>10s}",
        ]
        for n, r in d["vocab"].items():
            name = "full" if n == "0" else n + (" (default)" if int(n) == d["default_vocab"] else "")
            lines.append(f"{name:>12s}{r['tokens']:9d}{r['coverage']:10.1%}{r['ms']:8.2f}{r['ratio']:10.2f}")
        text += "\n\n" + "\n".join(lines)
    return text


def default_modes(device: torch.device) -> list[str]:
    return [m for m in MODES if device.type == "cuda" or m != "fp16"]
