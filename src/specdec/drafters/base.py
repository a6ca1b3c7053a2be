"""The drafter protocol and the registry of drafters by name.

A drafter's whole life (as in llama.cpp's common/speculative.h), every hook declared here
with its default:

* `begin(session)`: the committed tokens of one sequence (prompt + first token);
* `propose(k) -> Draft`: up to k tokens in a row (a chain, or a token tree);
* `accepted(feedback)`: what the target's pass decided (the accepted path, the target's own
  next token) and what it computed for this sequence (logits; hidden states and chosen layers
  on request), so the drafter can roll its own state back and learn from the target;
* `end(final)`: the sequence is finished (`final`: the pass that finished it) or cancelled;
  release what it holds.

One drafter object serves one sequence. Drafters that can draft for several sequences in one
model call (a draft model) say so with `batch_key` and implement `propose_batch`; the engine
groups them. That is all the engine asks of every drafter. A `Switchable` drafter also offers a
priced proposal before making it and follows tokens it did not propose: auto switches between
those, and the engine sizes one's k step by step with the same chooser.

Each drafter lives in its own module and registers itself with `register`, declaring its
options once: the CLI, the API, `specdec bench` and benchmarks/ build drafters through
`make_drafter`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import torch

from ..adaptive import MARGIN, REPORT, Chooser, Schedule
from ..config import DEFAULT_K, SamplingParams
from ..costs import Pricing
from ..memory import Memory
from ..offers import Estimates

if TYPE_CHECKING:
    from ..offers import Offer


@dataclass
class ExtraRows:
    """Rows a drafter has the target score in the verification pass for its own use (the
    lookahead branch of lookahead decoding). They are never committed, and no draft node
    attends to them."""

    tokens: torch.Tensor  # [R]
    offsets: torch.Tensor  # [R] int64 position of each row relative to the last committed token (>= 1)
    mask: torch.Tensor  # [R, R] bool among the rows, lower-triangular; every row also sees the
    # committed context and the last committed token


@dataclass
class Draft:
    """What a drafter proposes for one verification pass of one sequence.

    A chain (the default): `tokens` continue the last committed token one after another. A
    token tree: `parents[j]` is the index of node j's parent among the draft tokens (-1: the
    last committed token), parents before children, siblings with distinct tokens, best first.
    A tree with `probs` (sampling) has each node's siblings drawn from their parent's draft
    distribution *without replacement*, in the order listed; `probs[j]` is the distribution
    node j was drawn from (the same row for all siblings), and verification uses
    `verify.tree_rejection_sample`. A tree without `probs` is deterministic (point masses).
    """

    tokens: torch.Tensor  # [K] proposed token ids (K may be 0)
    probs: torch.Tensor | None = None  # [K, V] q the tokens were drawn from; None: deterministic (point mass)
    parents: list[int] | None = None  # token tree; None: a chain
    # a tree mixing drafts drawn from q (`probs[node]`) with deterministic ones: each child's
    # attempts in the order they are tried at its parent, (node, drawn?); a node may be tried
    # twice, drawn and fixed (`verify.tree_mixed_sample`). None: the rules above
    attempts: list[tuple[int, bool]] | None = None
    extra: ExtraRows | None = None  # scored in the same pass; logits go to `Feedback.extra_logits`
    # Self-speculation: the drafter already ran blocks [0, from_layer) of the target for the
    # last committed token and every draft token (writing their KV in the target's cache);
    # `hidden` is the residual entering block `from_layer`, and verification runs the rest.
    hidden: torch.Tensor | None = None  # [K+1, D]
    from_layer: int = 0

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.zeros(0, dtype=torch.long, device=device))

    def depths(self) -> list[int]:
        """Each draft node's depth (1: a child of the last committed token); checks that
        parents come before their children."""
        if self.parents is None:
            return list(range(1, int(self.tokens.shape[0]) + 1))
        depths: list[int] = []
        for j, p in enumerate(self.parents):
            if not -1 <= p < j:
                raise ValueError(f"tree node {j} has parent {p}; parents must come before their children (or be -1)")
            depths.append(1 + (depths[p] if p >= 0 else 0))
        return depths

    def depth(self) -> int:
        """Length of the longest root-to-leaf path (K for a chain)."""
        return max(self.depths(), default=0)


@dataclass
class DraftSession:
    """What a drafter is told at `begin`: one sequence."""

    context: list[int]  # all committed tokens (prompt + first generated token)
    capacity: int  # the most tokens the sequence (plus drafts) can reach
    sampling: SamplingParams
    generator: torch.Generator  # the drafter's own, seeded
    target: Any = None  # the target Transformer (drafters that share its weights check it)
    # the sequence's KVCache in the target (self-speculation writes its early blocks' KV there)
    target_cache: Any = None
    # the prompt's residual after each of the drafter's `feature_layers` (the prefill computed
    # them; the first generated token's come with the first Feedback), [T_prompt, D]
    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    # every proposal is exactly the k asked for (`--no-adaptive-k`): a drafter that would stop
    # short of it by its own judgement (a draft model's confidence) does not
    fixed_k: bool = False
    # the deepest a step may draft (the request's k); without `fixed_k`, each step's k within it
    # is chosen step by step (`Drafter.start`); 0: not told (a drafter begun by hand)
    k: int = 0
    # the output the client expects (OpenAI's predicted outputs), tokenized; drafters that
    # draft from it read it (`drafters.prediction`), the others ignore it
    prediction: list[int] | None = None
    # True: propose a chain of exactly the k asked for (a tree drafter drafts its most likely
    # chain): whoever begins it so sized k itself (auto, which switches between chain drafters)
    chain_only: bool = False
    # whose sequence this is: a server gives one pool per API key (one client's outputs never
    # draft for another); "" in a process of one user
    pool: str = ""
    # what its choices are priced by (`costs.Pricing`: the pass table, reproducible or not);
    # None: this machine's measured tables, reproducible as its sampling says
    pricing: Pricing | None = None
    # what earlier requests of its pool taught (`memory.Memory`: acceptance, suffix decoding's
    # store, a draft's calibration), handed in by the engine; by default a fresh one
    memory: Memory = field(default_factory=Memory)
    # what picks each step's offer, made with a margin over plain decoding (`adaptive.Chooser`,
    # or a subclass: a rule of one's own, a test's random switching): auto's over its members,
    # the schedule's over one drafter; None: `adaptive.Chooser`
    chooser: Callable[[float], Chooser] | None = None

    def __post_init__(self) -> None:
        if self.pricing is None:
            self.pricing = Pricing.of(self.target, self.sampling)
        if self.chooser is None:
            self.chooser = Chooser


@dataclass
class Feedback:
    """What one verification pass decided for a sequence and what the target computed for it."""

    path: list[int]  # accepted draft nodes, root first (a chain: 0 .. n-1)
    next_token: int  # the target's own token after them (recovered or bonus)
    logits: torch.Tensor  # [K+1, V] row 0 after the last committed token, row j+1 after draft node j
    extra_logits: torch.Tensor | None = None  # [R, V] the draft's extra rows (`Draft.extra`)
    hidden: torch.Tensor | None = None  # [K+1, D] final-normed hidden states (drafters with `wants_hidden`)
    layers: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # residual after each `feature_layers` layer, [K+1, D]
    kept: int | None = None  # the pass that finished the sequence (given to `end`): how many of
    # `path`'s tokens the output took; None: the sequence goes on
    pass_ms: float | None = None  # what the target's pass took (shared by a batch's sequences)

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def accepted_rows(self) -> list[int]:
        """Rows of `logits`/`hidden`/`layers` on the committed path: the last committed token,
        then each accepted node (their hidden states are what a feature-level drafter reads)."""
        return [0] + [j + 1 for j in self.path]


class Drafter:
    """What the engine asks of every drafter: the four verbs of its life (`begin`, `propose`,
    `accepted`, `end`) and, for drafters that draft for several sequences in one model call,
    `batch_key` and `propose_batch`. Subclasses override `begin` and `propose`, and the others
    where they need them. What only a chooser asks (auto, and the engine sizing k step by
    step) is `Switchable`'s."""

    name: ClassVar[str] = ""
    scratch_rows: int = 0  # most cache slots a pass needs beyond k + 1 (tree branches, extra rows)
    wants_hidden: bool = False  # Feedback.hidden: the target's final-normed hidden states
    feature_layers: tuple[int, ...] = ()  # Feedback.layers: the residual after these target layers
    # the drafter decides itself when drafting pays (auto, a chooser over its members; early
    # exit, by its calibration): the schedule (`adaptive_k`) leaves it alone
    own_schedule: bool = False
    # the chooser over this drafter alone that sizes each step's k (`start`; None: k as asked)
    _schedule: Schedule | None = None

    def __init__(self) -> None:
        self.forwards = 0  # model forward calls made so far (0 for model-free drafters)
        self.info: dict[str, Any] = {}  # what the drafter chose and measured (reported in the metrics)

    def begin(self, session: DraftSession) -> None:
        raise NotImplementedError

    # -- what the engine calls around the verbs: the step's k, chosen where the session leaves
    # it to be (auto over one member: `adaptive.Schedule`, its offer against a plain step) -----
    def start(self, session: DraftSession) -> None:
        """`begin`, with the schedule that sizes each step's k where the session does not fix k
        and the drafter does not decide itself (`own_schedule`): the chooser over this drafter
        alone, its offer (a `Switchable`'s own, else what its steps did) against a plain step."""
        self._schedule = None
        if not session.fixed_k and not self.own_schedule and session.k > 0:
            pricing = session.pricing
            assert pricing is not None
            self._schedule = Schedule(
                self.name,
                self.offer if isinstance(self, Switchable) else None,
                Estimates(
                    pricing.passes(max(session.k + 1 + self.scratch_rows, 2)),
                    session.k,
                    session.memory.acceptance if session.sampling.greedy else None,
                    remembered([self.name]),
                    pricing.reproducible,
                ),
                session.chooser(MARGIN),
            )
        self.begin(session)

    def verified(self, proposed: int, accepted: int, draft_ms: float, rows: int, pass_ms: float | None = None) -> None:
        """The step's pass: `proposed` tokens deep (a tree: its depth), `accepted` kept, its
        drafting ms, the rows of this sequence in the pass and the pass's ms (the schedule learns
        from it; before `accepted` or `end` hear of it)."""
        if self._schedule is not None:
            self._schedule.update(proposed, accepted, draft_ms, rows, pass_ms)

    def finish(self, final: Feedback | None = None) -> None:
        """`end`, then the schedule's report beside the drafter's own (`info[adaptive.REPORT]`)."""
        self.end(final)
        if self._schedule is not None:
            self.info = {**self.info, REPORT: self._schedule.report()}

    def propose(self, k: int) -> Draft:
        raise NotImplementedError

    def plan(self, k: int, remaining: int | None = None, load: tuple[float, float] = (0, 0.0)) -> int:
        """This step's k, at most the budget's `k` (0: a plain step), before any proposal of
        the step; `remaining`: tokens left to generate; `load`: (rows, expected tokens) the rest
        of the batch brings to the same target pass. A drafter that prices its own steps (auto)
        prices them on that pass; the schedule (`start`) chooses within k, else k."""
        if self._schedule is not None:
            return self._schedule.choose(k, remaining, load)
        return k

    def accepted(self, feedback: Feedback) -> None:
        """The verification pass kept `feedback.path` of the last proposal, then `next_token`;
        the sequence goes on (the pass that finishes it comes to `end`)."""

    def end(self, final: Feedback | None = None) -> None:
        """The sequence is finished or cancelled. `final`: the pass that finished it (an end
        token, a stop, the length), of whose `path` the output took the first `final.kept`
        tokens (fewer where a stop came inside it; its path is empty after a plain step); None:
        cancelled, or finished by its first token. Nothing is proposed after it; a drafter
        that counts its accepted tokens completes the count here."""

    def batch_key(self) -> Hashable | None:
        """Drafters with the same key (not None) draft together through `propose_batch`."""
        return None

    def proposer(self) -> str:
        """Who drafted the last proposal (the engine's `Step.by`): this drafter; a chooser
        names the member it picked."""
        return self.name or type(self).__name__

    @classmethod
    def propose_batch(cls, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Draft]:
        """Proposals for several sequences at once (drafters of one `batch_key`)."""
        return [d.propose(k) for d, k in zip(drafters, ks, strict=True)]


