"""A thin wrapper over a Hugging Face tokenizer: text <-> ids, chat templates, end tokens."""

from __future__ import annotations

import functools
import json
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

# End-of-generation tokens of the chat formats we know; added to the eos set when present.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>", "</s>", "<|eot_id|>", "<|end|>")

_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")

Messages = list[dict[str, str]]
RENDERED = 64  # conversations a tokenizer remembers rendering (`Tokenizer.conversation`)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's map from the printable characters it writes back to bytes (GPT-2's)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    def __init__(self, hf: Any, eos_ids: frozenset[int]) -> None:
        self.hf = hf
        self.eos_ids = eos_ids
        # draft tokenizers already found equal to this one (comparing two vocabularies of
        # 152k tokens is worth doing once, not per request)
        self.same: weakref.WeakSet[Tokenizer] = weakref.WeakSet()
        self.differ: weakref.WeakSet[Tokenizer] = weakref.WeakSet()  # ...and found different
        self._bytes: dict[int, bytes] = {}  # token id -> its bytes (`token_bytes`)
        self.bridges: dict[Any, Any] = {}  # draft tokenizers of other vocabularies -> their `drafters.cross.Bridge`
        # the conversations its chat template rendered lately, by (length, hash) of their ids: a
        # draft of another tokenizer renders the same conversation with its own template
        # (`conversation`). A hash, not the ids: 64 long agent prompts held as tuples of ints
        # would keep tens of MB alive; a collision (2^-64) would only mislead a draft, never the output
        self.rendered: OrderedDict[tuple[int, int], tuple[Messages, list[dict[str, Any]] | None]] = OrderedDict()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        from transformers.utils import logging as hf_logging

        path = Path(path)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        tok_cfg = path / "tokenizer_config.json"
        cls_name = json.loads(tok_cfg.read_text()).get("tokenizer_class") if tok_cfg.exists() else None
        try:
            if cls_name in _GENERIC_CLASSES:
                # A plain tokenizer.json: load it as is. AutoTokenizer would pick a class from the
                # model type (e.g. Qwen2Tokenizer) and add that family's special tokens to it.
                hf = PreTrainedTokenizerFast.from_pretrained(str(path))
            else:
                hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, TypeError) as e:
            found = "no tokenizer.json" if not (path / "tokenizer.json").exists() else str(e).strip().splitlines()[0]
            raise ValueError(
                f"the tokenizer in {path} cannot be read ({found}); a model directory needs its "
                "tokenizer's files (tokenizer.json, tokenizer_config.json) from the model's release"
            ) from None
        finally:
            hf_logging.set_verbosity(verbosity)
        eos: set[int] = set()
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        config = path / "config.json"
        if config.exists():
            cfg_eos = json.loads(config.read_text()).get("eos_token_id")
            eos.update(int(i) for i in (cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]) if i is not None)
        vocab = hf.get_vocab()
        special = set(hf.all_special_tokens) | {t.content for t in hf.added_tokens_decoder.values() if t.special}
        eos.update(vocab[t] for t in _END_TOKENS if t in vocab and t in special)
        return cls(hf, frozenset(eos))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text)["input_ids"])

    def encode_text(self, text: str) -> list[int]:
        """Text as it stands, without the special tokens a prompt gets (a BOS): a piece of output."""
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    @functools.cached_property
    def _sentencepiece(self) -> bool:
        """A SentencePiece vocabulary ("\u2581" starts a word) is not byte-level, whatever its
        characters (looked at once, where a token's bytes are first asked for)."""
        return any("\u2581" in t for t in list(self.hf.get_vocab())[:2000])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character, for some): byte-level
        BPE's characters mapped back to bytes, a byte-fallback token's byte, a SentencePiece
        word start as a space."""
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self.hf.convert_ids_to_tokens(int(token_id)) or ""
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            out = bytes([int(piece[3:5], 16)])
        elif all(c in _byte_decoder() for c in piece) and not self._sentencepiece:
            out = bytes(_byte_decoder()[c] for c in piece)
        else:
            out = piece.replace("\u2581", " ").encode()
        self._bytes[token_id] = out
        return out

    def encode_chat(self, messages: Messages, tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this tokenizer has no chat template; pass chat=False to use the prompt as raw text")
        out = self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        ids = [int(i) for i in out]
        key = (len(ids), hash(tuple(ids)))
        self.rendered[key] = (messages, tools)
        self.rendered.move_to_end(key)
        while len(self.rendered) > RENDERED:
            self.rendered.popitem(last=False)
        return ids

    def conversation(self, ids: list[int]) -> tuple[Messages, list[dict[str, Any]] | None, int] | None:
        """The conversation (messages, tools) whose rendering `ids` begin with (the longest: an
        earlier turn of the same chat begins it too), and its length in tokens (what follows is
        the turn as it goes on: a forced start, generated tokens); None where `ids` begin with
        nothing this tokenizer's template rendered lately."""
        lengths = sorted({n for n, _ in self.rendered if n <= len(ids)}, reverse=True)
        for n in lengths:  # (the longest first; each prefix hashed once)
            found = self.rendered.get((n, hash(tuple(ids[:n]))))
            if found is not None:
                return (*found, n)
        return None

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


def tokenizers_equal(target: Tokenizer, draft: Tokenizer) -> bool:
    """Whether the two share one vocabulary (token ids mean the same text); else a draft of
    `draft`'s tokenizer drafts for `target` across tokenizers (`drafters.cross`)."""
    if target is draft or draft in target.same:
        return True
    if draft in target.differ:
        return False
    equal = target.hf.get_vocab() == draft.hf.get_vocab()
    (target.same if equal else target.differ).add(draft)
    return equal
