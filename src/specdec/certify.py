"""`specdec certify`: a statistical certificate that a method samples what the target samples.

Exactness under sampling is a claim about distributions, so it is checked with samples: N
continuations of a few tokens drawn with plain decoding, N drawn with the method (fixed
prompts, independent seeds), compared by two-sample chi-square tests of homogeneity: for each
prefix length l, the joint law of each prompt's first l tokens (outcomes seen fewer than
`min_count` times in both samples together are pooled into one cell; the per-prompt
statistics and degrees of freedom are summed), Bonferroni-combined over the lengths. The
certificate reports the p-value, the total-variation distance between the two samples over
those cells with a bootstrap upper bound, and what two samples of one law show at this N
(a permutation bound).

It also runs the same test on a deliberately broken verifier (the `broken_*` rules below: each
exact rule with one classic mistake), so the reader sees that the test, at this N and on these
prompts, catches a real error. A certificate whose control passes proves nothing and says so.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .verify import EXACT, Rules, TreeVerdict, Verdict

TREE_TOKENS = 8  # draft tokens per step of the tree drafters (EAGLE-3, Medusa, Hydra) unless --tree-tokens

# Short prompts with repetition in them, so that every drafter (n-grams included) proposes
# tokens and both branches of the rule (accept; reject and recover) run often.
PROMPTS = (
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "one, two, three, four, five, one, two, three, four,",
)


# -- deliberately broken rules: the negative control ---------------------------------------------
def broken_rejection_sample(
    p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor, generator: torch.Generator
) -> Verdict:
    """NOT EXACT, on purpose. The acceptance test is right, but after a rejection the token is
    drawn from p itself instead of norm(max(0, p - q)), so q's mass is counted twice."""
    B, K = draft_tokens.shape
    V = p.shape[-1]
    x = draft_tokens.clamp_max(V - 1)
    u = torch.rand(B, K, generator=generator)
    p_x = p[:, :K].float().gather(-1, x[..., None]).squeeze(-1) * (draft_tokens < V)
    q_x = q.float().gather(-1, draft_tokens[..., None]).squeeze(-1)
    n = (u * q_x < p_x).long().cumprod(-1).sum(-1)
    row = p.float().gather(1, n[:, None, None].expand(B, 1, V)).squeeze(1)
    return Verdict(n, torch.multinomial(row, 1, generator=generator).squeeze(-1))


def broken_point_mass_sample(p: torch.Tensor, draft_tokens: torch.Tensor, generator: torch.Generator) -> Verdict:
    """NOT EXACT, on purpose. After draft x is rejected, the recovered token is drawn from p
    without removing x."""
    B, K = draft_tokens.shape
    V = p.shape[-1]
    u = torch.rand(B, K, generator=generator)
    p_x = p[:, :K].float().gather(-1, draft_tokens.clamp_max(V - 1)[..., None]).squeeze(-1) * (draft_tokens < V)
    n = (u < p_x).long().cumprod(-1).sum(-1)
    row = p.float().gather(1, n[:, None, None].expand(B, 1, V)).squeeze(1)
    return Verdict(n, torch.multinomial(row, 1, generator=generator).squeeze(-1))


def broken_tree_point_mass_sample(
    p: torch.Tensor, tokens: list[int], parents: list[int], generator: torch.Generator
) -> TreeVerdict:
    """NOT EXACT, on purpose. Each child is tried with the target's probability as it was,
    without removing the rejected siblings and renormalising; all rejected: draw from p."""
    V = p.shape[-1]
    path, row = [], 0
    while True:
        moved = False
        for c in [j for j, par in enumerate(parents) if par == row - 1]:
            p_x = float(p[row, tokens[c]]) if tokens[c] < V else 0.0
            if float(torch.rand(1, generator=generator)) < p_x:
                path.append(c)
                row, moved = c + 1, True
                break
        if not moved:
            return TreeVerdict(path, int(torch.multinomial(p[row].float(), 1, generator=generator)))


