"""Predicted outputs: draft from the text the client expects back.

OpenAI's chat API takes `prediction: {"type": "content", "content": ...}`: the output the
client expects, most often a file it asked the model to change a little. That text is a draft
of nearly the whole answer; this drafter follows it with a pointer and proposes the next
tokens of it as a chain (a point mass, like prompt lookup: verified by the same exact rules).

Alignment. The prediction is tokenized on its own, and the output departs from it where the
model changes something (an inserted line, a renamed word, a removed block). While the
committed tokens keep matching the prediction at the pointer the drafter is *in step*; at a
mismatch it looks for where the output rejoins the prediction: the longest run of the last
committed tokens (up to `max_ngram`) that occurs in the prediction, preferring the first
occurrence at or after the place it last followed the prediction for a while (edits are
local: after an insertion or a change the output goes on from there or a little further),
else the nearest before it. From there it proposes again. The situation it reports to the
chooser (`offer`) is how many of the last committed tokens it has matched, capped: a pointer
that has followed the output for many tokens is right far more often than one that found a
one-token match, and the chooser prices the chain's depth by that.

Exactness: what is proposed depends only on the committed tokens and the prediction, never on
the target's distribution; verification is the engine's (greedy matching, or
`verify.point_mass_sample`), so greedy output equals plain decoding and sampled output follows
the target's distribution, whatever the prediction says.

`info["prediction"]` counts the prediction's tokens the target accepted and those it rejected
(proposed and not kept): the server's `usage.completion_tokens_details`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch

from ..offers import Estimates, Offer
from .base import Draft, DraftSession, Feedback, Option, Switchable, register

# the matched run at which the pointer counts as following the output (its place is then the
# one a realignment looks forward from), and the cap of the situation the chooser sees
SETTLED = 4
# the registered drafters that draft from a request's prediction (auto, through its member)
PREDICTION_READERS = ("prediction", "auto")


@register(
    "prediction",
    default_k=16,
    help="draft from the client's predicted output (OpenAI's `prediction`; --prediction-file), realigned after edits",
    options=(
        Option("max_ngram", "prediction: longest run of output tokens matched when realigning", "--prediction-ngram"),
    ),
)
class PredictionDrafter(Switchable):
    """Proposes the prediction's tokens after its pointer (see the module doc). Without a
    prediction in the session (`DraftSession.prediction`) it proposes nothing."""

    def __init__(self, max_ngram: int = 8) -> None:
        super().__init__()
        if max_ngram < 1:
            raise ValueError(f"the prediction drafter's max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.prediction: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}  # n-gram of the prediction -> positions after it
        self._out: list[int] = []  # the output's committed tokens
        self._ptr: int | None = None  # the prediction's next token for the output (None: not aligned)
        self._run = 0  # last committed tokens matched by the prediction before the pointer
        self._home = 0  # the pointer when it last followed the output SETTLED tokens
        self._proposal: list[int] = []
        self._device = torch.device("cpu")
        self.accepted_tokens = self.rejected_tokens = 0

    def begin(self, session: DraftSession) -> None:
        self._device = session.generator.device
        self.prediction = list(session.prediction or ())
        index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        p = self.prediction
        for end in range(1, len(p) + 1):
            for n in range(1, min(self.max_ngram, end) + 1):
                index[tuple(p[end - n : end])].append(end)  # (ascending: `_realign` bisects)
        self._index = dict(index)
        self._out, self._ptr, self._run, self._home, self._proposal = [], 0, 0, 0, []
        self.accepted_tokens = self.rejected_tokens = 0
        self._follow(session.context[-1:])  # the output's first token (the prompt is not the prediction's)

    def _follow(self, tokens: list[int]) -> None:
        """Commit output tokens: advance the pointer while they match, realign at a mismatch."""
        p = self.prediction
        for t in tokens:
            self._out.append(t)
            if self._ptr is not None and self._ptr < len(p) and p[self._ptr] == t:
                self._ptr += 1
                self._run += 1
            else:
                self._realign()
            if self._run >= SETTLED and self._ptr is not None:
                self._home = self._ptr

    def _realign(self) -> None:
        """Where the output rejoins the prediction: the longest matched run of its last tokens,
        first at or after `_home`, else the nearest before it."""
        out = self._out
        for n in range(min(self.max_ngram, len(out)), 0, -1):
            ends = self._index.get(tuple(out[len(out) - n :]))
            if not ends:
                continue
            i = bisect_left(ends, self._home)
            self._ptr = ends[i] if i < len(ends) else ends[-1]
            self._run = n
            return
        self._ptr, self._run = None, 0

    def _next(self, k: int) -> list[int]:
        if self._ptr is None or k <= 0:
            return []
        return self.prediction[self._ptr : self._ptr + k]

    def offer(self, k: int, est: Estimates) -> Offer | None:
        """A chain; its situation is the matched run, capped at SETTLED, whose prior is by that
        run: a pointer that followed the output for SETTLED tokens is the client's own text
        going on; one found by a one-token match is a guess. Reading a list is free."""
        tokens, run = self._next(k), min(self._run, SETTLED)
        offer = est.chain(self.name, run, len(tokens), 0.0, prior={0: 0.1, 1: 0.3, 2: 0.5, 3: 0.7}.get(run, 0.9))
        return replace(offer, chain=tuple(tokens[: offer.k])) if offer is not None else None

    def propose(self, k: int) -> Draft:
        self._proposal = self._next(k)
        return Draft(torch.tensor(self._proposal, dtype=torch.long, device=self._device))

    def accepted(self, feedback: Feedback) -> None:
        n = feedback.num_accepted
        proposal = self._count(n, n)
        self._follow([*proposal[:n], feedback.next_token])

    def _count(self, n: int, kept: int) -> list[int]:
        """Count the last proposal's `n` accepted tokens (of which the output took `kept`) and
        the rest as rejected; return the proposal, now spent."""
        proposal, self._proposal = self._proposal, []
        self.accepted_tokens += min(n, kept)
        self.rejected_tokens += len(proposal) - n
        return proposal

    def catch_up(self, tokens: list[int], feedback: Feedback | None = None) -> None:
        self._follow(tokens)

    def end(self, final: Feedback | None = None) -> None:
        if final is not None and final.kept is not None:
            self._count(final.num_accepted, final.kept)
        self.info = {"prediction": self.counts()}

    def counts(self) -> dict[str, Any]:
        """The prediction's tokens the target accepted and rejected so far."""
        return {"accepted_tokens": self.accepted_tokens, "rejected_tokens": self.rejected_tokens}
