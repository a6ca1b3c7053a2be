"""A draft model of another tokenizer (Universal Assisted Generation, Hugging Face 2024; Timor et
al., "Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies", ICML 2025).

The draft reads the committed text in its own tokens: the target's tokens spelled out as bytes
(`Tokenizer.token_bytes`) and encoded again by the draft's tokenizer, its last two tokens read
again as each step's text arrives (a word the target finished in two pieces is one token to the
draft, as its tokenizer would have written it). A character the target has only begun (a piece
of a UTF-8 sequence) waits until it is whole; meanwhile the draft proposes nothing.

- Greedy, by the text (string-level exact match): the draft's argmax tokens are spelled out and
  the text encoded by the target's tokenizer; those target tokens are the proposal. Greedy
  verification keeps exactly the target's argmaxes, whatever was proposed: exact.
- Sampled, by the shared vocabulary (token-level intersection, TLI): the draft draws only among
  the tokens both vocabularies spell the same (`Bridge`), from its distribution restricted to
  them and renormalised, q'(x) = q(x) / sum of q over the shared tokens; each drawn token is one
  target token, and q' (zero off the shared tokens) goes to the standard rejection rule, which
  keeps the target's distribution exactly for any q' (tested against the law, and a rule that
  forgets the renormalisation fails).

The draft's head scores only the shared tokens (`vocab.shared_vocab`; those of its N most frequent
where a frequency list for its tokenizer is known): a sampled draft may draw nothing else, so its q'
is unchanged, and a greedy draft's text is spelled in tokens both sides know. A chat is read in the
draft's own chat template: the conversation the target's template rendered (`draft_prompt`), so a
draft does not read another family's markup as text. The draft's confidence stops it as for a draft
of the target's tokenizer; a token tree is not grown across tokenizers (a chain).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import torch

from .. import store
from ..model.config import ModelArgs
from ..model.transformer import Transformer
from ..offers import Estimates, Offer
from ..tokenizer import Tokenizer, tokenizers_equal
from .base import Draft, Drafter, DraftSession, Feedback, register_across
from .draft_model import DraftModelDrafter
from .merge import along
from .vocab import DEFAULT_VOCAB, DraftVocab, shared_vocab
from .window import DEFAULT_WINDOW

TAIL = 2  # the draft's last tokens read again with each step's new text
# a little code and prose: the share of the draft's tokens for it that the target spells the same
# decides whether a pair drafts across (`check_bridge`)
PROBE = (
    'def is_palindrome(s: str) -> bool:\n    """Return True when s reads the same both ways."""\n'
    "    return s == s[::-1]\n\nThe cat sleeps on the mat, and the dog watches the door.\n"
    "Le chat dort sur le tapis. 1.5 + 2 = 3.5\n"
)
SPREAD = 3  # draft tokens the cache holds per new target token
MIN_SHARED = 0.5  # the least share of the draft's tokens for `PROBE` the target must spell the same


class Bridge:
    """Two tokenizers' common ground, built once per pair: the tokens both vocabularies spell
    with the same bytes (special tokens apart), as maps between their ids; and the draft's own
    start (its BOS, where its tokenizer begins a text with one)."""

    def __init__(self, target: Tokenizer, draft: Tokenizer, target_vocab: int, draft_vocab: int) -> None:
        self.target, self.draft = target, draft
        self.target_vocab, self.draft_vocab = target_vocab, draft_vocab
        spelled, d_spelled = _spellings(target), _spellings(draft)
        pairs = [(d, spelled[key]) for key, d in d_spelled.items() if key in spelled]
        pairs = [(d, t) for d, t in pairs if d < draft_vocab and t < target_vocab]
        self.to_target = torch.full((draft_vocab,), -1, dtype=torch.long)  # [V_d] target id, -1: not shared
        d_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
        t_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
        self.to_target[d_ids] = t_ids
        self.shared_draft, self.shared_target = d_ids, t_ids  # [S] each, pairwise
        self.mask = torch.zeros(draft_vocab, dtype=torch.bool)  # [V_d]
        self.mask[d_ids] = True
        # each side's token of a single byte, where it has one (what bytes that are not UTF-8 become)
        self.target_bytes = _single_bytes(spelled)
        self.draft_bytes = _single_bytes(d_spelled)
        self.draft_start = [int(i) for i in draft.hf("")["input_ids"]]  # (the draft's BOS, if it writes one)
        self.target_start = len(target.hf("")["input_ids"])  # (the target's: not text to carry over)
        self.refused: str | None = None  # why the pair cannot draft across (`bridge`), None: it can

    def coverage(self) -> dict[str, Any]:
        """How much of each vocabulary the other spells the same, and of the draft's tokens for
        a text (`PROBE`): what a sampled draft may draw from."""
        n = len(self.shared_draft)
        probe = self.draft.encode_text(PROBE)
        return {
            "shared_tokens": n,
            "of_draft": round(n / self.draft.vocab_size, 4),
            "of_target": round(n / self.target.vocab_size, 4),
            "of_text": round(sum(bool(self.mask[i]) for i in probe if i < len(self.mask)) / max(len(probe), 1), 4),
        }

    def spell(self, tokenizer: Tokenizer, ids: Sequence[int]) -> bytes:
        return b"".join(tokenizer.token_bytes(int(i)) for i in ids)


def _spellings(tok: Tokenizer) -> dict[tuple[bool, bytes], int]:
    """(special?, bytes) -> the first id of that spelling: the key tokens of two vocabularies
    meet on (a byte-fallback token and a piece of the same byte are one spelling: the first)."""
    special = set(tok.hf.all_special_ids) | {i for i, t in tok.hf.added_tokens_decoder.items() if t.special}
    out: dict[tuple[bool, bytes], int] = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if b:
            out.setdefault((i in special, b), i)
    return {key: i for key, i in out.items() if not key[0]}  # (special tokens are never drawn across)


def _single_bytes(spelled: dict[tuple[bool, bytes], int]) -> dict[int, int]:
    return {key[1][0]: i for key, i in spelled.items() if len(key[1]) == 1}


def encode(tok: Tokenizer, single: dict[int, int], data: bytes) -> tuple[list[int], list[int]]:
    """`data` in `tok`'s tokens, with the byte each token ends at: runs of UTF-8 text encoded by
    the tokenizer, a byte that is not UTF-8 as its own token (`single`). It stops before a
    character begun and not finished at the end, and before a byte it has no token for."""
    ids: list[int] = []
    ends: list[int] = []
    pos = 0
    while pos < len(data):
        chunk = data[pos:]
        try:
            text, bad = chunk.decode(), False
        except UnicodeDecodeError as e:
            text, bad = chunk[: e.start].decode(), e.reason != "unexpected end of data"
        start = pos
        for t in tok.encode_text(text) if text else []:
            piece = tok.token_bytes(t)
            if data[pos : pos + len(piece)] != piece:  # (a token that does not spell the text: stop)
                return ids, ends
            pos += len(piece)
            ids.append(t)
            ends.append(pos)
        if pos != start + len(text.encode()) or not bad or data[pos] not in single:
            break
        ids.append(single[data[pos]])
        pos += 1
        ends.append(pos)
    return ids, ends


def bridge(
    target: Tokenizer,
    draft: Tokenizer,
    target_vocab: int,
    draft_vocab: int,
    names: tuple[str, str] = ("target", "draft"),
) -> Bridge:
    """The pair's `Bridge`, built and checked (`check_bridge`: its `refused`, None where it
    drafts) on first use, and kept on the target's tokenizer."""
    key = (id(draft), target_vocab, draft_vocab)
    found = target.bridges.get(key)
    if found is None or found.draft is not draft:
        found = target.bridges[key] = Bridge(target, draft, target_vocab, draft_vocab)
        try:
            check_bridge(found, names)
        except ValueError as e:
            found.refused = str(e)
    return found