def broken_tree_rejection_sample(
    p: torch.Tensor, q: torch.Tensor, tokens: list[int], parents: list[int], generator: torch.Generator
) -> TreeVerdict:
    """NOT EXACT, on purpose. After a rejected child the proposal is not updated (the child's
    mass stays in it): the rule for drafts drawn with replacement, used on drafts drawn
    without."""
    V = p.shape[-1]
    kids: dict[int, list[int]] = {}
    for j, par in enumerate(parents):
        kids.setdefault(par + 1, []).append(j)
    path, row = [], 0
    while True:
        r, moved = p[row].float().clone(), False
        children = kids.get(row, [])
        for c in children:
            s, x = q[children[0]].float(), tokens[c]
            r_x, s_x = (float(r[x]), float(s[x])) if x < V else (0.0, 0.0)
            if float(torch.rand(1, generator=generator)) * s_x < r_x:
                path.append(c)
                row, moved = c + 1, True
                break
            r = (r - s[:V]).clamp_min(0)
            r = r / r.sum()
        if not moved:
            return TreeVerdict(path, int(torch.multinomial(r, 1, generator=generator)))


def broken_tree_recovery_sample(
    p: torch.Tensor, q: torch.Tensor, tokens: list[int], parents: list[int], generator: torch.Generator
) -> TreeVerdict:
    """NOT EXACT, on purpose. The children are tested as `tree_rejection_sample` tests them, but
    when every child of a node is rejected the token is drawn from p itself instead of the
    residual r: the chain rule's classic mistake (`broken_rejection_sample`), in a tree. Its
    error grows with the rejection rate, so it shows at the sizes a certificate runs where
    `broken_tree_rejection_sample` (whose error needs a confident draft and a second sibling)
    hardly does."""
    from .verify import _children

    V = p.shape[-1]
    kids = _children(parents, tokens)
    p, q = p.float(), q.float()
    path, row = [], 0
    while True:
        r, moved = p[row].clone(), False
        children = kids.get(row, [])
        s = q[children[0], :V].clone() if children else None
        for c in children:
            x = tokens[c]
            r_x, s_x = (float(r[x]), float(s[x])) if x < V else (0.0, 0.0)
            if float(torch.rand(1, generator=generator)) * s_x < r_x:
                path.append(c)
                row, moved = c + 1, True
                break
            residual = (r - s).clamp_min(0)
            r = residual / residual.sum() if float(residual.sum()) > 0 else r
            if x < V:
                s[x] = 0.0
                s = s / s.sum() if float(s.sum()) > 0 else s
        if not moved:
            return TreeVerdict(path, int(torch.multinomial(p[row], 1, generator=generator)))


def broken_tree_mixed_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: list[int],
    parents: list[int],
    attempts: list[tuple[int, bool]],
    generator: torch.Generator,
) -> TreeVerdict:
    """NOT EXACT, on purpose. `tree_mixed_sample`'s attempts, tested right, but when every
    attempt at a node fails the token is drawn from p itself instead of the residual: the chain
    rule's classic mistake, in a tree that mixes drawn and deterministic drafts."""
    from .verify import _children

    _children(parents, tokens)
    order: dict[int, list[tuple[int, bool]]] = {}
    for j, drawn in attempts:
        order.setdefault(parents[j] + 1, []).append((j, drawn))
    V = p.shape[-1]
    path, row = [], 0
    while True:
        r, moved = p[row].float().clone(), False
        for j, drawn in order.get(row, []):
            x = tokens[j]
            s = q[j, :V].float() if drawn else torch.nn.functional.one_hot(torch.tensor(x), V).float()
            if float(torch.rand(1, generator=generator)) * float(s[x]) < float(r[x]):
                path.append(j)
                row, moved = j + 1, True
                break
            residual = (r - s).clamp_min(0)
            r = residual / residual.sum() if float(residual.sum()) > 0 else r
        if not moved:
            return TreeVerdict(path, int(torch.multinomial(p[row].float(), 1, generator=generator)))


BROKEN_RULES: dict[str, tuple[str, Callable[..., Any]]] = {  # name -> (the `verify.Rules` field, its broken rule)
    "rejection": ("rejection", broken_rejection_sample),
    "point-mass": ("point_mass", broken_point_mass_sample),
    "tree": ("tree_point_mass", broken_tree_point_mass_sample),
    "sampled-tree": ("tree_rejection", broken_tree_recovery_sample),
    "mixed-tree": ("tree_mixed", broken_tree_mixed_sample),
}


def broken_rules(which: Sequence[str] = tuple(BROKEN_RULES)) -> Rules:
    """The exact rules with `which` of them broken (all of them by default, so whichever rule a
    method uses is the broken one): what the control's engine verifies with."""
    return dataclasses.replace(EXACT, **dict(BROKEN_RULES[w] for w in which))


