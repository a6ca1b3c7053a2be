"""A smaller model of the same tokenizer drafts k tokens autoregressively (Leviathan et al.)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..model.cache import KVCache
from ..model.transformer import ForwardOutput, Segment, Transformer
from ..sampling import probs, sample
from .base import Draft, Drafter, DraftSession, Feedback, register
from .vocab import DEFAULT_VOCAB, VOCAB_OPTION, DraftVocab, SequenceVocab, draft_vocab
from .window import DEFAULT_WINDOW, SINK, WINDOW_OPTION

# The draft model keeps the last prompt it prefilled (`state.prefilled`: with its window, that
# cache and the tokens the window left out), so a batch of sequences with one prompt, as
# `specdec certify` or a server's n > 1 sends, prefills the draft model once.


def draft_step(model: Transformer, vocab: DraftVocab | None,
               segs: list[Segment]) -> tuple[list[ForwardOutput], torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """One draft forward over each segment's pending rows: with a cut vocabulary, the final-normed
    hidden [B, D] of every segment's last row and its scores [B, N] from one call of the cut
    head; else the outputs' own full logits (and None, None)."""
    outs = model.forward_batch(segs, head=vocab is None)
    if vocab is None:
        return outs, None, None
    h = model.model.norm(torch.cat([out.residual[0, -1:] for out in outs]))  # [B, D]
    return outs, h, vocab.logits(h)


def greedy_token(model: Transformer, vocab: DraftVocab | None, tokens: torch.Tensor, cache: KVCache) -> int:
    """One greedy drafted token after `tokens` [T] (the list's argmax where the vocabulary is
    cut): the step that timings of the draft time."""
    outs, _, sub = draft_step(model, vocab, [Segment(tokens, cache, last_only=True)])
    return int(outs[0].logits[0, -1].argmax()) if sub is None else int(vocab.ids[sub[0].argmax()])  # type: ignore[union-attr]


def step_cost_ms(model: Transformer, vocab: DraftVocab | None, context: int = 128) -> float:
    """`greedy_token` over one new row after `context` tokens, as the cost model prices a
    drafted token (`costs.draft_step_ms`: timed once per machine, packing and vocabulary)."""
    from .. import costs  # (looked up at call time: tests replace its timing)

    gen = torch.Generator().manual_seed(0)
    row = torch.randint(0, min(model.args.vocab_size, 30000), (1,), generator=gen).to(model.device)
    cache: list[KVCache] = []  # made on the first reset: only where the step is timed, not where it is stored

    def reset() -> None:
        if not cache:
            cache.append(model.new_cache(context + 1))
            prompt = torch.randint(0, min(model.args.vocab_size, 30000), (1, context), generator=gen).to(model.device)
            model(prompt, cache[0], last_only=True, head=False)
        cache[0].truncate(context)

    return costs.draft_step_ms(model, f"vocab={vocab.size if vocab is not None else 0}",
                               lambda: greedy_token(model, vocab, row, cache[0]), reset)  # fmt: skip


@register("draft-model", needs="draft", switchable=True, help="a smaller model of the same tokenizer drafts k tokens (--draft MODEL)",
          options=(VOCAB_OPTION, WINDOW_OPTION))  # fmt: skip