D = TypeVar("D", bound=Drafter)


class Switchable(Drafter):
    """A drafter a chooser may switch to and size step by step: `--drafter auto` switches
    between these, and the engine sizes one alone (`adaptive.Schedule`). Four hooks: it offers
    its best proposal before making it (`offer`), follows tokens it did not propose
    (`catch_up`, `sync`) and times once what its first proposal would (`prepare`). Registering
    a subclass makes it one of auto's members."""

    def offer(self, k: int, est: Estimates) -> Offer | None:
        """Its best proposal now within k tokens, priced by this sequence's estimates (a chain
        member: `est.chain` with its situation; one that sizes its own proposals:
        `est.measured`); None: nothing to propose. Valid after `begin`; the proposal that
        follows, if it is picked, is `propose(offer.k)`."""
        raise NotImplementedError

    def catch_up(self, tokens: list[int], feedback: Feedback | None = None) -> None:
        """`tokens` were committed without a proposal of this drafter (another drafter's, or a
        plain step) since its last `begin`/`accepted`: follow them. `feedback`: the pass that
        committed them, whose `layers` carry the target's features of their rows (the
        drafter's `feature_layers`, as with `accepted`)."""
        raise NotImplementedError

    def scope(self) -> str | None:
        """What its acceptance on a target depends on besides the target, the key under which
        earlier requests' measurements are kept on this machine and read as its prior
        (`costs.Pricing.past`): "" for a model-free drafter (the target's text alone), a draft
        model's identity for one that drafts with it; None: not kept (a head, whose training
        run the key would have to name)."""
        spec = DRAFTERS.get(self.name)
        return "" if spec is not None and spec.needs == "" else None

    def sync(self) -> None:
        """Do the work `begin` and `catch_up` deferred (a draft model feeds the tokens it
        missed), so that the next proposal's time measures drafting alone; whoever proposes
        calls it first. Default: nothing to do."""

    def prepare(self) -> None:
        """Do now what this drafter's first proposal would otherwise pay once per process or
        machine (timing its drafting step); a server calls it (`api.prepare`) before it says it
        is ready. Default: nothing."""