# -- the test ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TwoSample:
    chi2: float  # of the prefix length with the smallest p-value
    dof: int
    p_value: float  # Bonferroni over the prefix lengths: min(1, L * min p_l)
    length: int  # that prefix length
    p_by_length: tuple[float, ...]  # p-value of the first l tokens' joint law, l = 1..L
    tv: float  # total variation between the two samples' whole continuations over the tested cells
    tv_upper: float  # bootstrap 95% upper bound of `tv`
    tv_null: float  # 95th percentile of `tv` for two samples of one law at these sizes (permutation)
    cells: int


def _cells(a: Counter, b: Counter, min_count: int) -> np.ndarray:
    """[2, C] counts: outcomes seen at least `min_count` times in both samples together, and
    one pooled cell for the rest (chosen from the pooled counts, symmetric in a and b)."""
    keys = sorted(set(a) | set(b))
    kept = [k for k in keys if a[k] + b[k] >= min_count]
    table = [[a[k] for k in kept], [b[k] for k in kept]]
    rest = (sum(a.values()) - sum(table[0]), sum(b.values()) - sum(table[1]))
    if rest[0] + rest[1] > 0:
        table[0].append(rest[0])
        table[1].append(rest[1])
    return np.array(table, dtype=np.int64)


def _tv(table: np.ndarray) -> float:
    rows = table / table.sum(1, keepdims=True)
    return 0.5 * float(np.abs(rows[0] - rows[1]).sum())


def _chi2(tables: list[np.ndarray]) -> tuple[float, int, float]:
    """Chi-square homogeneity statistic summed over independent tables, its dof and p-value."""
    from scipy.stats import chi2 as chi2_dist

    stat, dof = 0.0, 0
    for table in tables:
        if table.shape[1] > 1:
            expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
            stat += float(((table - expected) ** 2 / expected).sum())
            dof += table.shape[1] - 1
    return stat, dof, float(chi2_dist.sf(stat, dof)) if dof else 1.0


def _prefixes(c: Counter, n: int) -> Counter:
    out: Counter = Counter()
    for seq, times in c.items():
        out[tuple(seq[:n])] += times
    return out


def two_sample_test(
    a: Sequence[Counter], b: Sequence[Counter], *, min_count: int = 10, resamples: int = 400, seed: int = 0
) -> TwoSample:
    """Chi-square tests that samples `a[i]` and `b[i]` (counts of continuations, one pair per
    prompt) come from one law: one test per prefix length l (the joint law of the first l
    tokens; a verifier's error shows first where it happens, before later tokens spread the
    outcomes over many cells), Bonferroni-combined; with the whole continuations' total
    variation and its bounds."""
    rng = np.random.default_rng(seed)
    longest = max((len(k) for c in (*a, *b) for k in c), default=1)
    by_length = []
    for n in range(1, longest + 1):
        by_length.append(
            _chi2([_cells(_prefixes(ca, n), _prefixes(cb, n), min_count) for ca, cb in zip(a, b, strict=True)])
        )
    best = min(range(longest), key=lambda i: by_length[i][2])
    tables = [_cells(ca, cb, min_count) for ca, cb in zip(a, b, strict=True)]
    tvs, ups, nulls = [], [], []
    for table in tables:
        tvs.append(_tv(table))
        na, nb = table.sum(1)
        pa, pb = table[0] / na, table[1] / nb
        pooled = table.sum(0) / table.sum()
        ups.append([_tv(np.stack([rng.multinomial(na, pa), rng.multinomial(nb, pb)])) for _ in range(resamples)])
        nulls.append(
            [_tv(np.stack([rng.multinomial(na, pooled), rng.multinomial(nb, pooled)])) for _ in range(resamples)]
        )
    stat, dof, _ = by_length[best]
    return TwoSample(
        stat,
        dof,
        min(1.0, longest * by_length[best][2]),
        best + 1,
        tuple(p for _, _, p in by_length),
        float(np.mean(tvs)),
        float(np.quantile(np.mean(ups, 0), 0.95)),
        float(np.quantile(np.mean(nulls, 0), 0.95)),
        sum(t.shape[1] for t in tables),
    )


