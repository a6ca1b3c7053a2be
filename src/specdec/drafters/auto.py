"""`--drafter auto`: each step, the drafter and k predicted to give the most tokens per second —
or a plain step where none is predicted to beat plain decoding.

Candidates are the drafters that can follow tokens another drafter proposed (`catch_up`):
prompt lookup and suffix decoding always, the draft model when one is given (`--draft`), and an
EAGLE-3 head when
asked for (eagle3 in `methods`: the head shipped for the target, or `--auto-head DIR`), Medusa
or Hydra heads when named in `methods` (the ones shipped for the target). The
head is not among the defaults: with the shipped head's agreement, auto with it was no faster
than without it on the quick suite (and slower where prompt lookup copies well), on a CPU
whose extra rows are dear. A tree drafter proposes chains here (`chain_only`: its most likely
chain of the k chosen), since the chooser prices chains. Each step every candidate
says what it could propose now (`outlook`: prompt lookup has nothing without an n-gram match,
and its situation is the match length), and `specdec.adaptive.MethodChooser` ranks (drafter,
k) by the expected-tokens formula over this request's measured acceptance by position (per
drafter and situation, discounted so that a change of topic is followed), each drafter's
measured cost per drafted token (starting from its own estimate, `cost_ms`: a draft model's
one-row pass time on this machine), and the target's pass time per row count on this machine
(`specdec.costs.pass_costs`). Plain steps probe the drafters in turn with one token now and
then, so their estimates can recover.

One tree per step (`merge`, on by default when suffix decoding is a member; it reaches it as
a `TreeMember`, not by name): suffix decoding
does not compete as a chain but with its own tree, sized by its own cost model (`plan`: the
expected tokens per millisecond of its best tree); it takes the step where that beats the
chooser's choice. Where the chooser's chain drafter wins (the draft model, prompt lookup),
the best part of suffix decoding's tree goes to the target in the same pass, merged with the
chain as a trie (`merge`, `_with_suffix`). Each source then hears of the part of the
accepted path that was its own (`accepted`) and catches up on the rest.

The chosen drafter proposes and gets the verification's feedback; the others are told the
committed tokens (`catch_up`). The draft model is not prefilled at `begin`: when chosen, it
first feeds the tokens it missed (`sync`, timed apart from drafting). That cost (`switch_ms`)
is charged to the step that would switch, spread over the tokens still to generate, and a
probe may not spend more than 10% of the rest of the request on it: a long prompt with a short
answer never pays the draft's prefill.

Exactness: every step is verified by the same exact rule whatever drafter and k proposed it
(a merged tree whose chain the draft model drew at T > 0: `verify.tree_mixed_sample`),
and the choice depends only on steps already verified (never on the step's own draws), so
greedy output equals plain decoding and the sampled distribution is the target's (tested with
random switching, and with a wrong rule as a negative control). The choices, the estimates
and the number of switches are reported in `info["auto"]`.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import costs
from ..adaptive import KEEP_MEASURED, MethodChooser, acceptance_memory, outlook_of
from ..costs import PRICED_K
from ..metrics import timer
from ..model.transformer import Transformer
from ..sampling import make_generator
from .base import (
    DRAFTERS,
    Draft,
    Drafter,
    DraftSession,
    Feedback,
    Option,
    Switchable,
    TreeMember,
    make_drafter,
    one_batch,
    register,
    remembered,
)
from .confidence import CONFIDENCE_OPTION
from .vocab import DEFAULT_VOCAB, VOCAB_OPTION
from .window import DEFAULT_WINDOW, WINDOW_OPTION


def switchable() -> list[str]:
    """Registered drafters that `auto` can switch between (they implement `catch_up`)."""
    return [n for n, spec in DRAFTERS.items() if spec.switchable]


def _describe(info: dict[str, Any], brief: bool) -> list[str]:
    if not info.get("auto") or brief:
        return []
    steps = info["auto"]["steps"]
    return [
        "auto steps: "
        + "; ".join(f"{name} " + ", ".join(f"{k} {n}" for k, n in ks.items()) for name, ks in steps.items())
    ]


@register(
    "auto",
    describe=_describe,
    needs="any",
    default_k=16,  # the deepest a step may go: chains stop at the chooser's PRICED_K, suffix trees here
    help="choose the drafter (prompt lookup, suffix; the draft model with --draft; an EAGLE-3 head if asked for) and k "
    "each step, or a plain step, by predicted tokens per second",
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
            "auto: verify suffix decoding's tree together with the chosen drafter's chain in one "
            "pass (0: the chosen drafter's proposal alone)",
            "--auto-merge",
            type=int,
        ),
        VOCAB_OPTION,
        WINDOW_OPTION,
        CONFIDENCE_OPTION,
    ),
)
class AutoDrafter(Drafter):
    """Switches between drafters step by step (see the module doc). `methods`: comma-separated
    names (default: every switchable drafter whose model is given); `margin`: a drafter must
    beat plain decoding's predicted tokens per second by this factor."""

    own_schedule = True  # it chooses plain steps itself

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
    ) -> None:
        super().__init__()
        ok = switchable()
        if methods is None:
            # a drafter of a draft model when one is given; of a trained head only when auto is
            # given its head (see above; the others' heads only when named in `methods`)
            # (the prediction drafter joins a request that carries a prediction: `begin`)
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
        drafter_needs = [n for n in names if DRAFTERS[n].needs == "draft"]
        if drafter_needs and draft is None:
            raise ValueError(f"auto with {drafter_needs[0]} needs a draft model (--draft NAME, or assistant_model=)")
        if draft is not None and not drafter_needs:
            raise ValueError(
                "auto uses the draft model only with draft-model among its methods; drop --draft or "
                "add draft-model to --auto-methods"
            )
        self.target = target
        takes_head = [n for n in ok if DRAFTERS[n].auto_head]
        if head is not None and not set(takes_head) & set(names):
            raise ValueError(
                f"--auto-head gives auto a head for {' / '.join(takes_head)}; add {takes_head[0]} to "
                "--auto-methods or drop --auto-head"
            )
        mine = {
            "head": head,
            "vocab": vocab,
            "window": window,
            "confidence": confidence,
        }  # auto's options its members may declare
        self.subs: dict[str, Switchable] = {
            n: _member(
                n,
                target=target,
                draft=draft if DRAFTERS[n].needs == "draft" else None,
                **{
                    o.name: mine[o.name]
                    for o in DRAFTERS[n].options
                    if o.name in mine and (o.name != "head" or DRAFTERS[n].auto_head)
                },
            )
            for n in names
        }
        # (each member is begun lazily, caught up when first chosen if ever, and on chains the
        # chooser sizes: see `begin`)
        # suffix decoding's tree beside the chosen chain (and as its own proposal when chosen)
        # the member whose tree goes out beside the chosen chain (suffix decoding), if merging
        trees = [n for n, sub in self.subs.items() if isinstance(sub, TreeMember)]
        self.tree_name = trees[0] if merge and trees else None
        self.margin = margin
        self.scratch_rows = max(s.scratch_rows for s in self.subs.values())
        self.wants_hidden = any(s.wants_hidden for s in self.subs.values())
        self.feature_layers = tuple(sorted({i for s in self.subs.values() for i in s.feature_layers}))
        self.chooser: MethodChooser | None = None
        self.k_max = PRICED_K  # the longest chain the chooser prices (deeper with a prediction: `begin`)
        self._plan: tuple[str, Hashable, int] | None = None  # this step's (method, situation, k)
        self._budget = 0  # this step's k from the engine: the deepest a proposal may go
        self._proposal: list[int] = []  # this step's draft nodes
        self._depth = 0  # ...their depth
        self._merged: Merged | None = None  # this step's merged tree, when it is one
        self._merged_sizes: list[int] = []  # every merged tree's nodes
        self._draft_ms = 0.0
        self._sync_ms = 0.0
        self._length = self._capacity = 0  # committed tokens; the most the sequence can reach
        # what a first proposal would pay once per process or machine, paid now (before a
        # request's clock starts: as `api.prepare` does for a drafter alone)
        costs.pass_costs(self.target, PREDICTION_PRICED_K + 1)
        for sub in self.subs.values():
            sub.prepare()

    @property
    def methods(self) -> list[str]:
        return list(self.subs)

    @property
    def merge(self) -> bool:
        """Whether a member's tree goes out beside the chosen chain (`--auto-merge`)."""
        return self.tree_name is not None

    def begin(self, session: DraftSession) -> None:
        self._plan, self._proposal, self._sync_ms, self._merged_sizes = None, [], 0.0, []
        self._length, self._capacity = len(session.context), session.capacity
        if session.prediction and PREDICTION not in self.subs:  # the client's text, followed with a pointer
            self.subs[PREDICTION] = _member(PREDICTION)
        # a prediction followed for a while is accepted nearly whole: its chains may go as deep
        # as the step allows (the others' stay within PRICED_K, where their acceptance ends)
        self.k_max = PREDICTION_PRICED_K if session.prediction and PREDICTION in self.subs else PRICED_K
        for name, sub in self.subs.items():
            # each drafter its own generator, seeded from the session's: reproducible, independent
            seed = int(torch.randint(0, 2**62, (1,), generator=session.generator))
            sub.begin(
                DraftSession(
                    session.context,
                    session.capacity,
                    session.sampling,
                    make_generator(seed, session.generator.device),
                    session.target,
                    session.target_cache,
                    session.layers,
                    session.fixed_k,
                    session.prediction,
                    lazy=True,  # caught up (a draft model prefilled) when first chosen, if ever
                    # the chooser sizes chains; suffix decoding's tree is merged beside the chosen chain
                    chain_only=name != self.tree_name,
                    pool=session.pool,
                    pricing=session.pricing,
                )
            )
        self.chooser = MethodChooser(
            self.methods,
            self.k_max,
            session.pricing.passes(self.k_max + 1),
            margin=self.margin,
            draft_ms={n: sub.cost_ms() for n, sub in self.subs.items()},
            memory=acceptance_memory(self.target, session.sampling.greedy),
            remembered=remembered(self.methods),
            reproducible=session.pricing.reproducible,
            self_sized=frozenset(n for n, sub in self.subs.items() if sub.sizes_itself),
            priors=lambda m, situation: self.subs[m].prior_alpha(situation),
            steps=lambda m: self.subs[m].step_record(),
        )

    def end(self, final: Feedback | None = None) -> None:
        """The member that proposed the finishing step hears of it (the prediction's counts)."""
        method = self._plan[0] if self._plan is not None else "plain"
        last: dict[str, Feedback] = {}
        if final is not None and final.kept is not None and method != "plain":
            if self._merged is not None:
                n = _along(final.path, self._merged.chain)
                last[method] = replace(
                    _part(final, list(range(n)), self._merged.chain[:n], final.next_token), kept=min(n, final.kept)
                )
            else:
                last[method] = final
        for name, sub in self.subs.items():
            sub.end(last.get(name))
        self._report()

    def batch_key(self) -> Hashable:
        return ("auto",)

    def propose(self, k: int) -> Draft:
        return self.propose_batch([self], [k])[0]

    def _choose(self, k: int) -> None:
        """Plan this step: the chooser picks from what each drafter could propose now."""
        if self.chooser is None:
            raise RuntimeError("AutoDrafter.propose() called before begin()")
        remaining = self._capacity - self._length
        # (with `merge`, suffix decoding competes with its own tree's rate, not as a chain)
        outlook = {
            name: o
            for name, sub in self.subs.items()
            if name != self.tree_name
            and (o := outlook_of(sub, k if name == PREDICTION else min(k, PRICED_K))) is not None
        }
        method, kk = self.chooser.choose(outlook, remaining=remaining)
        self._plan = (method, outlook[method][0] if method in outlook else None, kk)
        self._budget = k
        tree_member = self._tree_member()
        if tree_member is not None and k > 0:
            sit, tree, rate = tree_member.plan(k)
            # (the chosen drafter's rate as the chooser ranked it: a self-sized one's by its record)
            chosen = (
                0.0
                if method == "plain"
                else self.chooser.rates_now.get(method)
                or self.chooser.rate(method, *self._plan[1:], *outlook[method][2:], remaining=remaining)
            )
            # (a draft model's chain adds what the tree cannot; another copy's chain adds little)
            joins = self._merges(method) and method in self.chooser.self_sized
            if tree.tokens and self._suffix_wins(rate, chosen, joins):
                self.chooser.chosen[(method, kk)] -= 1  # (its report counts what ran)
                if not self.chooser.chosen[(method, kk)]:
                    del self.chooser.chosen[(method, kk)]
                self._plan = (tree_member.name, sit, k)
                self.chooser.chosen[(tree_member.name, max(_depths(tree.parents)))] += 1  # (its depth as k)
        self._proposal, self._depth, self._merged, self._draft_ms = [], 0, None, 0.0

    def _suffix_wins(self, tree_rate: float, chosen_rate: float, merged: bool = False) -> bool:
        """Whether suffix decoding's tree (its own sizing: `tree_rate`, expected tokens per ms,
        beating plain decoding by its margin) beats the chooser's choice (0: a plain step).
        Where the choice is a draft model's chain that suffix's tree would join anyway
        (`merged`), the tree alone must beat it by KEEP_MEASURED: the merged step keeps the
        tree's chances and adds the chain's, so a tree that only matches the chain's rate is
        worth less alone (on open text, one-token trees from one-token matches took steps from
        the draft and mostly committed nothing). Against prompt lookup's chain, another copy of
        the same text, any margin (taking KEEP_MEASURED there too left code editing to prompt
        lookup's shorter chains)."""
        return tree_rate > chosen_rate * (KEEP_MEASURED if merged else 1.0)

    @classmethod
    def propose_batch(cls, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Draft]:
        """Each sequence's choice; then the chosen drafters propose, those that share a batch
        key together (one draft-model forward per draft step serves every sequence that chose it);
        then, with `merge`, suffix decoding's tree joins each chosen chain."""
        group: list[AutoDrafter] = one_batch(cls, drafters)
        out = [Draft.empty(d.target.device) for d in group]
        by_key: dict[Hashable, list[int]] = {}
        for i, (d, k) in enumerate(zip(group, ks, strict=True)):
            d._choose(k)
            method = d._chosen()[0]
            if method == "plain":
                continue
            sub = d.subs[method]
            with timer(d.target.device) as t:
                sub.sync()
            d._sync_ms += 1e3 * t[0]
            key = sub.batch_key()
            by_key.setdefault((method, key if key is not None else ("alone", i)), []).append(i)
        for idx in by_key.values():
            subs = [group[i].subs[group[i]._chosen()[0]] for i in idx]
            # (a chain as long as the chooser chose; suffix's own tree as deep as the step allows)
            asked = [
                group[i]._budget if subs[n].name == group[i].tree_name else group[i]._chosen()[2]
                for n, i in enumerate(idx)
            ]
            with timer(group[idx[0]].target.device) as t:
                drafts = type(subs[0]).propose_batch(subs, asked)
            for i, draft in zip(idx, drafts, strict=True):
                d = group[i]
                if draft.extra is not None or (draft.parents is not None and d._chosen()[0] != d.tree_name):
                    raise RuntimeError(f"auto switches between chain drafters; {d._chosen()[0]} proposed a tree")
                d._draft_ms = 1e3 * t[0] / len(idx)
                d._proposal, d._depth = draft.tokens.tolist(), draft.depth()
                out[i] = d._with_suffix(draft) if d._merges(d._chosen()[0]) else draft
        for d in group:
            d.forwards = sum(sub.forwards for sub in d.subs.values())
        return out

    def _chosen(self) -> tuple[str, Hashable, int]:
        """This step's plan (method, situation, k), once `_choose` made it."""
        assert self._plan is not None
        return self._plan

    def _tree_member(self) -> TreeMember | None:
        """The member whose tree goes out beside the chosen chain (None: no merging)."""
        sub = self.subs.get(self.tree_name) if self.tree_name is not None else None
        return sub if isinstance(sub, TreeMember) else None

    def _merges(self, method: str) -> bool:
        """Whether suffix decoding's tree joins `method`'s chain: not for suffix itself, nor for
        a drafter that reads the target's features of committed rows (a head: it follows only
        a path of its own rows or a whole pass's feedback)."""
        sub = self.subs.get(method)
        return (
            self.merge and method != self.tree_name and sub is not None and not (sub.wants_hidden or sub.feature_layers)
        )

    def _with_suffix(self, chain: Draft) -> Draft:
        """The chosen chain and the best part of suffix decoding's tree, merged as a trie.

        Sizing: each suffix node adds its chance of acceptance where the chain is predicted to
        miss at its depth (`chance * (1 - a_d)`, a_d: the chooser's measured chance that the
        chain reaches depth d) and costs a row; the prefix of the tree's best-first order with
        the most expected tokens per millisecond is sent. A node the chain proposes already
        (the same tokens from the root: another copy of the same text) adds neither a row nor
        a token, so a tree that runs on past a copying chain's end is priced by what it adds
        there. That reads the chain's tokens, so only for a chain without draws: in sampling,
        which deterministic attempts are made must not depend on what the draft model drew
        (`verify.tree_mixed_sample`); a drawn chain's tokens are never read here."""
        suffix = self._tree_member()
        assert suffix is not None  # (`_merges` is true only with one)
        sit, tree = suffix.tree(self._budget)
        depths = _depths(tree.parents)
        shared = _on_chain(chain.tokens.tolist(), tree.tokens, tree.parents, depths) if chain.probs is None else None
        n = self._tree_nodes(tree.probs, depths, shared) if tree.tokens else 0
        suffix.take(sit, tree, n)
        if n == 0:
            return chain
        self._merged = merged = merge(chain.tokens.tolist(), chain.probs is not None, tree.tokens[:n], tree.parents[:n])
        self._proposal = merged.tokens
        self._merged_sizes.append(len(merged.tokens))
        draft = Draft(
            torch.tensor(merged.tokens, dtype=torch.long, device=chain.tokens.device), None, parents=merged.parents
        )
        self._depth = draft.depth()
        if chain.probs is not None:  # drawn chain nodes beside fixed ones: the mixed rule
            q = chain.probs.new_zeros(len(merged.tokens), chain.probs.shape[-1])
            q[merged.chain] = chain.probs
            draft.probs, draft.attempts = q, merged.attempts
        return draft

    def _tree_nodes(self, chances: list[float], depths: list[int], shared: list[bool] | None = None) -> int:
        """How many of the tree's nodes (best first: their chances, depths; `shared`: those the
        chain proposes already) join this step's chain."""
        assert self.chooser is not None and self._plan is not None
        method, situation, k = self._plan
        reach = self.chooser._acc(method, situation).alpha()[:k]
        draft_ms = self.chooser.draft_cost(method) * k
        expected = 1.0 + sum(reach)
        n, best, rows = 0, expected / (draft_ms + self.chooser.costs.target(1 + k)), 1 + k
        for j, (p, d) in enumerate(zip(chances, depths, strict=True), start=1):
            if shared is not None and shared[j - 1]:
                continue  # (no row, no token the chain does not bring)
            rows += 1
            expected += p * (1.0 - (reach[d - 1] if d <= len(reach) else 0.0))
            rate = expected / (draft_ms + self.chooser.costs.target(rows))
            if rate > best:
                n, best = j, rate
        return n

    def accepted(self, feedback: Feedback) -> None:
        assert self.chooser is not None
        method, situation, k = self._plan if self._plan is not None else ("plain", None, 0)
        committed = [self._proposal[j] for j in feedback.path] + [feedback.next_token]
        told = {method}
        if self._merged is not None:  # each source hears of the part of the path that was its own
            m = self._merged
            n = _along(feedback.path, m.chain)
            self.subs[method].accepted(_part(feedback, list(range(n)), m.chain[:n], committed[n]))
            self.subs[method].catch_up(committed[n + 1 :], None)
            own = {j: o for o, j in enumerate(m.tree)}
            path_s = [own[j] for j in itertools.takewhile(lambda j: j in own, feedback.path)]
            tree_name = self.tree_name
            assert tree_name is not None
            self.subs[tree_name].accepted(_part(feedback, path_s, [m.tree[o] for o in path_s], committed[len(path_s)]))
            self.subs[tree_name].catch_up(committed[len(path_s) + 1 :], None)
            told.add(tree_name)
            self.chooser.update(method, situation, k, len(m.chain), n, self._draft_ms)
        elif method != "plain":
            self.subs[method].accepted(feedback)
            if self._merges(method) and self.tree_name is not None:  # (the tree's part was empty: none of it went)
                self.subs[self.tree_name].catch_up(committed, feedback)
                told.add(self.tree_name)
            if method != self.tree_name:  # (which prices its trees itself)
                self.chooser.update(method, situation, k, self._depth, feedback.num_accepted, self._draft_ms)
        self._length += len(committed)
        for name, sub in self.subs.items():
            if name not in told:
                sub.catch_up(committed, feedback)
        self._plan, self._proposal, self._merged = None, [], None

    def _report(self) -> None:
        self.forwards = sum(sub.forwards for sub in self.subs.values())
        info: dict[str, Any] = {}
        prediction = self.subs.get(PREDICTION)
        if prediction is not None:  # what the client's prediction gave (its own proposals and merged steps)
            info["prediction"] = prediction.info["prediction"]  # (what its `end` counted)
        if self.chooser is not None:
            report: dict[str, Any] = self.chooser.report()
            report["sync_ms"] = round(self._sync_ms, 3)
            if self.merge:  # steps whose chain went out with suffix decoding's tree, and their size
                sizes = self._merged_sizes
                report["merged"] = {
                    "steps": len(sizes),
                    "tree_tokens_mean": round(sum(sizes) / len(sizes), 2) if sizes else None,
                }
            info["auto"] = report
        self.info = info


