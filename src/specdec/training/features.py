"""Training examples for an EAGLE-3 head: conversations -> the target's features, cached on disk.

For each conversation (chat template applied, as at inference) the target runs once in its
exact mode over all tokens and we keep, per position q:

* the residual after the head's three feature layers, concatenated [3H] (float16);
* the target's next-token distribution at q (the label for the head: its top `top_k` ids and
  probabilities, float16 — the head is trained to match the target, not the dataset);
* whether token q is part of an assistant answer (the loss counts predictions of those).

Two data modes: `teacher` keeps the dataset's own answers (EAGLE-1 style: one prefill per
conversation); `self` has the target answer each conversation's first user turn greedily
(self-distillation, what EAGLE-3 and SpecForge recommend: the head then learns the target's
own text, which is what it drafts at inference), several conversations per target pass, the
features kept from the generating passes. Shards are safetensors files of up to
`shard_tokens` tokens; each example records which conversation it came from (its index in the
stream of conversations given), so an extraction that was stopped resumes where it was
(`extract`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..store import write_json
from ..tokenizer import Messages, Tokenizer

MANIFEST = "manifest.json"
PARTIAL = "partial.json"  # the shards written so far by an extraction that has not finished


def tokenize_conversation(tok: Tokenizer, messages: Messages, max_len: int) -> tuple[list[int], list[bool]]:
    """Token ids of a whole conversation through the chat template and, per token, whether it
    lies inside an assistant message's content (found through the prefix renderings and the
    tokenizer's character offsets). Cut to `max_len` tokens."""
    hf = tok.hf

    def render(msgs: Messages, prompt: bool = False) -> str:
        if tok.has_chat_template:
            return hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        # no template (a base model): the turns' texts one after another, as a raw prompt is fed
        return "".join(m["content"] + "\n\n" for m in msgs)

    text = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:  # an answer to nothing is not one to learn
            continue
        before = render(messages[:i], prompt=True)
        upto = render(messages[: i + 1])
        if not text.startswith(upto) or not upto.startswith(before):
            continue  # a template that rewrites earlier turns: leave this answer out of the loss
        spans.append((len(before), len(upto)))
    enc = hf(text, return_offsets_mapping=True, add_special_tokens=False)
    ids = list(enc["input_ids"])[:max_len]
    mask = [any(a <= s and e <= b for a, b in spans) and e > s for s, e in enc["offset_mapping"][: len(ids)]]
    return ids, mask


@dataclass
class Example:
    tokens: torch.Tensor  # [L] int64
    mask: torch.Tensor  # [L] bool: token is an assistant answer's
    features: torch.Tensor  # [L, 3H] float16
    top_ids: torch.Tensor  # [L, K] int64: the target's most probable next tokens after position q
    top_p: torch.Tensor  # [L, K] float16: their probabilities
    source: int = -1  # index of the conversation it came from in the stream given (-1: unknown)


@torch.inference_mode()
def target_features(target: Any, ids: list[int], layers: tuple[int, int, int], top_k: int, chunk: int = 256) -> Example:
    """One conversation through the target (chunked prefill, its exact mode)."""
    tokens = torch.tensor(ids, dtype=torch.long)
    cache = target.new_cache(len(ids))
    feats, tids, tps = [], [], []
    for s in range(0, len(ids), chunk):
        out = target(tokens[None, s : s + chunk], cache, output_layers=layers)
        feats.append(torch.cat([out.layers[i][0] for i in layers], -1).half())
        probs = torch.softmax(out.logits[0].float(), -1)
        p, i = probs.topk(top_k, -1)
        tids.append(i)
        tps.append(p.half())
    return Example(tokens, torch.zeros(len(ids), dtype=torch.bool), torch.cat(feats), torch.cat(tids), torch.cat(tps))


def teacher_examples(
    target_lm: Any,
    conversations: Iterable[Messages],
    *,
    layers: tuple[int, int, int],
    top_k: int,
    max_len: int,
    skip: Collection[int] = (),
) -> Iterator[Example]:
    """Teacher forcing: each conversation as written, one chunked prefill through the target
    (conversations whose index is in `skip` are left out: done already)."""
    tok = target_lm.tokenizer
    for n, messages in enumerate(conversations):
        if n in skip:
            continue
        ids, mask = tokenize_conversation(tok, messages, max_len)
        if sum(mask) < 2 or len(ids) < 4:
            continue
        ex = target_features(target_lm.model, ids, layers, top_k)
        ex.mask = torch.tensor(mask)
        ex.source = n
        yield ex


