"""Prompt lookup: draft by copying what followed an earlier occurrence of the last n tokens.

Input-grounded tasks (summarise, answer from a passage, edit given code) repeat long spans of
the prompt; when the last n generated tokens occurred before, the tokens that followed are a
good guess for what comes next (Saxena 2023, "prompt lookup decoding"; transformers'
`prompt_lookup_num_tokens`). No model, no probabilities: q is a point mass, and the engine
verifies with `verify.point_mass_sample` (exact) or greedy matching.

The index maps every n-gram (min_ngram <= n <= max_ngram) of the committed sequence to the
positions right after its occurrences, and grows as tokens are committed, so a lookup costs
O(max_ngram) whatever the prompt length (no rescans).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import torch

from ..offers import Estimates, Offer
from .base import Draft, DraftSession, Feedback, Option, Switchable, register


@register(
    "prompt-lookup",
    help="copy what followed an earlier occurrence of the last n tokens (no second model)",
    options=(
        Option("max_ngram", "prompt-lookup: longest n-gram to match", "--ngram-max"),
        Option("min_ngram", "prompt-lookup: shortest n-gram to match", "--ngram-min"),
    ),
)
class PromptLookupDrafter(Switchable):
    """Proposes the continuation of the most recent earlier occurrence of the longest
    matching suffix (n from `max_ngram` down to `min_ngram`); no proposal when nothing matches."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, single_token_match_limit: int = 2) -> None:
        """`single_token_match_limit`: at most this many tokens are proposed when only the last
        token matched (n = 1), which is weak evidence: such copies are accepted far less often
        than after a longer match (measured: docs/results.md)."""
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram (got min {min_ngram}, max {max_ngram})")
        if single_token_match_limit < 1:
            raise ValueError(f"single_token_match_limit must be >= 1, got {single_token_match_limit}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.single_token_match_limit = single_token_match_limit
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> positions after it
        self._proposal: list[int] = []
        self._device = torch.device("cpu")

    def begin(self, session: DraftSession) -> None:
        self._device = session.generator.device
        self._tokens, self._proposal = [], []
        self._index = defaultdict(list)
        self._extend(session.context)

    def _extend(self, new: list[int]) -> None:
        """Commit tokens and index the n-grams that end at each of them."""
        toks = self._tokens
        for t in new:
            toks.append(t)
            end = len(toks)  # the position right after this n-gram
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._index[tuple(toks[end - n : end])].append(end)

    def candidates(self, k: int, limit: int = 4) -> list[tuple[int, list[int]]]:
        """Up to `limit` distinct continuations (at most k tokens each) with the length n of
        the match they follow, best first: longer matches first, then more recent occurrences.
        The first is what `propose` drafts; the others are alternatives for token trees."""
        toks, out, seen = self._tokens, [], []
        if k <= 0:
            return out
        for n in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
            positions = self._index.get(tuple(toks[len(toks) - n :]), [])
            # the newest entry is the suffix itself (nothing follows it yet): skip it
            for pos in reversed(positions):
                if pos >= len(toks):
                    continue
                cont = toks[pos : pos + k]
                if cont not in seen:
                    seen.append(cont)
                    out.append((n, cont))
                    if len(out) == limit:
                        return out
        return out

    def _best(self, k: int) -> tuple[int, list[int]] | None:
        """(n, the tokens `propose(k)` drafts) of the best match; None when nothing matches."""
        found = self.candidates(k, limit=1)
        if not found:
            return None
        n, tokens = found[0]
        return n, tokens[: self.single_token_match_limit] if n == 1 else tokens

    def offer(self, k: int, est: Estimates) -> Offer | None:
        """A chain; its situation is the length n of the match (acceptance depends on it), whose
        prior is by that length: a one-token match continues as the target does ~20% of the
        time, a three-token one ~90% (measured on the bundled suite, docs/usage.md); two tokens
        between. Without it a request's first one-token matches were drafted as if they were
        right 60% of the time, steps a draft model would have used. Copying is free."""
        best = self._best(k)
        if best is None:
            return None
        n, tokens = best
        offer = est.chain(self.name, n, len(tokens), 0.0, prior={1: 0.2, 2: 0.5}.get(n, 0.8))
        return replace(offer, chain=tuple(tokens[: offer.k])) if offer is not None else None

    def propose(self, k: int) -> Draft:
        best = self._best(k)
        tokens = best[1] if best is not None else []
        self._proposal = tokens
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self._device))

    def accepted(self, feedback: Feedback) -> None:
        self._extend([*self._proposal[: feedback.num_accepted], feedback.next_token])
        self._proposal = []

    def catch_up(self, tokens: list[int], feedback: Feedback | None = None) -> None:
        self._extend(tokens)
