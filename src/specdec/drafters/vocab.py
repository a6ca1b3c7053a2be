"""A draft model's vocabulary cut to the tokens text actually uses (FR-Spec, Zhao et al. 2025).

A draft model's LM head scores every token of the vocabulary each step: for the Qwen 0.5B
that is 151,936 rows of 896 inputs, a quarter of its bytes. Most of those tokens almost
never occur. The draft may score only the N most frequent tokens (`DraftVocab`): its greedy
proposal is the argmax over them; sampled, its q is the softmax over them (zero elsewhere),
and the verifier is given exactly that q, so decoding stays exact whatever N is — only the
acceptance can change.

Frequencies are counted once per tokenizer, from a corpus the project may use (the installed
ShareGPT conversations, rendered with the chat template so the template's own tokens count),
never from the benchmark prompts: `specdec models vocab NAME` (`build`). The lists we ship
live in ``specdec/vocab/<name>.safetensors``: the token ids by decreasing count (``ids``), the
counts (``counts``), and in the metadata the tokenizer they belong to (`tokenizer_key`: a
hash of the token list), the data and the command that made them. A user's own lists go to
the specdec cache (``vocab/``); `lookup` finds either by the tokenizer's key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .. import store
from ..model.transformer import Transformer
from ..registry import DATASETS
from ..runtime import per_model
from .base import Option

SHIPPED = Path(__file__).resolve().parent.parent / "vocab"
# Tokens a draft model scores by default (its most frequent, plus its sequence's own): chosen by
# measurement, see docs/results.md. 0 = the whole vocabulary.
DEFAULT_VOCAB = 65536
VOCAB_OPTION = Option(
    "vocab",
    "score only the N most frequent tokens and the sequence's own (a "
    "cheaper LM head; exact whatever N, only acceptance changes; 0 = the whole vocabulary)",
    "--draft-vocab",
)
KEEP = 65536  # ids kept per list (the largest N one can ask for)


def user_dir() -> Path:
    return store.cache_root() / "vocab"


@lru_cache(maxsize=16)
def _key_of_file(path: str, mtime_ns: int, size: int) -> str:
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(path).get_vocab(with_added_tokens=True)
    text = "\x00".join(f"{i}:{s}" for s, i in sorted(vocab.items(), key=lambda t: t[1]))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tokenizer_key(model_dir: str | Path) -> str | None:
    """Names a vocabulary: a hash of its tokens in id order (two models whose tokenizers hold the
    same tokens under the same ids share a key, whatever else their files say). None when the
    directory has no tokenizer.json."""
    f = Path(model_dir) / "tokenizer.json"
    if not f.exists():
        return None
    st = f.stat()
    return _key_of_file(str(f), st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class Frequencies:
    """One tokenizer's token ids by decreasing count, as read from a list file."""

    ids: np.ndarray  # [M] int64
    counts: np.ndarray  # [M] int64
    meta: dict[str, str]
    path: Path

    def coverage(self, n: int) -> float:
        """Share of the counted tokens that the n most frequent cover."""
        total = int(self.meta.get("tokens_counted", 0)) or int(self.counts.sum())
        return float(self.counts[:n].sum()) / max(total, 1)


def _read(path: Path) -> Frequencies:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        return Frequencies(
            f.get_tensor("ids").astype(np.int64),
            f.get_tensor("counts").astype(np.int64),
            dict(f.metadata() or {}),
            path,
        )