@dataclass
class ScoredTree:
    """A token tree best first (parents before children), each node with its estimated chance
    of being accepted: what a `TreeMember` offers."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]


class TreeMember(Switchable):
    """A member whose token tree auto may verify beside another member's chain, in one pass
    (suffix decoding: `AutoDrafter(merge=True)`). Its `offer` is its own tree, sized by its own
    plan; it also gives its whole best-first tree (`tree`) and hears which part went out beside
    a chain (`take`); the feedback of that part then comes to `accepted`, in the tree's
    indices."""

    def tree(self, k: int) -> tuple[Hashable, ScoredTree]:
        """(situation, the best-first tree of depth <= k, each node with its chance): the part
        auto may send beside a chain. Nothing is proposed until `take`."""
        raise NotImplementedError

    def take(self, situation: Hashable, tree: ScoredTree, n: int) -> None:
        """The first n nodes of `tree` went to the target as this member's proposal."""
        raise NotImplementedError


def prepare(drafter: Drafter | None) -> None:
    """`prepare` where the drafter has it (a member of auto, auto itself); the others time
    nothing of their own."""
    prep = getattr(drafter, "prepare", None)
    if prep is not None:
        prep()


def one_batch(cls: type[D], drafters: Sequence[Drafter]) -> list[D]:
    """`drafters` as a list of `cls`, checked to share one batch key (what a `propose_batch`
    override may assume)."""
    if not drafters or any(not isinstance(d, cls) for d in drafters) or len({d.batch_key() for d in drafters}) > 1:
        raise ValueError(f"{cls.__name__}.propose_batch takes {cls.__name__} objects of one batch key")
    return list(drafters)  # type: ignore[arg-type]