def check_bridge(b: Bridge, names: tuple[str, str]) -> None:
    """One clear line where the pair cannot draft across: too few tokens spelled the same, or
    a draft tokenizer whose encoding does not spell its text back (a normaliser)."""
    share = b.coverage()["of_text"]
    if share < MIN_SHARED:
        raise ValueError(
            f"{names[0]} and {names[1]} spell only {share:.0%} of the draft's tokens for a text the same (at "
            f"least {MIN_SHARED:.0%} is needed to draft across tokenizers); pick a draft whose vocabulary is closer"
        )
    if b.spell(b.draft, b.draft.encode_text(PROBE)) != PROBE.encode():
        raise ValueError(
            f"the {names[1]} tokenizer does not spell text back as it was given (it normalises it), so it "
            f"cannot draft for {names[0]} across tokenizers; pick a draft with a byte-level or byte-fallback tokenizer"
        )


def pair_report(target: str, draft: str) -> dict[str, Any]:
    """`specdec info --pair`: whether `draft` drafts for `target` and how (the same tokenizer, or
    across it: the shared vocabulary's coverage), from their tokenizers alone."""
    paths = [store.resolve(n) for n in (target, draft)]
    toks = [Tokenizer.from_dir(p) for p in paths]
    out: dict[str, Any] = {"target": target, "draft": draft}
    if tokenizers_equal(*toks):
        return {**out, "tokenizer": "same"}
    b = bridge(*toks, *(_vocab_size(p, t) for p, t in zip(paths, toks, strict=True)), names=(target, draft))
    out.update(tokenizer="across", **b.coverage(), drafts=b.refused is None)
    if b.refused is not None:
        out["why"] = b.refused
    return out


