"""`--drafter auto`: each step, every member offers its best proposal now and the chooser takes
the one with the most tokens per millisecond — or a plain step (`specdec.adaptive`).

Members are the drafters that can follow tokens another drafter proposed (`Switchable`): prompt
lookup and suffix decoding always, the draft model when one is given (`--draft`), an EAGLE-3
head when asked for (eagle3 in `methods`, or `--auto-head DIR`), Medusa or Hydra heads when
named in `methods`, and the client's prediction when a request carries one. A chain member
offers its best k by the position model; the draft model what its steps did; suffix decoding its
own tree, sized by its own plan. With `merge` (on when suffix decoding is a member), each chain
member that can share a pass also offers its chain with the best part of suffix decoding's tree
beside it, merged as a trie and priced on the same scale: the tree's nodes add their chance of
acceptance where the chain is predicted to miss at their depth, and cost their rows.

The chosen member proposes and hears the verification's feedback; the others are told the
committed tokens (`catch_up`). The draft model is not prefilled at `begin`: when chosen it first
feeds the tokens it missed (`sync`, timed apart from drafting); its offer carries that cost.

Exactness: every step is verified by the same exact rule whatever member and k proposed it (a
merged tree whose chain the draft model drew at T > 0: `verify.tree_mixed_sample`), and the
choice depends only on steps already verified, so greedy output equals plain decoding and the
sampled distribution is the target's (tested with random switching, and with a wrong rule as a
negative control). Each step's offers, pick and result are in `info["schedule"]["log"]`
(`adaptive.REPORT`, the key the schedule of one drafter reports under too); the per-member table
in `info["schedule"]["members"]` (`specdec generate --explain` prints it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..adaptive import REPORT, Chooser, alpha_report
from ..metrics import timer
from ..model.transformer import Transformer
from ..offers import PLAIN, Estimates, Offer, unsent
from ..sampling import make_generator
from .base import (
    DRAFTERS,
    Draft,
    Drafter,
    DraftSession,
    Feedback,
    Option,
    ScoredTree,
    Switchable,
    TreeMember,
    make_drafter,
    one_batch,
    register,
    remembered,
)
from .confidence import CONFIDENCE_OPTION
from .merge import Merged, along, chain_part, depths, merged_draft, on_chain, split, tree_beside
from .vocab import DEFAULT_VOCAB, VOCAB_OPTION
from .window import DEFAULT_WINDOW, WINDOW_OPTION

PREDICTION = "prediction"
PREDICTION_PRICED_K = 31  # the deepest chain a prediction may propose in one step (a pass of 32 rows)
# the deepest chain the other members may propose (each offers its best k within it): past
# PRICED_K, where the position model extrapolates, a sure copy or a sure draft still pays on the
# measured pass table (docs/results.md, 2026-12-06 fifth entry)
CHAIN_K = 16


def switchable() -> list[str]:
    """Registered drafters that `auto` can switch between (they implement `catch_up`)."""
    return [n for n, spec in DRAFTERS.items() if spec.switchable]


def _describe(info: dict[str, Any], brief: bool) -> list[str]:
    """What auto could not build (its steps are the chooser's report, printed for any chooser)."""
    return [f"auto left out {name}: {why}" for name, why in info.get(REPORT, {}).get("left_out", {}).items()]


@register(
    "auto",
    describe=_describe,
    needs="any",
    default_k=16,  # the deepest a step may go (chains to CHAIN_K, suffix trees, a prediction's to its own)
    help="each step, the member (prompt lookup, suffix; the draft model with --draft; an EAGLE-3 head if asked for) "
    "whose offer gives the most tokens per second, or a plain step",
    options=(
        Option(
            "methods",
            "auto: the drafters to choose from, comma-separated (default: prompt-lookup, "
            "suffix, draft-model with --draft, eagle3 with --auto-head)",
            "--auto-methods",
            type=str,
        ),
        Option(
            "head",
            "auto: include this EAGLE-3 head (directory; with eagle3 in --auto-methods, default: "
            "the head shipped for the target)",
            "--auto-head",
            type=str,
        ),
        Option(
            "merge",
            "auto: chains may go out with suffix decoding's tree beside them in one pass (0: never)",
            "--auto-merge",
            type=int,
        ),
        VOCAB_OPTION,
        WINDOW_OPTION,
        CONFIDENCE_OPTION,
    ),
)
class AutoDrafter(Drafter):
    """Switches between members step by step (see the module doc). `methods`: comma-separated
    names (default: every switchable drafter whose model is given); `margin`: an offer must
    beat plain decoding's tokens per ms by this factor; `bridge`: a draft of another tokenizer
    (`drafters.cross`); `left_out`: members the caller could not build, with why (reported)."""

    own_schedule = True  # its chooser takes plain steps itself

    def __init__(
        self,
        target: Transformer,
        draft: Transformer | None = None,
        methods: str | None = None,
        head: Any = None,
        margin: float = 1.03,
        vocab: int = DEFAULT_VOCAB,
        window: int = DEFAULT_WINDOW,
        merge: bool | int = True,
        confidence: int = 1,
        bridge: Any = None,
        left_out: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        names = _members(draft, methods, head)
        mine = {"head": head, "vocab": vocab, "window": window, "confidence": confidence}  # options members declare
        self.target, self.margin = target, margin
        self.left_out = dict(left_out or {})  # members it could not build, and why (said after a run)
        self.subs: dict[str, Switchable] = {
            n: _member(
                n,
                target=target,
                draft=draft if DRAFTERS[n].needs == "draft" else None,
                bridge=bridge if DRAFTERS[n].needs == "draft" else None,
                **{
                    o.name: mine[o.name]
                    for o in DRAFTERS[n].options
                    if o.name in mine and (o.name != "head" or DRAFTERS[n].auto_head)
                },
            )
            for n in names
        }
        # the member whose tree goes out alone or beside a chain (suffix decoding), if merging
        trees = [n for n, sub in self.subs.items() if isinstance(sub, TreeMember)]
        self.tree_name = trees[0] if merge and trees else None
        self.scratch_rows = max(s.scratch_rows for s in self.subs.values())
        self.wants_hidden = any(s.wants_hidden for s in self.subs.values())
        self.feature_layers = tuple(sorted({i for s in self.subs.values() for i in s.feature_layers}))
        self.est: Estimates | None = None  # this sequence's (set by `begin`)
        self.chooser = Chooser(margin)
        self._pick: Offer | None = None  # this step's offer
        self._offers: list[Offer] = []  # ...and all it was chosen from
        self._tree: tuple[Hashable, ScoredTree] | None = None  # suffix decoding's tree this step
        self._alone: dict[str, Offer] = {}  # this step's chain offers before a tree joined them
        self._budget = 0  # this step's k from the engine: the deepest a proposal may go
        self._proposal: list[int] = []  # this step's draft nodes
        self._merged: Merged | None = None  # this step's merged tree, when it is one
        self._merged_sizes: list[int] = []
        self._draft_ms = self._sync_ms = 0.0
        self._length = self._capacity = 0  # committed tokens; the most the sequence can reach
        self._load: tuple[float, float] = (0, 0.0)  # what the rest of the batch brings to this step's pass
        self._first = True  # the first step: members whose request repays their catch-up pay it first
        self._scopes: dict[str, str] = {}  # members whose measurements the machine's history keeps
        self._pricing: Any = None  # this sequence's (`costs.Pricing`, set by `begin`)

    @property
    def methods(self) -> list[str]:
        return list(self.subs)

    @property
    def merge(self) -> bool:
        return self.tree_name is not None

    def begin(self, session: DraftSession) -> None:
        self._pick, self._proposal, self._sync_ms, self._merged_sizes = None, [], 0.0, []
        self._length, self._capacity = len(session.context), session.capacity
        if session.prediction and PREDICTION not in self.subs:  # the client's text, followed with a pointer
            self.subs[PREDICTION] = _member(PREDICTION)
        for name, sub in self.subs.items():
            # each member its own generator, seeded from the session's: reproducible, independent
            seed = int(torch.randint(0, 2**62, (1,), generator=session.generator))
            sub.begin(
                replace(
                    session,
                    generator=make_generator(seed, session.generator.device),
                    chain_only=name != self.tree_name,  # (the chooser sizes chains)
                )
            )
        # a prediction followed for a while is accepted nearly whole: its chains may go as deep as
        # the step allows (the others' stay within CHAIN_K)
        k_max = PREDICTION_PRICED_K if PREDICTION in self.subs and session.prediction else CHAIN_K
        assert session.pricing is not None
        self._pricing, greedy = session.pricing, session.sampling.greedy
        # (a sampled request starts afresh, as with the pool's memory)
        self._scopes = {n: sc for n, sub in self.subs.items() if greedy and (sc := sub.scope()) is not None}
        self.est = Estimates(
            session.pricing.passes(k_max + 1),
            k_max,
            session.memory.acceptance if greedy else None,
            remembered(self.methods),
            session.pricing.reproducible,
            {(n, sit): c for n, sc in self._scopes.items() for sit, c in session.pricing.past(f"{sc}|{n}").items()},
        )
        self.chooser = session.chooser(self.margin)
        self._load, self._first = (0, 0.0), True

    def _pays_back(self, k: int) -> list[str]:
        """The members with a catch-up (a draft model reading the prompt) whose first step's
        offer, the catch-up spread over the whole budget and priced on the batch's pass, beats
        plain decoding: the request is long enough to repay it, so it is paid once before the
        first step's offers (`_choose`) and sunk — each offer after it is priced on its merits.
        A short answer after a long prompt keeps it in the offer, where it loses to plain
        decoding; so does a batch whose pass leaves no room for drafting (decided at `begin`,
        where a sequence is alone, each sequence of a batch of four paid its prefill)."""
        assert self.est is not None
        plain, k = self.est.plain(), min(CHAIN_K, k)
        out = []
        for name, sub in self.subs.items():
            offer = sub.offer(k, self.est) if k > 0 and name != self.tree_name else None
            if offer is not None and offer.catch_up_ms > 0 and offer.rate > self.margin * plain.rate:
                out.append(name)
        return out

    def plan(self, k: int, remaining: int | None = None, load: tuple[float, float] = (0, 0.0)) -> int:
        """The step's k (the engine's budget: auto's chooser sizes it itself), and the rows and
        tokens the rest of the batch brings to the same pass: every offer is priced on that pass."""
        self._load = load
        return k

    def prepare(self) -> None:
        """What a first proposal would pay once per process or machine, paid before any clock."""
        for sub in self.subs.values():
            sub.prepare()

    def end(self, final: Feedback | None = None) -> None:
        """The member that proposed the finishing step hears of it (the prediction's counts)."""
        last: dict[str, Feedback] = {}
        pick = self._pick
        if final is not None and final.kept is not None and pick is not None and pick.member != PLAIN:
            last[pick.member] = chain_part(final, self._merged) if self._merged is not None else final
        for name, sub in self.subs.items():
            sub.end(last.get(name))
        self._report()
        if self.est is not None:  # what this request measured joins the machine's history
            for name, counts in self.est.counts(self._scopes).items():
                self._pricing.keep(f"{self._scopes[name]}|{name}", counts)

    def batch_key(self) -> Hashable:
        return ("auto",)

    def propose(self, k: int) -> Draft:
        return self.propose_batch([self], [k])[0]

    def _choose(self, k: int) -> None:
        """Plan this step: every member's offer, then the chooser's pick."""
        est = self.est
        if est is None:
            raise RuntimeError("AutoDrafter.propose() called before begin()")
        remaining = self._capacity - self._length
        est.step(remaining, self._load)
        for name in self._pays_back(k) if self._first else ():  # (paid once, now)
            with timer(self.target.device) as t:
                self.subs[name].sync()
            self._sync_ms += 1e3 * t[0]
        self._first = False
        self._budget, self._tree, self._alone = k, None, {}
        tree_member = self._tree_member()
        offers: list[Offer] = []
        for name, sub in self.subs.items():
            if name == self.tree_name:
                continue
            offer = sub.offer(k if name == PREDICTION else min(k, CHAIN_K), est) if k > 0 else None
            if offer is not None and tree_member is not None and self._merges(name):
                offer = self._merged_offer(offer, tree_member, k)
            if offer is not None:
                offers.append(offer)
        if tree_member is not None and k > 0 and (own := tree_member.offer(k, est)) is not None:
            offers.append(own)
        self._pick, self._offers = self.chooser.choose(offers, est.plain(), remaining), offers
        self._proposal, self._merged, self._draft_ms = [], None, 0.0

    def _merged_offer(self, chain: Offer, tree_member: TreeMember, k: int) -> Offer:
        """`chain` with the best part of the tree member's tree beside it (itself where no part
        pays), priced before the chain is drawn: what the tree adds where the chain misses."""
        if self._tree is None:
            self._tree = tree_member.tree(k)
        tree = self._tree[1]
        n, tokens, ms = self._tree_nodes(chain, tree, depths(tree.parents))
        self._alone[chain.member] = chain
        return replace(chain, tokens=tokens, ms=ms, merged=n) if n else chain

    def _tree_nodes(
        self, chain: Offer, tree: ScoredTree, depth: list[int], shared: list[bool] | None = None
    ) -> tuple[int, float, float]:
        """`merge.tree_beside` by this sequence's estimates."""
        assert self.est is not None
        reach = self.est.alpha(chain.member, chain.situation)[: chain.k]
        return tree_beside(chain, tree.probs, depth, reach, self.est.costs.rows, shared)

    @classmethod
    def propose_batch(cls, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Draft]:
        """Each sequence's pick; then the picked members propose, those that share a batch key
        together (one draft-model forward per draft step serves every sequence that picked it);
        then suffix decoding's tree joins each picked chain that merges."""
        group: list[AutoDrafter] = one_batch(cls, drafters)
        out = [Draft.empty(d.target.device) for d in group]
        by_key: dict[Hashable, list[int]] = {}
        for i, (d, k) in enumerate(zip(group, ks, strict=True)):
            d._choose(k)
            member = d._member()
            if member is None:
                continue
            with timer(d.target.device) as t:
                member.sync()
            d._sync_ms += 1e3 * t[0]
            key = member.batch_key()
            by_key.setdefault((member.name, key if key is not None else ("alone", i)), []).append(i)
        for idx in by_key.values():
            subs = [group[i]._member() for i in idx]
            # (a chain as long as picked; suffix's own tree as deep as the step allows)
            asked = [group[i]._budget if group[i]._own_tree() else group[i]._k() for i in idx]
            with timer(group[idx[0]].target.device) as t:
                drafts = type(subs[0]).propose_batch(subs, asked)  # type: ignore[arg-type]
            for i, draft in zip(idx, drafts, strict=True):
                d = group[i]
                if draft.extra is not None or (draft.parents is not None and not d._own_tree()):
                    raise RuntimeError(f"auto switches between chain drafters; {d._pick.member} proposed a tree")  # type: ignore[union-attr]
                d._draft_ms = 1e3 * t[0] / len(idx)
                d._proposal = draft.tokens.tolist()
                out[i] = d._with_suffix(draft) if d._merges(d._pick.member) else draft  # type: ignore[union-attr]
        for d in group:
            d.forwards = sum(sub.forwards for sub in d.subs.values())
        return out

    def proposer(self) -> str:
        return self._pick.member if self._pick is not None else PLAIN

    def _member(self) -> Switchable | None:
        """The member this step's pick proposes with (None: a plain step)."""
        return self.subs[self._pick.member] if self._pick is not None and self._pick.member != PLAIN else None

    def _k(self) -> int:
        return self._pick.k if self._pick is not None else 0

    def _own_tree(self) -> bool:
        """Whether this step is the tree member's own tree."""
        return self._pick is not None and self._pick.member == self.tree_name

    def _tree_member(self) -> TreeMember | None:
        sub = self.subs.get(self.tree_name) if self.tree_name is not None else None
        return sub if isinstance(sub, TreeMember) else None

    def _merges(self, member: str) -> bool:
        """Whether suffix decoding's tree may join `member`'s chain: not suffix's own, nor a
        drafter that reads the target's features of committed rows (a head: it follows only a
        path of its own rows or a whole pass's feedback)."""
        sub = self.subs.get(member)
        return (
            self.merge and member != self.tree_name and sub is not None and not (sub.wants_hidden or sub.feature_layers)
        )

    def _with_suffix(self, chain: Draft) -> Draft:
        """The proposed chain and the best part of suffix decoding's tree, merged as a trie,
        sized again now that the chain is known: a tree node the chain proposes already costs
        no row. That reads the chain's tokens, so only for a chain without draws: in sampling,
        which deterministic attempts are made must not depend on what the draft model drew
        (`verify.tree_mixed_sample`)."""
        suffix = self._tree_member()
        assert suffix is not None and self._pick is not None  # (`_merges` is true only with one)
        sit, tree = self._tree if self._tree is not None else suffix.tree(self._budget)
        depth = depths(tree.parents)
        shared = on_chain(chain.tokens.tolist(), tree.tokens, tree.parents, depth) if chain.probs is None else None
        alone = replace(self._alone.get(self._pick.member, self._pick), k=len(chain.tokens))
        n = self._tree_nodes(alone, tree, depth, shared)[0] if tree.tokens else 0
        suffix.take(sit, tree, n)
        if n == 0:
            return chain
        self._merged, draft = merged_draft(chain, tree, n)
        self._proposal = self._merged.tokens
        self._merged_sizes.append(len(self._merged.tokens))
        return draft

    def accepted(self, feedback: Feedback) -> None:
        assert self.est is not None
        pick = self._pick or self.est.plain()
        committed = [self._proposal[j] for j in feedback.path] + [feedback.next_token]
        told = {pick.member}
        if self._merged is not None:  # each source hears of the part of the path that was its own
            assert self.tree_name is not None
            parts = split(feedback, self._merged, committed)
            for name, (own, rest) in zip((pick.member, self.tree_name), parts, strict=True):
                self.subs[name].accepted(own)
                self.subs[name].catch_up(rest, None)
            told.add(self.tree_name)
            self.est.learn(pick, len(self._merged.chain), along(feedback.path, self._merged.chain), self._draft_ms)
        elif pick.member != PLAIN:
            self.subs[pick.member].accepted(feedback)
            if self._merges(pick.member) and self.tree_name is not None:  # (none of the tree went)
                self.subs[self.tree_name].catch_up(committed, feedback)
                told.add(self.tree_name)
            if pick.member != self.tree_name:  # (which learns from its trees itself)
                self.est.learn(pick, len(self._proposal), feedback.num_accepted, self._draft_ms)
        for offer in self._offers:  # a model-free chain that did not go: what it would have kept
            if offer.chain and offer.member != pick.member:
                self.est.observe(offer, *unsent(list(offer.chain), None, committed))
        self.chooser.committed(len(committed), self._draft_ms, feedback.pass_ms)
        self._length += len(committed)
        for name, sub in self.subs.items():
            if name not in told:
                sub.catch_up(committed, feedback)
        self._pick, self._proposal, self._merged = None, [], None

    def _report(self) -> None:
        self.forwards = sum(sub.forwards for sub in self.subs.values())
        info: dict[str, Any] = {}
        prediction = self.subs.get(PREDICTION)
        if prediction is not None:  # what the client's prediction gave (its own proposals and merged steps)
            info["prediction"] = prediction.info["prediction"]
        report = {"methods": self.methods, **self.chooser.report(), "sync_ms": round(self._sync_ms, 3)}
        if self.est is not None:
            report["alpha_by_position"] = alpha_report(self.est)
        if self.merge:  # steps whose chain went out with suffix decoding's tree, and their size
            sizes = self._merged_sizes
            report["merged"] = {
                "steps": len(sizes),
                "tree_tokens_mean": round(sum(sizes) / len(sizes), 2) if sizes else None,
                "tree_tokens_max": max(sizes, default=None),
            }
        if self.left_out:
            report["left_out"] = self.left_out
        info[REPORT] = report
        self.info = info


def _members(draft: Transformer | None, methods: str | None, head: Any) -> list[str]:
    """The member names: `methods`, checked, or by default every switchable drafter whose model
    is given (a draft model's when one is; a trained head's only with auto's head)."""
    ok = switchable()
    if methods is None:  # (the prediction drafter joins a request that carries a prediction: `begin`)
        names = [
            n
            for n in ok
            if n != PREDICTION
            and (
                draft is not None
                if DRAFTERS[n].needs == "draft"
                else head is not None and DRAFTERS[n].auto_head
                if DRAFTERS[n].head
                else True
            )
        ]
    else:
        names = [n.strip() for n in methods.split(",") if n.strip()]
        if not names:
            raise ValueError(f"--auto-methods is empty; give a comma-separated list of {', '.join(ok)}")
        for n in names:
            if n not in ok:
                raise ValueError(f"auto cannot switch to {n!r}; choose among {', '.join(ok)}")
        if len(set(names)) < len(names):
            raise ValueError("--auto-methods names a drafter twice")
    needs_draft = [n for n in names if DRAFTERS[n].needs == "draft"]
    if needs_draft and draft is None:
        raise ValueError(f"auto with {needs_draft[0]} needs a draft model (--draft NAME, or assistant_model=)")
    if draft is not None and not needs_draft:
        raise ValueError(
            "auto uses the draft model only with draft-model among its methods; drop --draft or "
            "add draft-model to --auto-methods"
        )
    takes_head = [n for n in ok if DRAFTERS[n].auto_head]
    if head is not None and not set(takes_head) & set(names):
        raise ValueError(
            f"--auto-head gives auto a head for {' / '.join(takes_head)}; add {takes_head[0]} to "
            "--auto-methods or drop --auto-head"
        )
    return names


def _member(name: str, **kw: Any) -> Switchable:
    sub = make_drafter(name, **kw)
    assert isinstance(sub, Switchable)  # (the registry lists only those as auto's: `switchable`)
    return sub