def describe(method: str | None, info: dict[str, Any], brief: bool = False) -> list[str]:
    """Phrases for the line of figures a front end prints after a run, from a drafter's `info`
    (what it chose for itself); `brief`: only what must be seen even beside a JSON object that
    carries `info` whole: that the request ran as plain decoding, the registered drafter's own
    (`register(describe=...)`), and what a prediction gave."""
    out = [info["fallback"]] if info.get("fallback") else []
    spec = DRAFTERS.get(method) if method is not None else None
    if spec is not None and spec.describe is not None:
        out += spec.describe(info, brief)
    if info.get("prediction") and not brief:
        p = info["prediction"]
        out.append(f"prediction tokens {p['accepted_tokens']} accepted, {p['rejected_tokens']} rejected")
    return out


# -- registry ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One option of a drafter: its keyword in the drafter's constructor (where the default
    lives), its command-line flag and help."""

    name: str
    help: str
    flag: str = ""  # default: --name-with-dashes
    type: Callable[[str], Any] | None = None  # command-line type (default: that of the default, else int)

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


Needs = Literal["", "draft", "target", "any"]


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    cls: type[Drafter]
    needs: Needs  # "draft": built from a second model; "target": from the target model; "": model-free;
    # "any": from the target and, where given, a draft model (auto)
    options: tuple[Option, ...]
    help: str
    head: str | None = None  # the kind of trained head it loads (`drafters.heads`); None: needs none
    auto_head: bool = False  # auto's --auto-head is this drafter's head (and asks auto to include it)
    default_k: int | None = None  # k when none is given or tuned (a tree drafter that sizes itself: its deepest
    # draft); None: config.DEFAULT_K
    # its own phrases for the line a front end prints after a run, from its `info` (see `describe`)
    describe: Callable[[dict[str, Any], bool], list[str]] | None = None
    # the class it is built as with a draft of another tokenizer, `cls(draft, bridge, **options)`
    # (`register_across`); None: it needs the target's tokenizer
    across: type[Drafter] | None = None

    @property
    def switchable(self) -> bool:
        """Auto may switch to it step by step (a `Switchable`)."""
        return issubclass(self.cls, Switchable)

    def defaults(self) -> dict[str, Any]:
        sig = inspect.signature(self.cls.__init__)
        return {o.name: sig.parameters[o.name].default for o in self.options}


DRAFTERS: dict[str, DrafterSpec] = {}


def draft_model_method() -> str:
    """The registered drafter built from a draft model alone: what an assistant model (--draft)
    drafts with when no drafter is named."""
    return next(name for name, spec in DRAFTERS.items() if spec.needs == "draft")


def needs_draft_model(name: str | None) -> bool:
    """Whether the drafter registered as `name` cannot run without a draft model."""
    spec = DRAFTERS.get(name) if name is not None else None
    return spec is not None and spec.needs == "draft"


def uses_draft_model(name: str | None) -> bool:
    """Whether the drafter registered as `name` takes a draft model (draft-model; auto, where
    one is given)."""
    spec = DRAFTERS.get(name) if name is not None else None
    return spec is not None and spec.needs in ("draft", "any")


def register(
    name: str,
    *,
    help: str,
    needs: Needs = "",
    options: tuple[Option, ...] = (),
    head: str | None = None,
    auto_head: bool = False,
    default_k: int | None = None,
    describe: Callable[[dict[str, Any], bool], list[str]] | None = None,
) -> Callable[[type], type]:
    """Add a drafter class to the registry under `name`: what it needs built (`needs`), its
    options (defaults from its constructor), the trained head it loads (`head`), its k when
    none is given (`default_k`), its phrases after a run (`describe`). A `Switchable` class
    is one auto may switch to."""

    def deco(cls: type) -> type:
        if name in DRAFTERS:
            raise ValueError(f"drafter {name!r} registered twice")
        params = inspect.signature(cls.__init__).parameters
        for o in options:
            if o.name not in params or params[o.name].default is inspect.Parameter.empty:
                raise TypeError(f"{cls.__name__} declares option {o.name!r} without a default in __init__")
        if issubclass(cls, Switchable) and cls.catch_up is Switchable.catch_up:
            raise TypeError(f"{cls.__name__} is Switchable but does not implement catch_up")
        DRAFTERS[name] = DrafterSpec(name, cls, needs, options, help, head, auto_head, default_k, describe)
        cls.name = name
        return cls

    return deco


def register_across(name: str) -> Callable[[type], type]:
    """The registered drafter `name` is built as this class where the draft's tokenizer is not
    the target's (`make_drafter(bridge=...)`)."""

    def deco(cls: type) -> type:
        DRAFTERS[name] = replace(DRAFTERS[name], across=cls)
        return cls

    return deco


