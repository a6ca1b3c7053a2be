"""A smaller model drafts k tokens autoregressively (Leviathan et al.); one of another tokenizer
drafts across tokenizers (`drafters.cross`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .. import costs
from ..model.cache import KVCache
from ..model.transformer import ForwardOutput, Segment, Transformer
from ..offers import EXPLORE_ALPHA, Estimates, Offer
from ..runtime import per_model
from ..sampling import probs, sample
from .base import Draft, Drafter, DraftSession, Feedback, Switchable, one_batch, register
from .confidence import CONFIDENCE_OPTION, TREE_OPTION, Calibration, Depth, keep_drafting
from .draft_tree import MAX_NODES, TreeGrowth
from .vocab import DEFAULT_VOCAB, VOCAB_OPTION, DraftVocab, SequenceVocab, draft_vocab
from .window import DEFAULT_WINDOW, SINK, WINDOW_OPTION

# The draft model keeps the last prompt it prefilled (`PREFILLED`: with its window, that cache
# and the tokens the window left out), so a batch of sequences with one prompt, as `specdec
# certify` or a server's n > 1 sends, prefills the draft model once. Rows, not learning: a copied
# row is what its prefill computes, like the target's cached prefixes (`engine.PREFIXES`), so it
# is kept per draft model, not in a pool's memory; a benchmark's untimed priming leaves it there.


PREFILLED = per_model(memory=False)


def draft_step(
    model: Transformer, vocab: DraftVocab | None, segs: list[Segment]
) -> tuple[list[ForwardOutput], torch.Tensor | None, torch.Tensor | None]:
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
    gen = torch.Generator().manual_seed(0)
    row = torch.randint(0, min(model.args.vocab_size, 30000), (1,), generator=gen).to(model.device)
    cache: list[KVCache] = []  # made on the first reset: only where the step is timed, not where it is stored

    def reset() -> None:
        if not cache:
            cache.append(model.new_cache(context + 1))
            prompt = torch.randint(0, min(model.args.vocab_size, 30000), (1, context), generator=gen).to(model.device)
            model(prompt, cache[0], last_only=True, head=False)
        cache[0].truncate(context)

    return costs.draft_step_ms(
        model,
        f"vocab={vocab.size if vocab is not None else 0}",
        lambda: greedy_token(model, vocab, row, cache[0]),
        reset,
    )


@register(
    "draft-model",
    needs="draft",
    default_k=8,
    help="a smaller model drafts up to k tokens, as deep as its confidence pays (--draft MODEL; another tokenizer: "
    "greedy by its text, sampled over the tokens both vocabularies share)",
    options=(VOCAB_OPTION, WINDOW_OPTION, CONFIDENCE_OPTION, TREE_OPTION),
)
class DraftModelDrafter(Switchable):
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
    lacks the `skip` tokens between, and every row it feeds carries its own position.

    `confidence` (on by default): k is the deepest a proposal may go; the draft stops earlier
    where one more token is not worth its cost, judged by its own probability of the token it
    just drafted (`drafters.confidence`: calibrated against what the target accepted, the
    rows priced by the target's pass table). The chosen k then bounds the depth, and its offer
    is what its steps did (`Estimates.measured`)."""

    def __init__(
        self,
        model: Transformer,
        vocab: int | DraftVocab = DEFAULT_VOCAB,
        window: int = DEFAULT_WINDOW,
        confidence: int = 1,
        tree: int = 0,
    ) -> None:
        super().__init__()
        self.chain_only = False  # this sequence's `DraftSession.chain_only` (set at begin)
        if not isinstance(window, int) or window < 0:
            raise ValueError(
                f"the draft window must be a whole number of tokens >= 0 (0 = the whole context), got {window}"
            )
        if confidence not in (0, 1, True, False):
            raise ValueError(
                f"--draft-confidence is 1 (stop where the draft's confidence says so) or 0 (always k), got {confidence}"
            )
        if tree not in (0, 1, True, False):
            raise ValueError(f"--draft-tree is 1 (a token tree grown by confidence) or 0 (a chain), got {tree}")
        self.model, self.window = model, window
        self.confidence, self.tree = bool(confidence), bool(tree)
        self._growth: TreeGrowth | None = None  # the last proposal's tree
        self.scratch_rows = MAX_NODES if self.tree else 0  # a tree's nodes beyond k, in the target's pass
        self.calibration = Calibration()  # set by `begin`: this request's, or the memory of earlier greedy ones
        self._confidences: list[float] = []  # the draft's probability of each token of the last proposal
        self.skip = 0  # committed tokens (after the first SINK) that the draft's cache leaves out
        if isinstance(vocab, DraftVocab) and vocab.model is not model:
            raise ValueError("that draft vocabulary was cut from another model's head")
        self.vocab: DraftVocab | None = vocab if isinstance(vocab, DraftVocab) else draft_vocab(model, vocab)
        self.seq_vocab: SequenceVocab | None = None  # set by `begin`
        self.session: DraftSession | None = None  # set by `begin`
        self.cache: KVCache | None = None
        self._tokens: list[int] = []  # committed sequence
        self._prompt = 0  # its first tokens that are the prompt
        self._proposal: list[int] = []

    def begin(self, session: DraftSession) -> None:
        self.session = session
        self.chain_only = session.chain_only
        self.skip = 0
        self._tokens = self._read(session)
        self._prompt = len(self._tokens)
        capacity = self._capacity(session)
        if capacity > self.model.args.max_seq_len:
            raise ValueError(
                f"the draft model's context ({self.model.args.max_seq_len}) is shorter than the "
                f"generation needs ({capacity}); lower max_new_tokens or pick another draft"
            )
        # (a tree's fed nodes sit past the committed rows until the pass decides)
        self.cache = self.model.new_cache(capacity + (MAX_NODES if self._grows_tree() else 0))
        if self.vocab is not None:
            self.seq_vocab = SequenceVocab(self.vocab)
            self.seq_vocab.add(self._tokens)
        self._proposal, self._confidences = [], []
        # (chains and trees apart: a tree also learns from its second choices)
        key = (id(self.model), id(self.vocab), self._grows_tree())
        self.calibration = _calibration(session, key) if self.confidence or self.tree else Calibration()
        # (the prefill waits for `sync`: a request that never drafts never pays it)

    def _read(self, session: DraftSession) -> list[int]:
        """The prompt in the draft's tokens (the target's, which it shares)."""
        return list(session.context)

    def _capacity(self, session: DraftSession) -> int:
        """The draft's tokens the sequence may reach (the target's, which it shares)."""
        return session.capacity

    def end(self, final: Feedback | None = None) -> None:
        self.cache = None  # free the draft's KV cache

    def offer(self, k: int, est: Estimates) -> Offer | None:
        """Stopping where its confidence says (or growing a tree): what its steps did, handed
        the deepest k, from its record kept across greedy requests with its calibration (the
        same scope: this target, this draft, its vocabulary, chain or tree); else a chain by
        the position model. Either way with the cost of catching up first."""
        if self.confidence or self.tree:
            return est.measured(
                self.name, k, self.cost_ms(), self._catch_up_ms(), self.calibration.steps, prior=EXPLORE_ALPHA
            )
        return est.chain(self.name, "", k, self.cost_ms(), self._catch_up_ms(), prior=EXPLORE_ALPHA)

    def scope(self) -> str | None:
        """This draft, its mode and its vocabulary (what its tokens depend on), chain or tree."""
        src = getattr(self.model, "source_dir", None)
        if src is None:
            return None
        vocab = self.vocab.size if self.vocab is not None else 0
        return f"draft={src}|{self.model.mode}|vocab={vocab}|tree={int(self.tree)}"

    def batch_key(self) -> Hashable:
        return ("draft-model", id(self.model), id(self.vocab), self._grows_tree())

    def _grows_tree(self) -> bool:
        return self.tree and not self.chain_only

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
        return Segment(
            t,
            self.cache,
            positions=torch.arange(at, at + len(tokens), device=self.model.device),  # type: ignore[arg-type]
            last_only=True,
        )

    def propose(self, k: int) -> Draft:
        return self.propose_batch([self], [k])[0]

    @classmethod
    def propose_batch(cls, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Draft]:
        group: list[DraftModelDrafter] = one_batch(cls, drafters)  # one draft model
        model = group[0].model
        for d in group:
            if d.session is None or d.cache is None:
                raise RuntimeError("DraftModelDrafter.propose() called before begin()")
            d.sync()  # (nothing where whoever proposes synced it first, timing that apart)
            d._proposal, d._confidences, d._growth = [], [], None
        if group[0]._grows_tree():
            return cls._propose_trees(group, ks)
        qs: list[list[torch.Tensor]] = [[] for _ in group]
        pending = [d._tokens[d._fed() :] for d in group]
        priced = [d._pricing(k) for d, k in zip(group, ks, strict=True)]
        depth = [Depth() for _ in group]
        live = [i for i, k in enumerate(ks) if k > 0]
        while live:
            segs = [group[i]._segment(pending[i]) for i in live]
            outs, h, sub = draft_step(model, group[0].vocab, segs)
            still = []
            for n, (i, out) in enumerate(zip(live, outs, strict=True)):
                d = group[i]
                d.forwards += 1
                sampling = d.session.sampling  # type: ignore[union-attr]
                cut = d.seq_vocab
                own = cut.logits(sub[n], h[n]) if cut is not None else None  # type: ignore[index]  # [N + extra]
                if sampling.greedy:
                    row = out.logits[0, -1] if cut is None else own  # [V] or [N + extra]
                    best = int(row.argmax())  # type: ignore[union-attr]
                    tok = best if cut is None else int(cut.ids[best])
                    # (the draft's probability of its argmax: what the calibration learns from,
                    # also from proposals whose depth it did not decide)
                    conf = float(torch.softmax(row.float(), -1)[best]) if d.confidence else 1.0  # type: ignore[union-attr]
                else:
                    logits = out.logits[:, -1] if cut is None else cut.expand(own[None])  # type: ignore[index]  # [1, V]
                    q = d._restrict(probs(logits, sampling))  # [1, V]
                    if q is None:
                        continue  # (nothing it may propose here: the proposal ends)
                    tok = int(sample(q, d.session.generator))  # type: ignore[union-attr]
                    qs[i].append(q[0])
                    conf = float(q[0, tok])
                d._proposal.append(tok)
                d._confidences.append(conf)
                pending[i] = [tok]
                if len(d._proposal) < ks[i] and (priced[i] is None or d._goes_on(depth[i], conf, *priced[i])):
                    still.append(i)
            live = still
        drafts = []
        for i, d in enumerate(group):
            toks = torch.tensor(d._proposal, dtype=torch.long, device=model.device)
            q_all = None  # greedy: the drafts are argmaxes, q is not needed
            if not d.session.sampling.greedy:  # type: ignore[union-attr]
                q_all = torch.stack(qs[i]) if qs[i] else torch.zeros(0, model.args.vocab_size, device=model.device)
            drafts.append(d._draft(toks, q_all))
        return drafts

    def _restrict(self, q: torch.Tensor) -> torch.Tensor | None:
        """The distribution [1, V] a sampled draft token is drawn from (None: none may be drawn)."""
        return q

    def _draft(self, tokens: torch.Tensor, q: torch.Tensor | None) -> Draft:
        """The proposal of drafted `tokens` [K] (drawn from `q` [K, V]) as the target verifies it."""
        return Draft(tokens, q)

    def catch_up(self, tokens: list[int], feedback: Feedback | None = None) -> None:
        if self._proposal:
            raise RuntimeError("catch_up() while a proposal awaits its feedback")
        self._tokens += tokens  # fed at the next proposal (or `sync`)
        if self.seq_vocab is not None:
            self.seq_vocab.add(tokens)

    @classmethod
    def _propose_trees(cls, group: list[DraftModelDrafter], ks: Sequence[int]) -> list[Draft]:
        """Each sequence's token tree (`draft_tree`): the first pass feeds the committed tokens
        the draft lacks and gives the root's children; each later pass feeds every growing
        tree's chosen leaves at once and gives their children."""
        model, vocab = group[0].model, group[0].vocab
        dev = model.device
        live = [i for i, k in enumerate(ks) if k > 0]
        growth: dict[int, TreeGrowth] = {}
        if live:
            outs, h, sub = draft_step(
                model, vocab, [group[i]._segment(group[i]._tokens[group[i]._fed() :]) for i in live]
            )
            for n, i in enumerate(live):
                d = group[i]
                d.forwards += 1
                growth[i] = d._growth = d._new_tree(ks[i])
                growth[i].add_pass(1)
                growth[i].children(
                    -1, *d._dist(outs[n].logits[0, -1], None if h is None else h[n], None if sub is None else sub[n])
                )
        while True:
            feeds = {i: f for i, g in growth.items() if (f := g.to_feed())}
            if not feeds:
                break
            segs = [growth[i].segment(f, group[i].cache, dev) for i, f in feeds.items()]  # type: ignore[arg-type]
            outs = model.forward_batch(segs, head=vocab is None)
            for (i, feed), out in zip(feeds.items(), outs, strict=True):
                d, g = group[i], growth[i]
                d.forwards += 1
                g.add_pass(len(feed))
                hs = model.model.norm(out.residual[0]) if vocab is not None else None  # [w, D]
                subs = vocab.logits(hs) if vocab is not None else None  # [w, N]
                for r, j in enumerate(feed):
                    g.children(
                        j, *d._dist(out.logits[0, r], None if hs is None else hs[r], None if subs is None else subs[r])
                    )
        drafts = []
        for i, d in enumerate(group):
            g = growth.get(i)
            if g is None:
                drafts.append(Draft.empty(dev))
                continue
            draft = g.draft(model.args.vocab_size, dev)
            d._proposal = draft.tokens.tolist()
            drafts.append(draft)
        return drafts

    def _new_tree(self, k: int) -> TreeGrowth:
        session = self.session
        assert session is not None and session.pricing is not None and self.cache is not None
        step = self.cost_ms()
        own = self._costs().unscaled()
        target = session.pricing.live(MAX_NODES + 1).unscaled() if session.target is not None else own
        return TreeGrowth(
            k,
            self.calibration,
            target,
            lambda rows: step * own.rows(rows) / own.rows(1),
            self._fed() - 1,
            self.cache.length,
            session.sampling.greedy,
            session.generator,
        )

    def _dist(
        self, row: torch.Tensor, h: torch.Tensor | None, sub: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One fed row's distribution as a tree grows from it: (probabilities [M] over the
        draft's scored tokens, their ids [M] (None: the whole vocabulary), q [V] for sampling)."""
        sampling = self.session.sampling  # type: ignore[union-attr]
        cut = self.seq_vocab
        own = cut.logits(sub, h) if cut is not None else None  # type: ignore[arg-type]  # [N + extra]
        if sampling.greedy:
            return torch.softmax((row if own is None else own).float(), -1), None if cut is None else cut.ids, None
        q = probs(row[None] if own is None else cut.expand(own[None]), sampling)[0]  # type: ignore[union-attr]  # [V]
        return q, None, q

    def _pricing(self, k: int) -> tuple[float, Any] | None:
        """What decides how deep a proposal of at most k goes: (this drafter's ms per draft token,
        the target's pass table), both as stored for this machine (never the clock: a seeded
        sampled request must choose the same depths every time); None: always k."""
        target = self.session.target if self.session is not None else None
        if not self.confidence or target is None or self.session.fixed_k or k < 2:  # type: ignore[union-attr]
            return None
        return self.cost_ms(), self.session.pricing.live(k + 1).unscaled()  # type: ignore[union-attr]

    def _goes_on(self, depth: Depth, conf: float, draft_ms: float, table: Any) -> bool:
        """After a draft of probability `conf`: is one more worth it? (`confidence.keep_drafting`,
        the next token's chance predicted by `Calibration.next_after`)"""
        depth.add(self.calibration(conf))
        return keep_drafting(depth, self.calibration.next_after(conf), draft_ms, table)

    def _costs(self):
        return costs.pass_costs(self.model, 32)

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

    def _catch_up_ms(self) -> float:
        """Expected ms that `sync` would take now."""
        behind = self._behind()
        if behind > 0 and self._shared() is not None:
            return 0.0  # (`sync` copies the prefill another sequence just made of this prompt)
        if self.cache is not None and self.cache.length == 0:
            behind -= self._window_of(behind)
        return self._costs().rows(behind) if behind > 0 else 0.0

    def _shared(self) -> tuple | None:
        """The draft model's last prefill (`state.prefilled`), where it is this sequence's: what
        `sync` copies instead of computing."""
        if self.cache is None or self.cache.length != 0:
            return None
        shared = PREFILLED.get(self.model)
        pending = self._tokens[self._fed() : -1]
        if (
            shared is not None
            and shared[:2] == (tuple(pending), self.window)
            and self.cache.capacity >= shared[2].length
        ):
            return shared
        return None

    def sync(self) -> None:
        """Feed the committed tokens the cache lacks, all but the last (the next proposal feeds
        that one, as in steady decoding); nothing in steady decoding, where the proposal's first
        forward feeds at most two."""
        if self.cache is None:
            raise RuntimeError("DraftModelDrafter.sync() called before begin()")
        if self._behind() > 0:
            pending = self._tokens[self._fed() : -1]
            fresh = self.cache.length == 0
            shared = self._shared()
            if shared is not None:
                # the same prompt was just prefilled for another sequence: copy its cache
                # (each row depends on its own prefix only, so this is what the pass computes)
                self.cache.copy_prefix(shared[2], shared[2].length)
                self.skip = shared[3]
                return
            self.forwards += 1
            skip = self._window_of(len(pending)) if fresh else 0
            if skip:  # the first SINK tokens and the last `window`, at their own positions
                rows = pending[:SINK] + pending[SINK + skip :]
                positions = torch.cat([torch.arange(SINK), torch.arange(SINK + skip, len(pending))]).to(
                    self.model.device
                )
                self.model.forward_batch(
                    [Segment(torch.tensor(rows, device=self.model.device), self.cache, positions, last_only=True)],
                    head=False,
                )
                self.skip = skip
            else:
                self.model.forward_batch([self._segment(pending)], head=False)
            if fresh and len(pending) + 1 == self._prompt:
                # (a prompt's prefill only: one that caught up on tokens another drafter committed
                # first is this sequence's alone, and must not displace the prompt's)
                snapshot = self.model.new_cache(self.cache.length)
                snapshot.copy_prefix(self.cache, self.cache.length)
                PREFILLED[self.model] = (tuple(pending), self.window, snapshot, self.skip)

    def accepted(self, feedback: Feedback) -> None:
        assert self.cache is not None
        if self._growth is not None:  # a tree: keep the rows of the accepted path that were fed
            g, self._growth = self._growth, None
            slots = g.kept_slots(feedback.path)
            self.cache.keep(g.start, torch.tensor(slots, dtype=torch.long, device=self.cache.pos.device))
            g.learn(feedback.path)
            self._tokens += [g.nodes[j].token for j in feedback.path] + [feedback.next_token]
            if self.seq_vocab is not None:
                self.seq_vocab.add([feedback.next_token])
            self._proposal, self._confidences = [], []
            return
        n = feedback.num_accepted
        # The cache holds the old committed tokens plus the drafts that were fed (all but the
        # last); keep exactly the part that is still on the committed path.
        valid = len(self._tokens) + min(n, max(len(self._proposal) - 1, 0)) - self.skip
        if self.confidence:
            self.calibration.update(self._confidences, n)
        self._tokens += self._proposal[:n] + [feedback.next_token]
        if self.seq_vocab is not None:
            self.seq_vocab.add([feedback.next_token])
        self.cache.truncate(min(self.cache.length, valid))
        self._proposal, self._confidences = [], []


def _calibration(session: DraftSession, key: Hashable) -> Calibration:
    """The calibration a sequence drafts by: for greedy requests, the one its pool's earlier
    greedy requests with this draft built (`memory.Memory`); a fresh one for sampled requests
    (a seeded request's depths must not depend on what ran before it)."""
    if not session.sampling.greedy:
        return Calibration()
    return session.memory.part(("draft-confidence", key), Calibration)