def draft_prompt(b: Bridge, context: Sequence[int]) -> tuple[list[int], int] | None:
    """A chat's prompt in the draft's own chat template: the conversation the target's template
    rendered for `context` (`Tokenizer.conversation`), rendered by the draft's, and how many
    target tokens that stands for. None where the prompt was not a conversation, carries tools
    (their schema and calls are the target's own format), the draft has no template, or its
    template refuses the conversation: the draft then reads the target's text as it is."""
    found = b.target.conversation(list(context))
    if found is None or found[1] or not b.draft.has_chat_template:
        return None
    messages, _, n = found
    try:
        return b.draft.encode_chat(messages), n
    except (ValueError, TypeError, jinja2.TemplateError):  # (e.g. a template that wants roles to alternate)
        return None


def _vocab_size(path: Path, tok: Tokenizer) -> int:
    """The model's vocabulary (its head's rows: a tokenizer may have fewer tokens)."""
    config = path / "config.json" if path.is_dir() else None
    if config is not None and config.exists():
        return ModelArgs.from_hf(json.loads(config.read_text())).vocab_size
    return tok.vocab_size


class DraftText:
    """One sequence's committed text as the draft reads it: its bytes, and the draft's tokens for
    all of them but a character still incomplete at the end (`pending`)."""

    def __init__(self, b: Bridge, context: Sequence[int], prompt: tuple[list[int], int] | None = None) -> None:
        """`prompt`: the draft's own tokens for the first tokens of `context` and how many of
        them they stand for (a conversation its chat template rendered, `draft_prompt`); else
        the draft reads the target's text from its own start."""
        self.bridge = b
        own, n = prompt if prompt is not None else (list(b.draft_start), b.target_start)
        self.tokens: list[int] = list(own)
        self.ends: list[int] = list(itertools.accumulate(len(b.draft.token_bytes(t)) for t in own))
        self.data = bytearray(b.spell(b.draft, own) + b.spell(b.target, list(context)[n:]))
        self.floor = len(own)  # tokens never read again (the draft's start, or its rendered prompt)
        self._read(self.floor)

    @property
    def covered(self) -> int:
        return self.ends[-1] if self.ends else 0

    @property
    def pending(self) -> bytes:
        """The committed bytes no draft token stands for yet (a character begun, not finished)."""
        return bytes(self.data[self.covered :])

    def extend(self, target_ids: Sequence[int]) -> None:
        """The target committed `target_ids`: their text joins, the last TAIL tokens read again."""
        self.data += self.bridge.spell(self.bridge.target, target_ids)
        self._read(max(self.floor, len(self.tokens) - TAIL))

    def _read(self, start: int) -> None:
        at = self.ends[start - 1] if start > 0 else 0
        new, ends = encode(self.bridge.draft, self.bridge.draft_bytes, bytes(self.data[at:]))
        self.tokens[start:], self.ends[start:] = new, [at + e for e in ends]