@torch.inference_mode()
def self_distill_examples(
    target_lm: Any,
    conversations: Iterable[Messages],
    *,
    layers: tuple[int, int, int],
    top_k: int,
    max_len: int,
    max_new_tokens: int,
    batch: int,
    skip: Collection[int] = (),
) -> Iterator[Example]:
    """Self-distillation: each conversation's first user turn (chat template, generation
    prompt) answered by the target itself, greedily, `batch` sequences per target pass; the
    features and distributions are kept from the generating passes themselves, so no second
    pass over the answers is needed. Prompts longer than half of `max_len` are skipped. The
    answer (ending in the target's end-of-turn token when it stops) is the masked part.
    Conversations whose index is in `skip` are left out (done already); in the batch-invariant
    modes an answer does not depend on which others share its passes."""
    from ..model.transformer import Segment

    model, tok = target_lm.model, target_lm.tokenizer
    eos = tok.eos_ids

    def prompts() -> Iterator[tuple[int, list[int]]]:
        for n, messages in enumerate(conversations):
            if n in skip:
                continue
            first = next(i for i, m in enumerate(messages) if m["role"] == "user")
            ids = (
                tok.encode_chat(messages[: first + 1])
                if tok.has_chat_template
                else tok.encode(messages[first]["content"])
            )
            if 4 <= len(ids) <= max_len // 2:
                yield n, ids

    pending = prompts()
    live: list[dict[str, Any]] = []
    exhausted = False
    while True:
        while not exhausted and len(live) < batch:
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            n, ids = item
            n_new = min(max_new_tokens, max_len - len(ids))
            live.append(
                {
                    "source": n,
                    "ids": ids,
                    "prompt": len(ids),
                    "n_new": n_new,
                    "cache": model.new_cache(len(ids) + n_new),
                    "feats": [],
                    "tids": [],
                    "tps": [],
                    "new": None,
                }
            )
        if not live:
            return
        segs = [
            Segment(
                torch.tensor(s["ids"] if s["new"] is None else s["ids"][-1:], dtype=torch.long),
                s["cache"],
                last_only=True,
            )
            for s in live
        ]
        outs = model.forward_batch(segs, output_layers=layers)
        done = []
        for s, out in zip(live, outs, strict=True):
            s["feats"].append(torch.cat([out.layers[i][0] for i in layers], -1).half())
            probs = torch.softmax(out.logits[0, -1].float(), -1)
            p, i = probs.topk(top_k)
            s["tids"].append(i[None])
            s["tps"].append(p.half()[None])
            nxt = int(i[0])  # greedy: the most probable token
            s["new"] = 0 if s["new"] is None else s["new"] + 1
            s["ids"].append(nxt)
            if nxt in eos or s["new"] + 1 >= s["n_new"]:
                done.append(s)
        for s in done:
            live.remove(s)
            L, P = len(s["ids"]), s["prompt"]
            feats = torch.cat([*s["feats"], s["feats"][0].new_zeros(1, s["feats"][0].shape[1])])  # [L, 3H]
            k = s["tids"][0].shape[1]
            # distributions exist for the prompt's last row and every generated row but the last
            tids = torch.cat([torch.zeros(P - 1, k, dtype=torch.long), *s["tids"], torch.zeros(1, k, dtype=torch.long)])
            tps = torch.cat(
                [torch.zeros(P - 1, k, dtype=torch.float16), *s["tps"], torch.zeros(1, k, dtype=torch.float16)]
            )
            mask = torch.zeros(L, dtype=torch.bool)
            mask[P:] = True
            assert feats.shape[0] == L and tids.shape[0] == L
            yield Example(torch.tensor(s["ids"], dtype=torch.long), mask, feats, tids, tps, s["source"])