def _flags(method: str, options: dict[str, Any]) -> list[str]:
    """The drafter options a certificate ran with, as the command-line flags that give them."""
    from .drafters import DRAFTERS

    flags = {o.name: o.cli_flag for o in DRAFTERS[method].options} if method in DRAFTERS else {}
    return [flags.get(name, name) + ("" if value is True else f" {value}") for name, value in sorted(options.items())]


# -- drawing samples -----------------------------------------------------------------------------
@dataclass
class Draws:
    counts: list[Counter]  # per prompt: continuation (token ids) -> times drawn
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


def draw(
    target: Any,
    prompts: Sequence[str],
    n: int,
    *,
    tokens: int,
    first_seed: int,
    batch: int = 32,
    progress: Callable[[int], None] | None = None,
    rules: Rules | None = None,
    **method: Any,
) -> Draws:
    """`n` continuations of `tokens` tokens per prompt, seeds first_seed, first_seed + 1, ...;
    `method`: generate's keywords (temperature, top_p, drafter, assistant_model, k, options);
    `rules`: the sampling rules the engine verifies with (the control's are broken)."""
    from .api import _request_kw, run_requests

    out = Draws([Counter() for _ in prompts])
    start = time.perf_counter()
    seed = first_seed
    for i, prompt in enumerate(prompts):
        for lo in range(0, n, batch):
            m = min(batch, n - lo)
            reqs = [
                _request_kw(
                    target, prompt, {**method, "seed": s, "max_new_tokens": tokens, "ignore_eos": True, "chat": False}
                )
                for s in range(seed, seed + m)
            ]
            results = run_requests(target, reqs, rules)
            seed += m
            for r in results:
                out.counts[i][tuple(r.token_ids)] += 1
                out.proposed += r.metrics.proposed
                out.accepted += r.metrics.accepted
            if progress is not None:
                progress(m)
    out.seconds = time.perf_counter() - start
    return out