def make_drafter(
    name: str,
    *,
    target: Any = None,
    draft: Any = None,
    bridge: Any = None,
    left_out: dict[str, str] | None = None,
    **options: Any,
) -> Drafter:
    """Build a registered drafter. `target`/`draft`: the target's and the draft's Transformer
    (a drafter takes the one it needs); `bridge`: where the draft's tokenizer is not the
    target's, the pair's `cross.Bridge`; `left_out`: for a drafter over members (auto), those
    that could not be built, with why; `options`: the drafter's declared options (None = its
    default)."""
    spec = DRAFTERS.get(name)
    if spec is None:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(sorted(DRAFTERS))}")
    known = {o.name for o in spec.options}
    unknown = [k for k, v in options.items() if k not in known and v is not None]
    if unknown:
        raise ValueError(
            f"the {name} drafter has no option {unknown[0]!r}"
            + (f"; its options: {', '.join(sorted(known))}" if known else " (it takes none)")
        )
    kwargs = {k: v for k, v in options.items() if v is not None}
    if spec.needs == "any":
        if target is None:
            raise ValueError(f"the {name} drafter needs the target model")
        given = {"bridge": bridge, "left_out": left_out}
        return spec.cls(target, draft, **kwargs, **{k: v for k, v in given.items() if v is not None})
    if spec.needs == "draft":
        if draft is None:
            raise ValueError(f"the {name} drafter needs a draft model (--draft NAME, or assistant_model=)")
        if bridge is not None:
            if spec.across is None:
                raise ValueError(f"the {name} drafter needs a draft model of the target's tokenizer")
            return spec.across(draft, bridge, **kwargs)
        return spec.cls(draft, **kwargs)
    if draft is not None:
        raise ValueError(f"the {name} drafter uses no draft model; drop the draft (--draft) or use draft-model")
    if spec.needs == "target":
        if target is None:
            raise ValueError(f"the {name} drafter needs the target model")
        return spec.cls(target, **kwargs)
    return spec.cls(**kwargs)


