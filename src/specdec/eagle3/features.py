"""Training examples for an EAGLE-3 head: conversations -> the target's features, cached on disk.

For each conversation (chat template applied, as at inference) the target runs once in its
exact mode over all tokens and we keep, per position q:

* the residual after the head's three feature layers, concatenated [3H] (float16);
* the target's next-token distribution at q (the label for the head: its top `top_k` ids and
  probabilities, float16 — the head is trained to match the target, not the dataset);
* whether token q is part of an assistant answer (the loss counts predictions of those).

Two data modes: `teacher` keeps the dataset's own answers (EAGLE-1 style: one prefill per
conversation); `self` has the target regenerate each conversation's first answer greedily
(self-distillation, what EAGLE-3 and SpecForge recommend: the head then learns the target's
own text; slower, batched). Shards are safetensors files of up to `shard_tokens` tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..tokenizer import Messages, Tokenizer

MANIFEST = "manifest.json"


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


@torch.inference_mode()
def target_features(
    target: Any, ids: list[int], layers: tuple[int, int, int], top_k: int, chunk: int = 256
) -> Example:
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


def regenerate(target_lm: Any, conversations: Iterable[Messages], *, max_new_tokens: int, batch: int,
               seed: int) -> Iterator[Messages]:  # fmt: skip
    """Self-distillation: each conversation's first user turn with the target's own greedy
    answer (several conversations per engine step)."""
    from ..api import generate_batch

    pending: list[Messages] = []

    def flush() -> Iterator[Messages]:
        prompts = [[m for m in c[: c.index(next(m for m in c if m["role"] == "user")) + 1]] for c in pending]
        results = generate_batch(target_lm, prompts, max_new_tokens=max_new_tokens, seed=seed)
        for p, r in zip(prompts, results, strict=True):
            yield [*p, {"role": "assistant", "content": r.text}]
        pending.clear()

    for c in conversations:
        pending.append(c)
        if len(pending) == batch:
            yield from flush()
    if pending:
        yield from flush()


def extract(
    target_lm: Any,
    conversations: Iterable[Messages],
    out_dir: str | Path,
    *,
    layers: tuple[int, int, int],
    max_tokens: int,
    max_len: int = 1024,
    top_k: int = 8,
    shard_tokens: int = 32768,
    progress: bool = True,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Cache features for conversations until `max_tokens` tokens; returns the manifest."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = []
    buf: list[Example] = []
    total = answer_tokens = n_conv = 0
    t0 = time.process_time()

    def flush() -> None:
        if not buf:
            return
        name = f"shard-{len(shards):05d}.safetensors"
        lengths = torch.tensor([e.tokens.numel() for e in buf])
        save_file({
            "tokens": torch.cat([e.tokens for e in buf]), "mask": torch.cat([e.mask for e in buf]),
            "features": torch.cat([e.features for e in buf]), "top_ids": torch.cat([e.top_ids for e in buf]),
            "top_p": torch.cat([e.top_p for e in buf]), "lengths": lengths,
        }, str(out / name))  # fmt: skip
        shards.append({"file": name, "sequences": len(buf), "tokens": int(lengths.sum())})
        buf.clear()

    bar = tqdm(total=max_tokens, unit="tok", desc="target features", disable=not progress)
    tok = target_lm.tokenizer
    for messages in conversations:
        ids, mask = tokenize_conversation(tok, messages, max_len)
        if sum(mask) < 2 or len(ids) < 4:
            continue
        ex = target_features(target_lm.model, ids, layers, top_k)
        ex.mask = torch.tensor(mask)
        buf.append(ex)
        n_conv += 1
        total += len(ids)
        answer_tokens += sum(mask)
        bar.update(len(ids))
        if sum(e.tokens.numel() for e in buf) >= shard_tokens:
            flush()
        if total >= max_tokens:
            break
    flush()
    bar.close()
    manifest = {
        "target": target_lm.name, "mode": target_lm.model.mode, "feature_layers": list(layers), "top_k": top_k,
        "max_len": max_len, "conversations": n_conv, "tokens": total, "answer_tokens": answer_tokens,
        "cpu_seconds": round(time.process_time() - t0, 1), "shards": shards, **(record or {}),
    }  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


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
        start = 0
        for end in ends:
            sl = slice(start, end)
            examples.append(Example(t["tokens"][sl].long(), t["mask"][sl], t["features"][sl], t["top_ids"][sl].long(),
                                    t["top_p"][sl]))  # fmt: skip
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