@dataclass
class Certificate:
    target: str
    method: str
    draft: str | None
    k: int | None
    temperature: float
    top_p: float
    samples: int
    tokens: int
    prompts: list[str]
    alpha: float
    seed: int
    dtype: str
    test: TwoSample
    control: TwoSample | None
    acceptance: float | None
    control_acceptance: float | None
    seconds: float
    outcomes: int = 0  # distinct continuations seen, all prompts and both arms
    proposed: int = 0  # draft tokens the method offered (0: the rule never ran)
    options: dict[str, Any] = field(default_factory=dict)  # the drafter's, as run (fixed tree size, force)
    cpu: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.test.p_value >= self.alpha

    @property
    def control_caught(self) -> bool | None:
        return None if self.control is None else self.control.p_value < self.alpha

    @property
    def verdict(self) -> str:
        if not self.passed:
            return "FAIL"
        if self.proposed == 0:
            return "INCONCLUSIVE"  # nothing was drafted: the rule never ran
        return "PASS" if self.control_caught in (True, None) else "INCONCLUSIVE"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(passed=self.passed, control_caught=self.control_caught, verdict=self.verdict)
        return d

    def table(self) -> str:
        head = (
            f"certificate: {self.target}, {self.method}"
            + (f" ({self.draft})" if self.draft else "")
            + (f", k={self.k}" if self.k else "")
            + "".join(f", {flag}" for flag in _flags(self.method, self.options))
            + f", T={self.temperature:g}, top-p {self.top_p:g}, "
            f"{len(self.prompts)} prompts x {self.tokens} tokens, N={self.samples} per arm and prompt, "
            f"{self.dtype}, alpha {self.alpha:g}"
        )
        rows = [
            (
                "method vs plain",
                self.test,
                self.acceptance,
                "pass (same law)" if self.passed else "FAIL: the method's outputs differ from plain decoding's",
            )
        ]
        if self.control is not None:
            rows.append(
                (
                    "broken control",
                    self.control,
                    self.control_acceptance,
                    "caught" if self.control_caught else "NOT caught: raise --samples",
                )
            )
        lines = [
            head,
            f"{'':16s} {'p-value':>9s} {'tokens':>6s} {'chi2':>9s} {'dof':>5s} {'TV':>7s} {'TV<=95%':>8s} "
            f"{'accept':>7s}  result",
        ]
        for name, t, acc, result in rows:
            acc_s = "-" if acc is None else f"{acc:.2f}"
            lines.append(
                f"{name:16s} {t.p_value:9.3g} {t.length:6d} {t.chi2:9.1f} {t.dof:5d} {t.tv:7.3f} "
                f"{t.tv_upper:8.3f} {acc_s:>7s}  {result}"
            )
        lines.append(
            "(p-value: the smallest over the first 1..L tokens' joint laws, times L; tokens: that prefix; "
            "TV: whole continuations)"
        )
        lines.append(
            f"two samples of one law show TV <= {self.test.tv_null:.3f} here (95%); "
            f"{self.outcomes} distinct continuations; {self.proposed} draft tokens verified; {self.seconds:.0f} s"
        )
        if self.proposed == 0:
            lines.append("the method drafted nothing on these prompts: its rule never ran (give prompts it drafts on)")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def certify(
    target: Any,
    *,
    method: str,
    assistant_model: Any = None,
    k: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    samples: int = 1000,
    tokens: int = 4,
    prompts: Sequence[str] = PROMPTS,
    alpha: float = 0.01,
    seed: int = 0,
    control: bool = True,
    batch: int = 32,
    options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Certificate:
    """Draw, test and (with `control`) run the broken control; see the module docstring.
    Seeds: plain uses seed, seed + 1, ...; the method seed + 10^7, ...; the control seed + 2 * 10^7, ..."""
    if samples < 20:
        raise ValueError(f"--samples {samples} is too few for a chi-square test; use at least 20 (1000 is usual)")
    if not 0 < alpha < 1:
        raise ValueError(f"--alpha must be in (0, 1), got {alpha}")
    if tokens < 1:
        raise ValueError(f"--tokens must be at least 1, got {tokens}")
    if temperature <= 0:
        raise ValueError(
            "certify compares sampled outputs; greedy identity is checked by `generate --compare` "
            "(use --temperature > 0)"
        )
    started = time.perf_counter()
    common = {"temperature": temperature, "top_p": top_p}
    # Fixed k, no cost controller, no fallback to plain decoding: every step drafts, so the rule
    # is exercised on every step (plain steps are exact trivially and would only thin the test).
    from .drafters import DRAFTERS

    options = dict(options or {})
    own = {o.name for o in DRAFTERS[method].options} if method in DRAFTERS else set()
    if "force" in own:
        options.setdefault("force", True)
    if "total" in own:
        # a fixed tree: sized by the cost model, it depends on the pass times this machine once
        # stored and can be 0 (a plain step) every step, so the rule would never run
        options.setdefault("total", TREE_TOKENS)
    spec: dict[str, Any] = {"drafter": method, "adaptive_k": False, **({"k": k} if k else {}), **options}
    if assistant_model is not None:
        spec["assistant_model"] = assistant_model
    plain = draw(target, prompts, samples, tokens=tokens, first_seed=seed, batch=batch, progress=progress, **common)
    mine = draw(
        target,
        prompts,
        samples,
        tokens=tokens,
        first_seed=seed + 10**7,
        batch=batch,
        progress=progress,
        **common,
        **spec,
    )
    test = two_sample_test(plain.counts, mine.counts, seed=seed)
    ctrl, ctrl_draws = None, None
    if control:
        ctrl_draws = draw(
            target,
            prompts,
            samples,
            tokens=tokens,
            first_seed=seed + 2 * 10**7,
            batch=batch,
            progress=progress,
            rules=broken_rules(),
            **common,
            **spec,
        )
        ctrl = two_sample_test(plain.counts, ctrl_draws.counts, seed=seed + 1)
    outcomes = sum(len(set(a) | set(b)) for a, b in zip(plain.counts, mine.counts, strict=True))
    return Certificate(
        target=getattr(target, "name", str(target)),
        method=method,
        draft=getattr(assistant_model, "name", None),
        k=k,
        temperature=temperature,
        top_p=top_p,
        samples=samples,
        tokens=tokens,
        prompts=list(prompts),
        alpha=alpha,
        seed=seed,
        dtype=target.model.mode,
        test=test,
        control=ctrl,
        acceptance=mine.acceptance,
        control_acceptance=ctrl_draws.acceptance if ctrl_draws else None,
        seconds=time.perf_counter() - started,
        outcomes=outcomes,
        proposed=mine.proposed,
        # as given on a command line; an object (heads passed from Python) by its type, so the
        # certificate stays JSON
        options={n: v if isinstance(v, str | int | float | bool) else type(v).__name__ for n, v in options.items()},
    )