class DraftModelDrafter(Drafter):
    """Keeps its own KV cache of the committed tokens. A proposal feeds whatever committed
    tokens the cache lacks (1, or 2 after a fully accepted step) and then each new draft but
    the last. Drafters of one draft model propose together: each of the k draft steps is one
    forward of the draft model over every sequence's pending rows.

    `vocab`: the draft scores only its N most frequent tokens (`vocab.DraftVocab`, where a
    frequency list for its tokenizer is known) and the tokens this sequence has shown that the
    list lacks (`vocab.SequenceVocab`): greedy proposals are the argmax over them, and sampled
    ones come with q = the softmax over them (zero elsewhere), which is what the verifier is
    given.

    `window`: a context longer than SINK + window tokens when the draft first reads it is read
    through its first SINK and last `window` tokens (0: all of it); the draft's cache then
    lacks the `skip` tokens between, and every row it feeds carries its own position."""

    adaptive_k = True  # the engine may choose each step's k (GenerationConfig.adaptive_k)

    def __init__(self, model: Transformer, vocab: int | DraftVocab = DEFAULT_VOCAB, window: int = DEFAULT_WINDOW) -> None:
        super().__init__()
        if not isinstance(window, int) or window < 0:
            raise ValueError(f"the draft window must be a whole number of tokens >= 0 (0 = the whole context), got {window}")
        self.model, self.window = model, window
        self.skip = 0  # committed tokens (after the first SINK) that the draft's cache leaves out
        if isinstance(vocab, DraftVocab) and vocab.model is not model:
            raise ValueError("that draft vocabulary was cut from another model's head")
        self.vocab: DraftVocab | None = vocab if isinstance(vocab, DraftVocab) else draft_vocab(model, vocab)
        self.seq_vocab: SequenceVocab | None = None  # set by `begin`
        self.session: DraftSession | None = None  # set by `begin`
        self.cache: KVCache | None = None
        self._tokens: list[int] = []  # committed sequence
        self._proposal: list[int] = []

    def begin(self, session: DraftSession) -> None:
        if session.capacity > self.model.args.max_seq_len:
            raise ValueError(
                f"the draft model's context ({self.model.args.max_seq_len}) is shorter than the "
                f"generation needs ({session.capacity}); lower max_new_tokens or pick another draft"
            )
        self.session = session
        self.cache = self.model.new_cache(session.capacity)
        self.skip = 0
        self._tokens = list(session.context)
        if self.vocab is not None:
            self.seq_vocab = SequenceVocab(self.vocab)
            self.seq_vocab.add(self._tokens)
        self._proposal = []
        if not self.lazy_begin:  # (lazily: a request that never drafts never pays the prefill)
            self.sync()

    def end(self) -> None:
        self.cache = None  # free the draft's KV cache

    def batch_key(self) -> Hashable:
        return ("draft-model", id(self.model), id(self.vocab))

    def _fed(self) -> int:
        """Committed tokens the draft's cache stands for (those it holds and those it skipped)."""
        return (self.cache.length if self.cache is not None else 0) + self.skip

    def _segment(self, tokens: list[int]) -> Segment:
        """The next committed or drafted `tokens` as a segment of the draft's cache, at their own
        positions (past the window's gap)."""
        t = torch.tensor(tokens, device=self.model.device)
        if not self.skip:
            return Segment(t, self.cache, last_only=True)  # type: ignore[arg-type]
        at = self._fed()
        return Segment(t, self.cache, positions=torch.arange(at, at + len(tokens), device=self.model.device),  # type: ignore[arg-type]
                       last_only=True)  # fmt: skip

    def propose(self, k: int) -> Draft:
        return self.propose_batch([self], [k])[0]

    @classmethod
    def propose_batch(cls, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Draft]:
        group: list[DraftModelDrafter] = cls._one_batch(drafters)  # one draft model
        model = group[0].model
        for d in group:
            if d.session is None or d.cache is None:
                raise RuntimeError("DraftModelDrafter.propose() called before begin()")
            d._proposal = []
        qs: list[list[torch.Tensor]] = [[] for _ in group]
        pending = [d._tokens[d._fed() :] for d in group]
        for step in range(max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if step < k]
            segs = [group[i]._segment(pending[i]) for i in live]
            outs, h, sub = draft_step(model, group[0].vocab, segs)
            for n, (i, out) in enumerate(zip(live, outs, strict=True)):
                d = group[i]
                d.forwards += 1
                sampling = d.session.sampling  # type: ignore[union-attr]
                cut = d.seq_vocab
                own = cut.logits(sub[n], h[n]) if cut is not None else None  # type: ignore[index]  # [N + extra]
                if sampling.greedy:
                    tok = int(out.logits[0, -1].argmax()) if cut is None else int(cut.ids[own.argmax()])  # type: ignore[union-attr]
                else:
                    logits = out.logits[:, -1] if cut is None else cut.expand(own[None])  # type: ignore[index]  # [1, V]
                    q = probs(logits, sampling)  # [1, V]
                    tok = int(sample(q, d.session.generator))  # type: ignore[union-attr]
                    qs[i].append(q[0])
                d._proposal.append(tok)
                pending[i] = [tok]
        drafts = []
        for i, d in enumerate(group):
            toks = torch.tensor(d._proposal, dtype=torch.long, device=model.device)
            q_all = None  # greedy: the drafts are argmaxes, q is not needed
            if not d.session.sampling.greedy:  # type: ignore[union-attr]
                q_all = torch.stack(qs[i]) if qs[i] else torch.zeros(0, model.args.vocab_size, device=model.device)
            drafts.append(Draft(toks, q_all))
        return drafts

    def catch_up(self, tokens: list[int], feedback: Feedback | None = None) -> None:
        if self._proposal:
            raise RuntimeError("catch_up() while a proposal awaits its feedback")
        self._tokens += tokens  # fed at the next proposal (or `sync`)
        if self.seq_vocab is not None:
            self.seq_vocab.add(tokens)

    def _costs(self):
        from ..costs import pass_costs  # (looked up at call time: tests replace it)

        return pass_costs(self.model, 32)

    def cost_ms(self) -> float:
        """One draft step as this drafter runs it (the draft's one-row pass, its LM head over its
        vocabulary), timed on this machine once and kept (`costs.draft_step_ms`)."""
        return step_cost_ms(self.model, self.vocab)

    def prepare(self) -> None:
        self.cost_ms()
        self._costs()

    def _behind(self) -> int:
        """Committed tokens the cache lacks beyond what a proposal's first forward feeds anyway
        (up to 2 in steady decoding: the last accepted draft, never fed, and the target's token)."""
        missing = len(self._tokens) - self._fed()
        return missing - 1 if missing > 2 else 0

    def _window_of(self, n: int) -> int:
        """Tokens of a fresh cache's first n that the window leaves out."""
        return n - SINK - self.window if self.window and n > SINK + self.window else 0

    def switch_ms(self) -> float:
        behind = self._behind()
        if self.cache is not None and self.cache.length == 0:
            behind -= self._window_of(behind)
        return self._costs().rows(behind) if behind > 0 else 0.0

    def sync(self) -> None:
        """Feed the committed tokens the cache lacks, all but the last (the next proposal feeds
        that one, as in steady decoding); nothing in steady decoding, where the proposal's first
        forward feeds at most two."""
        if self.cache is None:
            raise RuntimeError("DraftModelDrafter.sync() called before begin()")
        if self._behind() > 0:
            pending = self._tokens[self._fed() : -1]
            fresh = self.cache.length == 0
            shared = self.model.state.prefilled if fresh else None
            if shared is not None and shared[:2] == (tuple(pending), self.window) and self.cache.capacity >= shared[2].length:
                # the same prompt was just prefilled for another sequence: copy its cache
                # (each row depends on its own prefix only, so this is what the pass computes)
                self.cache.copy_prefix(shared[2], shared[2].length)
                self.skip = shared[3]
                return
            self.forwards += 1
            skip = self._window_of(len(pending)) if fresh else 0
            if skip:  # the first SINK tokens and the last `window`, at their own positions
                rows = pending[:SINK] + pending[SINK + skip :]
                positions = torch.cat([torch.arange(SINK), torch.arange(SINK + skip, len(pending))]).to(self.model.device)
                self.model.forward_batch([Segment(torch.tensor(rows, device=self.model.device), self.cache, positions,
                                                  last_only=True)], head=False)  # fmt: skip
                self.skip = skip
            else:
                self.model.forward_batch([self._segment(pending)], head=False)
            if fresh:
                snapshot = self.model.new_cache(self.cache.length)
                snapshot.copy_prefix(self.cache, self.cache.length)
                self.model.state.prefilled = (tuple(pending), self.window, snapshot, self.skip)

    def accepted(self, feedback: Feedback) -> None:
        assert self.cache is not None
        n = feedback.num_accepted
        # The cache holds the old committed tokens plus the drafts that were fed (all but the
        # last); keep exactly the part that is still on the committed path.
        valid = len(self._tokens) + min(n, max(len(self._proposal) - 1, 0)) - self.skip
        self._tokens += self._proposal[:n] + [feedback.next_token]
        if self.seq_vocab is not None:
            self.seq_vocab.add([feedback.next_token])
        self.cache.truncate(min(self.cache.length, valid))
        self._proposal = []