def extract(
    make_examples: Callable[[frozenset[int]], Iterable[Example]],
    out_dir: str | Path,
    *,
    max_tokens: int,
    shard_tokens: int = 32768,
    progress: bool = True,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Cache examples in shards until `max_tokens` tokens; returns the manifest (with `record`).
    `make_examples(done)`: the examples (`teacher_examples` or `self_distill_examples`) of the
    conversations not in `done`.

    Resumable: every shard written is listed in `partial.json` with `record`, so a rerun with
    the same record (`max_tokens` aside: the cache may also grow) keeps those shards and
    extracts only the conversations they do not hold; a finished cache that holds fewer tokens
    than wanted grows the same way. Anything else in `out_dir` is extracted anew."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = record or {}
    state = _resumable(out, record, max_tokens)
    shards: list[dict[str, Any]] = state["shards"]
    total, answer_tokens, n_conv = state["tokens"], state["answer_tokens"], state["conversations"]
    done: set[int] = set(state["sources"])
    buf: list[Example] = []
    t0, cpu_before = time.process_time(), state["cpu_seconds"]

    def summary() -> dict[str, Any]:
        return {
            "conversations": n_conv,
            "tokens": total,
            "answer_tokens": answer_tokens,
            "cpu_seconds": round(cpu_before + time.process_time() - t0, 1),
            "shards": shards,
            "sources": sorted(done),
            **record,
        }

    def flush() -> None:
        if not buf:
            return
        name = f"shard-{len(shards):05d}.safetensors"
        lengths = torch.tensor([e.tokens.numel() for e in buf])
        save_file(
            {
                "tokens": torch.cat([e.tokens for e in buf]),
                "mask": torch.cat([e.mask for e in buf]),
                "features": torch.cat([e.features for e in buf]),
                "top_ids": torch.cat([e.top_ids for e in buf]),
                "top_p": torch.cat([e.top_p for e in buf]),
                "lengths": lengths,
                "sources": torch.tensor([e.source for e in buf], dtype=torch.long),
            },
            str(out / name),
        )
        shards.append({"file": name, "sequences": len(buf), "tokens": int(lengths.sum())})
        done.update(e.source for e in buf)
        buf.clear()
        write_json(out / PARTIAL, summary(), indent=2)

    bar = tqdm(
        total=max_tokens, initial=min(total, max_tokens), unit="tok", desc="target features", disable=not progress
    )
    if total < max_tokens:
        for ex in make_examples(frozenset(done)):
            buf.append(ex)
            n_conv += 1
            total += int(ex.tokens.numel())
            answer_tokens += int(ex.mask.sum())
            bar.update(int(ex.tokens.numel()))
            if sum(e.tokens.numel() for e in buf) >= shard_tokens:
                flush()
            if total >= max_tokens:
                break
    flush()
    bar.close()
    manifest = summary()
    write_json(out / MANIFEST, manifest, indent=2)
    (out / PARTIAL).unlink(missing_ok=True)
    return manifest


def _resumable(out: Path, record: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """What an earlier extraction into `out` with this record left to build on: its shards,
    counts and conversations; nothing (and its files removed) where the record differs or a
    finished cache already holds `max_tokens`."""
    fresh = {"shards": [], "tokens": 0, "answer_tokens": 0, "conversations": 0, "cpu_seconds": 0.0, "sources": []}

    def same(d: dict[str, Any]) -> bool:
        return {k: d.get(k) for k in record if k != "tokens_wanted"} == {
            k: v for k, v in record.items() if k != "tokens_wanted"
        }

    for name in (PARTIAL, MANIFEST):
        try:
            found = json.loads((out / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        usable = same(found) and "sources" in found and all((out / sh["file"]).exists() for sh in found["shards"])
        if usable and (name == PARTIAL or found["tokens"] < max_tokens):
            return {k: found[k] for k in fresh}
    for old in [*out.glob("shard-*.safetensors"), out / PARTIAL, out / MANIFEST]:
        old.unlink(missing_ok=True)
    return fresh


def load_examples(directory: str | Path) -> tuple[dict[str, Any], list[Example]]:
    """Every cached example of a feature directory (features stay float16 in memory)."""
    from safetensors.torch import load_file

    d = Path(directory)
    if not (d / MANIFEST).exists():
        raise FileNotFoundError(f"{d} holds no cached features ({MANIFEST} missing); run the feature step first")
    manifest = json.loads((d / MANIFEST).read_text())
    examples: list[Example] = []
    for shard in manifest["shards"]:
        t = load_file(str(d / shard["file"]))
        ends = t["lengths"].cumsum(0).tolist()
        sources = t["sources"].tolist() if "sources" in t else [-1] * len(ends)
        start = 0
        for end, source in zip(ends, sources, strict=True):
            sl = slice(start, end)
            examples.append(
                Example(
                    t["tokens"][sl].long(),
                    t["mask"][sl],
                    t["features"][sl],
                    t["top_ids"][sl].long(),
                    t["top_p"][sl],
                    source,
                )
            )
            start = end
    return manifest, examples


def draft_vocabulary(examples: list[Example], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target tokens the head most needs: counted over the target's own top-1
    predictions at answer positions (what it will have to draft), then over all tokens of the
    data; ties and unseen tokens by id. Returns target ids [size], most frequent first."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for e in examples:
        counts.index_add_(0, e.top_ids[:-1, 0][e.mask[1:]], torch.ones(int(e.mask[1:].sum()), dtype=torch.float64))
        counts.index_add_(0, e.tokens, torch.full((e.tokens.numel(),), 1e-3, dtype=torch.float64))
    order = torch.argsort(-counts, stable=True)
    return order[:size].clone()
