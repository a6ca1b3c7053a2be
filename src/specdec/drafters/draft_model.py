"""A smaller model of the same tokenizer drafts k tokens autoregressively (Leviathan et al.)."""

from __future__ import annotations

import torch

from ..model.cache import KVCache
from ..model.transformer import Transformer
from ..sampling import probs, sample
from .base import Draft, DraftSession, register


@register("draft-model")
class DraftModelDrafter:
    """Keeps its own KV cache. The cache holds a prefix of the committed tokens; `propose`
    feeds whatever committed tokens it lacks (1, or 2 after a fully accepted step) and then
    each new draft but the last."""

    name: str

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.forwards = 0
        self.session: DraftSession | None = None  # set by `begin`
        self.cache: KVCache | None = None
        self._tokens: list[int] = []  # committed sequence
        self._proposal: list[int] = []

    def begin(self, session: DraftSession) -> None:
        if session.context.shape[0] != 1:
            raise NotImplementedError("the draft-model drafter runs one sequence at a time")
        if session.capacity > self.model.args.max_seq_len:
            raise ValueError(
                f"the draft model's context ({self.model.args.max_seq_len}) is shorter than the "
                f"generation needs ({session.capacity}); lower max_new_tokens or pick another draft"
            )
        self.session = session
        self.cache = self.model.new_cache(session.capacity)
        self._tokens = session.context[0].tolist()
        self._proposal = []
        self._feed(self._tokens[:-1])

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Run the draft over `tokens`; logits after the last one, [1, V]."""
        assert self.cache is not None, "begin() first"
        x = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        self.forwards += 1
        return self.model(x, self.cache, last_only=True).logits[:, -1]

    def propose(self, k: int) -> Draft:
        if self.session is None or self.cache is None:
            raise RuntimeError("DraftModelDrafter.propose() called before begin()")
        sampling = self.session.sampling
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        pending = self._tokens[self.cache.length :]
        for _ in range(k):
            logits = self._feed(pending)
            if sampling.greedy:
                tok = int(logits.argmax(-1))
            else:
                q = probs(logits, sampling)  # [1, V]
                tok = int(sample(q, self.session.generator))
                qs.append(q)
            tokens.append(tok)
            pending = [tok]
        self._proposal = tokens
        dev = self.model.device
        out = torch.tensor([tokens], dtype=torch.long, device=dev).reshape(1, k)
        q_all: torch.Tensor | None = None  # greedy: the drafts are argmaxes, q is not needed
        if not sampling.greedy:
            q_all = torch.stack(qs, dim=1) if qs else torch.zeros(1, 0, self.model.args.vocab_size, device=dev)
        return Draft(out, q_all)

    def accepted(self, num_accepted: int, next_token: int) -> None:
        kept = self._proposal[:num_accepted]
        # The cache holds the old committed tokens plus the drafts that were fed (all but the
        # last); keep exactly the part that is still on the committed path.
        valid = len(self._tokens) + min(num_accepted, max(len(self._proposal) - 1, 0))
        self._tokens += kept + [next_token]
        self.cache.truncate(min(self.cache.length, valid))
        self._proposal = []