@register_across("draft-model")
class CrossDraftModelDrafter(DraftModelDrafter):
    """`draft-model` with a draft of another tokenizer (see the module doc): the draft's cache
    holds its own tokens for the committed text; proposals and q are the target's."""

    def __init__(
        self,
        model: Transformer,
        bridge: Bridge,
        vocab: int | DraftVocab = DEFAULT_VOCAB,
        window: int = DEFAULT_WINDOW,
        confidence: int = 1,
        tree: int = 0,
    ) -> None:
        if tree:
            raise ValueError(
                "--draft-tree grows trees in the target's tokens: a draft of another tokenizer drafts chains"
            )
        if isinstance(vocab, int):  # (the tokens both vocabularies spell the same, see `shared_vocab`)
            vocab = shared_vocab(model, vocab, bridge.shared_draft, ("shared", bridge)) or 0
        super().__init__(model, vocab, window, confidence, tree)
        self.bridge = bridge
        self.text: DraftText | None = None  # set by `begin`
        self._target_proposal: list[int] = []
        self._asked = 0  # this step's k: the most target tokens a proposal may hold
        self._mask = bridge.mask.to(model.device)

    def _read(self, session: DraftSession) -> list[int]:
        self.text = DraftText(self.bridge, session.context, draft_prompt(self.bridge, session.context[:-1]))
        self._target_proposal = []
        return list(self.text.tokens)

    def _capacity(self, session: DraftSession) -> int:
        # (the text of a target token is one draft token or a few: a draft that runs out of room
        # stops proposing, `_full`)
        return min(self.model.args.max_seq_len, self._prompt + SPREAD * (session.capacity - len(session.context)))

    def _full(self, k: int = 1) -> bool:
        """Whether k more drafts would not fit the draft's cache."""
        return self.cache is None or len(self._tokens) + k + TAIL > self.cache.capacity

    def offer(self, k: int, est: Estimates) -> Offer | None:
        return None if self._full() or (self.text is not None and self.text.pending) else super().offer(k, est)

    def sync(self) -> None:
        if not self._full():
            super().sync()

    def batch_key(self) -> Hashable:
        return (*super().batch_key(), id(self.bridge))

    @classmethod
    def propose_batch(cls, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Draft]:
        # (a character the target has begun: nothing to propose until it is whole)
        ks = [
            0 if d.text is None or d.text.pending or d._full(k) else k  # type: ignore[attr-defined]
            for d, k in zip(drafters, ks, strict=True)
        ]
        for d, k in zip(drafters, ks, strict=True):
            d._asked = k  # type: ignore[attr-defined]
        return super().propose_batch(drafters, ks)

    def _restrict(self, q: torch.Tensor) -> torch.Tensor | None:
        """q' = q over the shared tokens, renormalised (TLI); None where they have no mass."""
        q = q * self._mask  # [1, V_d]
        total = float(q.sum())
        return q / total if total > 0 else None

    def _draft(self, tokens: torch.Tensor, q: torch.Tensor | None) -> Draft:
        dev = tokens.device
        if q is not None:  # sampled: each drawn token is a shared one, one target token
            ids = self.bridge.to_target.to(dev)[tokens]
            q_t = q.new_zeros(len(tokens), self.bridge.target_vocab)  # [K, V_t]
            q_t[:, self.bridge.shared_target.to(dev)] = q[:, self.bridge.shared_draft.to(dev)]
            self._target_proposal = ids.tolist()
            return Draft(ids, q_t)
        # greedy: the drafted text in the target's tokens
        b = self.bridge
        ids = encode(b.target, b.target_bytes, b.spell(b.draft, tokens.tolist()))[0][: self._asked]
        self._target_proposal = ids
        return Draft(torch.tensor(ids, dtype=torch.long, device=dev))

    def _accepted_drafts(self, n: int) -> int:
        """Of the last proposal's draft tokens, those the target's n accepted tokens cover."""
        if self.session is not None and not self.session.sampling.greedy:
            return n
        kept = len(self.bridge.spell(self.bridge.target, self._target_proposal[:n]))
        covered, count = 0, 0
        for t in self._proposal:
            covered += len(self.bridge.draft.token_bytes(t))
            if covered > kept:
                break
            count += 1
        return count

    def accepted(self, feedback: Feedback) -> None:
        n = feedback.num_accepted
        if self.confidence:
            self.calibration.update(self._confidences, self._accepted_drafts(n))
        held = self._tokens[: self._fed()] + self._proposal[: max(len(self._proposal) - 1, 0)]
        self._follow(self._target_proposal[:n] + [feedback.next_token], held)
        self._proposal, self._confidences, self._target_proposal = [], [], []

    def catch_up(self, tokens: list[int], feedback: Feedback | None = None) -> None:
        if self._proposal:
            raise RuntimeError("catch_up() while a proposal awaits its feedback")
        self._follow(tokens, self._tokens[: self._fed()])

    def _follow(self, committed: list[int], held: list[int]) -> None:
        """The target committed `committed`; the cache, holding `held`, keeps what still stands."""
        assert self.text is not None and self.cache is not None
        self.text.extend(committed)
        if self.seq_vocab is not None:
            self.seq_vocab.add(self.text.tokens[max(0, len(self._tokens) - TAIL) :])
        self._tokens = list(self.text.tokens)
        # (the last token stays unfed: the next proposal's first forward reads its logits)
        keep = min(along(held, self._tokens), len(self._tokens) - 1) - self.skip
        self.cache.truncate(max(0, min(self.cache.length, keep)))
