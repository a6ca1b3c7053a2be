"""When a sequence stops, and the text it streams.

`StopChecker` takes generated tokens one at a time and says when generation is over (an end
token, a stop string, the token budget); the caller commits only the tokens `push` accepted.
Text is decoded incrementally — a short window of recent tokens per new token, as Hugging
Face's TextStreamer and vLLM do — so a stop check costs the same at token 10 and token 10,000,
and text can be streamed as it is committed: `take_text` hands out what is final, holding
back a tail that may still become a stop string, so no streamed text is ever a stop string
or follows one.
"""

from __future__ import annotations

from .config import GenerationConfig
from .tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what a decoder shows for a character whose bytes are not all there yet


class Detokenizer:
    """Token ids -> text, incrementally: each new token decodes only the tokens since the last
    complete piece of text (`prefix`: tokens already shown, kept as context so tokenizers that
    treat a leading space specially decode the new token as they would in the full text)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoding window
        self.read = 0  # tokens whose text has been returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if ids else ""

    def push(self, token: int) -> str:
        """New text completed by this token ("" while a character is incomplete)."""
        self.ids.append(token)
        shown = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(shown) or text.endswith(_INCOMPLETE):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown) :]

    def flush(self) -> str:
        """Whatever is left (at the end: an incomplete character shows as the replacement char)."""
        shown = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(shown) :]


class StopChecker:
    """Feeds on generated tokens one at a time; says when to stop and never lets a token past
    the stop through."""

    def __init__(
        self, cfg: GenerationConfig, max_new_tokens: int, tokenizer: Tokenizer | None, eos_ids: frozenset[int]
    ) -> None:
        if cfg.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.stop = cfg.stop
        self.longest = max((len(s) for s in cfg.stop), default=0)
        self.eos = frozenset() if cfg.ignore_eos else eos_ids
        self.limit = max_new_tokens
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._text = ""  # committed text (cut at a stop string)
        self._taken = 0  # characters handed out by take_text

    def push(self, token: int) -> bool:
        """Append one token; True when generation is over (this token is the last)."""
        if self.finish_reason is not None:
            raise RuntimeError("push after the sequence finished")
        self.tokens.append(token)
        hit = self.detok is not None and self._append(self.detok.push(token))
        if token in self.eos:
            self.finish_reason = "eos"
        elif hit:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.limit:
            self.finish_reason = "length"
        if self.finish_reason in ("eos", "length") and self.detok is not None and self._append(self.detok.flush()):
            self.finish_reason = "stop"
        return self.finish_reason is not None

    def _append(self, new: str) -> bool:
        """Add decoded text; True when it completes a stop string (the text is cut before it).
        Only a stop string that ends inside the new text can be new."""
        if not new:
            return False
        search_from = max(0, len(self._text) - self.longest + 1)
        self._text += new
        hits = [i for s in self.stop if (i := self._text.find(s, search_from)) >= 0]
        if hits:
            self._text = self._text[: min(hits)]
        return bool(hits)

    def take_text(self) -> str:
        """Text committed since the last call. While generation goes on, a tail that is the
        start of a stop string is held back (it may turn out to be one)."""
        end = len(self._text)
        if self.finish_reason is None and self.stop:
            end -= self._held()
        delta = self._text[self._taken : end]
        self._taken = max(self._taken, end)
        return delta

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._text
        for n in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def text(self) -> str:
        return self._text