def _meta_key(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            return (f.metadata() or {}).get("tokenizer")
    except Exception:  # noqa: BLE001 - a damaged or foreign file is skipped, not fatal
        return None


def lookup(key: str | None) -> Frequencies | None:
    """The frequency list for a tokenizer key: the user's own (the cache) before the shipped ones."""
    if key is None:
        return None
    for folder in (user_dir(), SHIPPED):
        for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
            if _meta_key(path) == key:
                return _read(path)
    return None


def count(texts: Iterable[list[int]], vocab_size: int) -> np.ndarray:
    """Token counts [V] over token-id sequences."""
    counts = np.zeros(vocab_size, np.int64)
    for ids in texts:
        if ids:
            counts += np.bincount(np.asarray(ids, np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def write(path: Path, counts: np.ndarray, *, key: str, always: Iterable[int] = (), meta: dict[str, str]) -> Path:
    """Save the KEEP most frequent ids of `counts` (ties: lower id first), `always` ids first
    (end-of-turn tokens: a draft that cannot say "stop" would lose every final step)."""
    from safetensors.numpy import save_file

    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then id
    first = [i for i in dict.fromkeys(always) if 0 <= i < len(counts)]
    rest = order[~np.isin(order, first)]
    ids = np.concatenate([np.asarray(first, np.int64), rest])[:KEEP]
    ids = ids[(counts[ids] > 0) | np.isin(ids, first)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(
        {"ids": ids.astype(np.int32), "counts": np.minimum(counts[ids], 2**31 - 1).astype(np.int32)},
        str(tmp),
        metadata={"tokenizer": key, "vocab_size": str(len(counts)), "tokens_counted": str(int(counts.sum())), **meta},
    )
    tmp.chmod(0o644)
    tmp.replace(path)
    return path


def build(model: str, out: Path | None = None, *, data: str = "sharegpt", limit: int | None = None, log=print) -> Path:
    """Count the tokens of `data`'s conversations (chat template applied) with `model`'s
    tokenizer and write the list (default: the user's cache, named after the model)."""
    from ..data import conversations
    from ..tokenizer import Tokenizer

    path = store.resolve(model)
    key = tokenizer_key(path)
    if key is None:
        raise ValueError(f"{model}: no tokenizer.json in {path}; a draft vocabulary needs one")
    tok = Tokenizer.from_dir(path)
    n = 0

    def encoded() -> Iterable[list[int]]:
        nonlocal n
        for messages in conversations(data, limit=limit):
            n += 1
            if n % 2000 == 0:
                log(f"{n} conversations ...")
            if tok.has_chat_template:
                try:
                    out = tok.hf.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
                    yield list(out["input_ids"] if hasattr(out, "keys") else out)
                    continue
                except Exception:  # noqa: BLE001 - a template that refuses this turn order: count the text
                    pass
            yield [i for m in messages for i in tok.encode(m["content"])]

    counts = count(encoded(), tok.vocab_size)
    command = f"specdec models vocab {model} --data {data}" + (f" --limit {limit}" if limit else "")
    command += f" --out {out}" if out is not None else ""
    out = out or user_dir() / f"{Path(model).stem if Path(model).exists() else model}.safetensors"
    from ..version import __version__

    spec = DATASETS.get(data)
    source = ", ".join(f"{w.package}=={w.version}" for w in spec.parts) + f" (sha256 {spec.sha256})" if spec else data
    meta = {"data": source, "conversations": str(n), "model": model, "command": command, "specdec": __version__}
    write(out, counts, key=key, always=sorted(tok.eos_ids), meta=meta)
    log(f"{out}: {int(counts.sum())} tokens of {n} conversations, {int((counts > 0).sum())} distinct")
    return out


class DraftVocab:
    """A draft model's LM head over its N most frequent tokens: `logits(h)` -> [.., N] scores of
    `ids` (ascending, so an argmax tie goes to the lower id as over the whole vocabulary). The
    rows are the full head's own (`head_rows`: its packed q4k tiles, or its float/int8 weight
    rows), so a kept token's logit is bitwise what the full head gives it. Shared by every
    sequence the model drafts for; each adds its own tokens (`SequenceVocab`)."""

    def __init__(self, model: Transformer, ids: torch.Tensor, freq: Frequencies | None = None) -> None:
        ids = torch.unique(ids.long())  # sorted ascending
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= model.args.vocab_size:
            raise ValueError("a draft vocabulary's ids must lie in the model's vocabulary")
        self.model, self.ids, self.freq = model, ids.to(model.device), freq
        self.size = ids.numel()
        self.kernel = head_rows(model, ids)
        self.member = torch.zeros(model.args.vocab_size, dtype=torch.bool)
        self.member[ids] = True

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [.., D] -> float32 scores [.., N] of `ids`."""
        return _capped(self.model, self.kernel(h))


class SequenceVocab:
    """One sequence's draft vocabulary: the shared list (`DraftVocab`) plus the tokens its own
    text has shown that the list lacks — the prompt's, then each committed token's. A word of
    the prompt (a name, an identifier, a rare term a RAG passage repeats) is what a draft most
    often copies and what a frequency list most often misses. The extra rows get their own
    small cut of the head, rebuilt when a new token joins (a few tiles)."""

    def __init__(self, base: DraftVocab) -> None:
        self.base = base
        self.extra: list[int] = []
        self._kernel = None
        self._ids: torch.Tensor | None = None  # base ids + extra ids, as `logits` lays them out

    def add(self, tokens: Iterable[int]) -> None:
        member, known = self.base.member, set(self.extra)
        new = [t for t in dict.fromkeys(tokens) if 0 <= t < len(member) and not member[t] and t not in known]
        if new:
            self.extra += new
            self._kernel = self._ids = None

    @property
    def ids(self) -> torch.Tensor:
        if self._ids is None:
            extra = torch.tensor(self.extra, dtype=torch.long, device=self.base.ids.device)
            self._ids = torch.cat([self.base.ids, extra])
        return self._ids

    def logits(self, base: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The base list's scores [.., N] (computed for the whole batch at once) and this
        sequence's hidden [.., D] -> its scores [.., N + extra], laid out as `ids`."""
        if not self.extra:
            return base
        if self._kernel is None:
            self._kernel = head_rows(self.base.model, torch.tensor(self.extra, dtype=torch.long))
        return torch.cat([base, _capped(self.base.model, self._kernel(h))], dim=-1)

    def expand(self, sub: torch.Tensor) -> torch.Tensor:
        """[.., N + extra] -> [.., V] with -inf outside (for the sampling rules)."""
        full = sub.new_full((*sub.shape[:-1], self.base.model.args.vocab_size), float("-inf"))
        full[..., self.ids] = sub
        return full


def _capped(model: Transformer, out: torch.Tensor) -> torch.Tensor:
    out = out.float()
    cap = model.args.final_logit_softcap
    return torch.tanh(out / cap) * cap if cap else out


def head_rows(model: Transformer, ids: torch.Tensor):  # noqa: ANN201 - a LinearKernel
    """The LM head's rows `ids` (in that order) as a kernel of their own: for q4k, the packed
    tiles that hold them, unpacked, reordered and packed again (the same blocks, so the same
    numbers); else their float (or int8) weight rows."""
    from ..model import kquant

    head = model.lm_head
    kern = head.kernel
    ids = ids.long().cpu()
    bias = None if head.bias is None else head.bias.detach()[ids]
    if isinstance(kern, kquant.KQuantKernel):
        packed = kquant.gather_outputs(kern.weight.numpy(), kern.kind, ids.numpy())
        return kquant.KQuantKernel(
            kern.kind, torch.from_numpy(packed.view(np.uint8)), len(ids), kern.in_features, bias, lib=kern.lib
        )
    if head.weight.numel() == 0:
        raise ValueError("this model's LM head keeps no weights to cut a draft vocabulary from")
    weight = head.weight.detach()[ids.to(head.weight.device)].contiguous()
    if kern is None:
        return lambda x: F.linear(x, weight, bias)
    from ..model.kernels import Int8Kernel

    if isinstance(kern, Int8Kernel):
        return Int8Kernel(weight, bias)
    raise ValueError(f"cannot cut a draft vocabulary from a {type(kern).__name__} head")


VOCABS = per_model(memory=False)  # per draft model: its vocabularies by size (None: the whole one)


def shared_vocab(model: Transformer, n: int, shared: torch.Tensor, key: Hashable) -> DraftVocab | None:
    """A draft of another tokenizer scores only the tokens both vocabularies spell the same
    (`shared` [S], the draft's ids; `key` names the pair), those of its N most frequent where a
    frequency list is known: a sampled draft may draw nothing else, and a greedy one drafts text
    the target can take. None where N is 0 (the whole vocabulary, as asked)."""
    if n < 0:
        raise ValueError(f"a draft vocabulary of {n} tokens; give N > 0, or 0 for the whole vocabulary")
    per: dict[Any, DraftVocab | None] = VOCABS.of(model, dict)
    if (key, n) not in per:
        ids = shared
        full = draft_vocab(model, n) if n else None
        if full is not None:
            ids = ids[full.member[ids]]
        per[key, n] = None
        if n and 0 < ids.numel() < model.args.vocab_size:
            try:
                per[key, n] = DraftVocab(model, ids, None if full is None else full.freq)
            except ValueError:  # a head that cannot be cut: the whole one
                per[key, n] = None
    return per[key, n]


def draft_vocab(model: Transformer, n: int) -> DraftVocab | None:
    """The model's N most frequent tokens as a `DraftVocab`; None when N is 0 or covers the whole
    vocabulary, or when no frequency list is known for this tokenizer (then the full head runs)."""
    if n < 0:
        raise ValueError(f"a draft vocabulary of {n} tokens; give N > 0, or 0 for the whole vocabulary")
    per: dict[int, DraftVocab | None] = VOCABS.of(model, dict)  # (once per model, not per request)
    if n not in per:
        per[n] = None
        if 0 < n < model.args.vocab_size and model.source_dir is not None:
            freq = lookup(tokenizer_key(model.source_dir))
            if freq is not None:
                try:
                    per[n] = DraftVocab(model, torch.from_numpy(freq.ids[:n]), freq)
                except ValueError:  # a head that cannot be cut (int8 without its float rows): the full head
                    per[n] = None
    return per[n]
