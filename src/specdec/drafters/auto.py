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

The chosen drafter proposes and gets the verification's feedback; the others are told the
committed tokens (`catch_up`). The draft model is not prefilled at `begin`: when chosen, it
first feeds the tokens it missed (`sync`, timed apart from drafting). That cost (`switch_ms`)
is charged to the step that would switch, spread over the tokens still to generate, and a
probe may not spend more than 10% of the rest of the request on it: a long prompt with a short
answer never pays the draft's prefill.

Exactness: every step is verified by the same exact rule whatever drafter and k proposed it,
and the choice depends only on steps already verified (never on the step's own draws), so
greedy output equals plain decoding and the sampled distribution is the target's (tested with
random switching, and with a wrong rule as a negative control). The choices, the estimates
and the number of switches are reported in `info["auto"]`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..adaptive import MethodChooser, acceptance_memory, outlook_of, remembered
from ..costs import K_MAX
from ..metrics import timer
from ..model.transformer import Transformer
from ..sampling import make_generator
from .base import DRAFTERS, Draft, Drafter, DraftSession, Feedback, Option, make_drafter, register
from .vocab import DEFAULT_VOCAB, VOCAB_OPTION
from .window import DEFAULT_WINDOW, WINDOW_OPTION


def switchable() -> list[str]:
    """Registered drafters that `auto` can switch between (they implement `catch_up`)."""
    return [n for n, spec in DRAFTERS.items() if spec.switchable]