def point_mass(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q for a deterministic draft: one-hot rows. tokens [K] -> [K, V]."""
    return torch.nn.functional.one_hot(tokens, vocab_size).float()


def resolve_k(k: int | None, *, target: str, method: str | None, draft: str | None, mode: str) -> tuple[int, str]:
    """(k, where it came from): "given", "tuned" (stored by `specdec bench --tune` for this
    target, method, draft and mode) or "default" (the method's own, `DrafterSpec.default_k`,
    else DEFAULT_K)."""
    if k is not None:
        return k, "given"
    if method is not None:
        from ..tuning import lookup

        tuned = lookup(target, method, draft, mode)
        if tuned is not None:
            return tuned, "tuned"
    return method_default_k(method), "default"


def method_default_k(method: str | None) -> int:
    """The k a method runs with when none is given or tuned: its own (`DrafterSpec.default_k`:
    a tree drafter's deepest draft), else DEFAULT_K."""
    spec = DRAFTERS.get(method) if method is not None else None
    return spec.default_k if spec is not None and spec.default_k is not None else DEFAULT_K


def remembered(methods: list[str]) -> frozenset[str]:
    """The drafters among `methods` whose acceptance a pool's memory keeps across requests
    (`memory.Memory`): the model-free ones (what they propose depends on the target's text
    alone)."""
    return frozenset(m for m in methods if m in DRAFTERS and DRAFTERS[m].needs == "")