def _member(name: str, **kw: Any) -> Switchable:
    sub = make_drafter(name, **kw)
    assert isinstance(sub, Switchable)  # (the registry lists only those as auto's: `switchable`)
    return sub


PREDICTION = "prediction"
PREDICTION_PRICED_K = 31  # the deepest chain a prediction may propose in one step (a pass of 32 rows)


@dataclass
class Merged:
    """A chain and a tree merged as a trie (`merge`)."""

    tokens: list[int]  # [K] the trie's nodes, parents first
    parents: list[int]  # [K]
    chain: list[int]  # the chain's tokens' nodes, in order
    tree: list[int]  # the tree's nodes' nodes, in the tree's order
    attempts: list[tuple[int, bool]]  # each node's attempts in the order tried at its parent: the chain's first


def merge(chain: list[int], drawn: bool, tokens: list[int], parents: list[int]) -> Merged:
    """The trie of a chain (drawn from a draft model's q, or deterministic) and a deterministic
    tree (`tokens`, `parents`, parents first): a path both propose is one node. A node the chain
    drew and the tree fixes is tried twice (drawn, then fixed: the mixed rule may drop neither);
    one both fix, once."""
    out = Merged([], [], [], [], [])
    at: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tried: set[tuple[int, bool]] = set()

    def node(parent: int, token: int, sampled: bool) -> int:
        j = at.get((parent, token))
        if j is None:
            j = at[(parent, token)] = len(out.tokens)
            out.tokens.append(token)
            out.parents.append(parent)
        if (j, sampled) not in tried:
            tried.add((j, sampled))
            out.attempts.append((j, sampled))
        return j

    parent = -1
    for token in chain:
        parent = node(parent, token, drawn)
        out.chain.append(parent)
    for token, p in zip(tokens, parents, strict=True):
        out.tree.append(node(-1 if p < 0 else out.tree[p], token, False))
    return out


def _depths(parents: list[int]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def _on_chain(chain: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> list[bool]:
    """Which of a tree's nodes (parents first) a chain proposes already: the same tokens from
    the root."""
    on: list[bool] = []
    for token, p, d in zip(tokens, parents, depths, strict=True):
        on.append((p < 0 or on[p]) and d <= len(chain) and chain[d - 1] == token)
    return on


def _along(path: list[int], nodes: list[int]) -> int:
    """How many of the accepted path's first nodes are `nodes`' first (a chain's accepted part)."""
    n = 0
    while n < min(len(path), len(nodes)) and path[n] == nodes[n]:
        n += 1
    return n


def _part(feedback: Feedback, path: list[int], nodes: list[int], next_token: int) -> Feedback:
    """The feedback one source of a merged tree gets: its own accepted nodes (`path`, in its
    proposal's indices; `nodes`: theirs in the merged tree) and the token after them, with the
    target's rows on that path."""
    rows = [0] + [j + 1 for j in nodes]
    return Feedback(
        path,
        next_token,
        feedback.logits[rows],
        hidden=feedback.hidden[rows] if feedback.hidden is not None else None,
        layers={i: h[rows] for i, h in feedback.layers.items()},
    )