@register(
    "auto",
    needs="any",
    help="choose the drafter (prompt lookup, suffix; the draft model with --draft; an EAGLE-3 head if asked for) and k "
         "each step, or a plain step, by predicted tokens per second",
    options=(Option("methods", "auto: the drafters to choose from, comma-separated (default: prompt-lookup, "
                               "suffix, draft-model with --draft, eagle3 with --auto-head)", "--auto-methods", type=str),
             Option("head", "auto: include this EAGLE-3 head (directory; with eagle3 in --auto-methods, default: "
                            "the head shipped for the target)", "--auto-head", type=str),
             VOCAB_OPTION, WINDOW_OPTION),
)  # fmt: skip
class AutoDrafter(Drafter):
    """Switches between drafters step by step (see the module doc). `methods`: comma-separated
    names (default: every switchable drafter whose model is given); `margin`: a drafter must
    beat plain decoding's predicted tokens per second by this factor."""

    own_schedule = True  # it chooses plain steps itself

    def __init__(self, target: Transformer, draft: Transformer | None = None, methods: str | None = None,
                 head: Any = None, margin: float = 1.03, vocab: int = DEFAULT_VOCAB,
                 window: int = DEFAULT_WINDOW) -> None:  # fmt: skip
        super().__init__()
        ok = switchable()
        if methods is None:
            # a drafter of a draft model when one is given; of a trained head only when auto is
            # given its head (see above; the others' heads only when named in `methods`)
            names = [n for n in ok if (draft is not None if DRAFTERS[n].needs == "draft" else
                                       head is not None and DRAFTERS[n].auto_head if DRAFTERS[n].head else True)]  # fmt: skip
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
            raise ValueError("auto uses the draft model only with draft-model among its methods; drop --draft or "
                             "add draft-model to --auto-methods")  # fmt: skip
        self.target = target
        takes_head = [n for n in ok if DRAFTERS[n].auto_head]
        if head is not None and not set(takes_head) & set(names):
            raise ValueError(f"--auto-head gives auto a head for {' / '.join(takes_head)}; add {takes_head[0]} to "
                             "--auto-methods or drop --auto-head")  # fmt: skip
        mine = {"head": head, "vocab": vocab, "window": window}  # auto's options its members may declare
        self.subs: dict[str, Drafter] = {
            n: make_drafter(n, target=target, draft=draft if DRAFTERS[n].needs == "draft" else None,
                            **{o.name: mine[o.name] for o in DRAFTERS[n].options if o.name in mine
                               and (o.name != "head" or DRAFTERS[n].auto_head)})
            for n in names
        }  # fmt: skip
        for sub in self.subs.values():
            sub.lazy_begin = True  # caught up (a draft model prefilled) when first chosen, if ever
            sub.chain_only = True  # the chooser sizes chains
        self.margin = margin
        self.scratch_rows = max(s.scratch_rows for s in self.subs.values())
        self.wants_hidden = any(s.wants_hidden for s in self.subs.values())
        self.feature_layers = tuple(sorted({i for s in self.subs.values() for i in s.feature_layers}))
        self.chooser: MethodChooser | None = None
        self._plan: tuple[str, Hashable, int] | None = None  # this step's (method, situation, k)
        self._proposal: list[int] = []
        self._draft_ms = 0.0
        self._sync_ms = 0.0
        self._length = self._capacity = 0  # committed tokens; the most the sequence can reach

    @property
    def methods(self) -> list[str]:
        return list(self.subs)

    def prepare(self) -> None:
        from ..costs import pass_costs  # (looked up at call time: tests replace it)

        pass_costs(self.target, K_MAX + 1)
        for sub in self.subs.values():
            sub.prepare()

    @classmethod
    def describe(cls, info: dict[str, Any], brief: bool = False) -> list[str]:
        out = super().describe(info, brief)
        if info.get("auto") and not brief:
            steps = info["auto"]["steps"]
            out.append("auto steps: " + "; ".join(f"{name} " + ", ".join(f"{k} {n}" for k, n in ks.items())
                                                 for name, ks in steps.items()))  # fmt: skip
        return out

    def begin(self, session: DraftSession) -> None:
        from ..costs import pass_costs, reproducible  # (looked up at call time: tests replace it)

        self._plan, self._proposal, self._sync_ms = None, [], 0.0
        self._length, self._capacity = len(session.context), session.capacity
        for name, sub in self.subs.items():
            sub.pool = self.pool
            # each drafter its own generator, seeded from the session's: reproducible, independent
            seed = int(torch.randint(0, 2**62, (1,), generator=session.generator))
            sub.begin(DraftSession(session.context, session.capacity, session.sampling,
                                   make_generator(seed, session.generator.device), session.target,
                                   session.target_cache, session.layers))  # fmt: skip
        self.chooser = MethodChooser(self.methods, K_MAX, pass_costs(self.target, K_MAX + 1), margin=self.margin,
                                     draft_ms={n: sub.cost_ms() for n, sub in self.subs.items()},
                                     memory=acceptance_memory(self.target, session.sampling.greedy),
                                     remembered=remembered(self.methods),
                                     reproducible=reproducible(session.sampling))  # fmt: skip

    def end(self) -> None:
        for sub in self.subs.values():
            sub.end()
        self._report()

    def batch_key(self) -> Hashable:
        return ("auto",)

    def propose(self, k: int) -> Draft:
        return self.propose_batch([self], [k])[0]

    def _choose(self, k: int) -> None:
        """Plan this step: the chooser picks from what each drafter could propose now."""
        if self.chooser is None:
            raise RuntimeError("AutoDrafter.propose() called before begin()")
        outlook = {name: o for name, sub in self.subs.items() if (o := outlook_of(sub, k)) is not None}
        method, kk = self.chooser.choose(outlook, remaining=self._capacity - self._length)
        self._plan = (method, outlook[method][0] if method in outlook else None, kk)
        self._proposal, self._draft_ms = [], 0.0

    @classmethod
    def propose_batch(cls, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Draft]:
        """Each sequence's choice; then the chosen drafters propose, those that share a batch
        key together (one draft-model forward per draft step serves every sequence that chose it)."""
        group: list[AutoDrafter] = cls._one_batch(drafters)
        out = [Draft.empty(d.target.device) for d in group]
        by_key: dict[Hashable, list[int]] = {}
        for i, (d, k) in enumerate(zip(group, ks, strict=True)):
            d._choose(k)
            method = d._plan[0]  # type: ignore[index]
            if method == "plain":
                continue
            sub = d.subs[method]
            with timer(d.target.device) as t:
                sub.sync()
            d._sync_ms += 1e3 * t[0]
            key = sub.batch_key()
            by_key.setdefault((method, key if key is not None else ("alone", i)), []).append(i)
        for idx in by_key.values():
            subs = [group[i].subs[group[i]._plan[0]] for i in idx]  # type: ignore[index]
            with timer(group[idx[0]].target.device) as t:
                drafts = type(subs[0]).propose_batch(subs, [group[i]._plan[2] for i in idx])  # type: ignore[index]
            for i, draft in zip(idx, drafts, strict=True):
                d = group[i]
                if draft.parents is not None or draft.extra is not None:
                    raise RuntimeError(f"auto switches between chain drafters; {d._plan[0]} proposed a tree")  # type: ignore[index]
                d._draft_ms = 1e3 * t[0] / len(idx)
                d._proposal = draft.tokens.tolist()
                out[i] = draft
        for d in group:
            d.forwards = sum(sub.forwards for sub in d.subs.values())
        return out

    def accepted(self, feedback: Feedback) -> None:
        assert self.chooser is not None
        method, situation, k = self._plan if self._plan is not None else ("plain", None, 0)
        if method != "plain":
            self.subs[method].accepted(feedback)
            self.chooser.update(method, situation, k, len(self._proposal), feedback.num_accepted, self._draft_ms)
        committed = [self._proposal[j] for j in feedback.path] + [feedback.next_token]
        self._length += len(committed)
        for name, sub in self.subs.items():
            if name != method:
                sub.catch_up(committed, feedback)
        self._plan, self._proposal = None, []

    def _report(self) -> None:
        self.forwards = sum(sub.forwards for sub in self.subs.values())
        if self.chooser is not None:
            report: dict[str, Any] = self.chooser.report()
            report["sync_ms"] = round(self._sync_ms, 3)
            self.info = {"auto": report}
