"""Lookahead decoding (Fu et al. 2024): Jacobi iteration over a window of guesses builds an
n-gram pool; pool n-grams that start with the last committed token are verified as a tree.

Both branches ride in the one target pass of each step (`Draft.extra` carries the lookahead
branch, `Draft.parents` the verification tree; the engine builds the mask):

* Lookahead branch: a 2-D window of W columns and up to N - 1 levels. Column i at level l
  sits at position last + 1 + i + l and attends to level 0's columns 0..i and to its own
  column's levels 1..l, i.e. to one consistent guessed sequence. The target's argmax at each
  top-level row is the next Jacobi guess for its column; once N - 1 levels exist, every
  column yields an n-gram (its N - 1 levels plus that guess), the oldest level is dropped
  and the guesses become the newest level.
* Verification branch: up to G pool n-grams keyed by the last committed token, merged into a
  token tree (shared prefixes scored once), at most k deep.

Exactness does not depend on the guesses: greedy verification walks the tree along the
target's argmax, and sampling uses `verify.tree_point_mass_sample` (drafts are point masses;
each child is accepted with the target's probability after removing rejected siblings), so
the output follows the target's distribution exactly. The window itself is updated with
argmax guesses in both cases.

As in the reference implementation's pool-from-prompt option, the pool also holds the
n-grams of the prompt and of the committed output (`pool_from_context`), so spans the
output copies from its input are proposed too.
"""

from __future__ import annotations

import torch

from .base import Draft, Drafter, DraftSession, ExtraRows, Feedback, Option, register

POOL_PER_KEY = 16  # n-grams remembered per first token (most recent first)


@register(
    "lookahead",
    help="lookahead decoding: Jacobi window + n-gram pool, verified as a token tree",
    options=(
        Option("window", "lookahead: window size W (Jacobi columns)"),
        Option("ngram", "lookahead: n-gram size N (the window has N-1 levels)"),
        Option("guesses", "lookahead: most pool n-grams verified per step (G)"),
    ),
)
class LookaheadDrafter(Drafter):
    def __init__(self, window: int = 1, ngram: int = 3, guesses: int = 2, pool_from_context: bool = True) -> None:
        """`window` W, `ngram` N, `guesses` G as in the paper; a pass scores 1 + W(N-1) + up to
        G(N-1) rows. The defaults are small because rows are dear on a CPU (each row beyond
        the second costs a fraction of a one-token pass in the q4k mode; see docs/precision.md), and
        wider windows lost more than they gained there. Accelerators, where a pass of tens of
        rows costs about one row, want the paper's wider settings (W=15, N=5, G=15 for 7B
        models on an A100)."""
        super().__init__()
        if window < 0 or ngram < 2 or guesses < 1:
            raise ValueError(
                f"lookahead needs window >= 0, ngram >= 2 and guesses >= 1 (got window={window}, "
                f"ngram={ngram}, guesses={guesses})"
            )
        self.W, self.N, self.G = window, ngram, guesses
        self.pool_from_context = pool_from_context
        self.scratch_rows = window * (ngram - 1) + guesses * (ngram - 1)
        self._tokens: list[int] = []
        self._pool: dict[int, list[tuple[int, ...]]] = {}
        self._levels: list[list[int]] = []  # lookahead window, oldest level first
        self._proposal: list[int] = []
        self._rows: list[tuple[int, int]] = []  # (level, column) of each extra row in the last proposal
        self._max_pos = 0
        self._device = torch.device("cpu")

    def begin(self, session: DraftSession) -> None:
        self._device = session.generator.device
        self._max_pos = (
            session.target.args.max_seq_len if session.target is not None else session.capacity + self.W + self.N
        )
        ctx = list(session.context)
        self._tokens, self._pool, self._proposal, self._rows = [], {}, [], []
        self._extend(ctx)
        # level 0 starts as tokens drawn from the context (as the reference implementation does)
        pick = torch.randint(len(ctx), (self.W,), generator=session.generator, device=session.generator.device)
        self._levels = [[ctx[int(i)] for i in pick]] if self.W else []

    def _add(self, gram: tuple[int, ...]) -> None:
        entries = self._pool.setdefault(gram[0], [])
        cont = gram[1:]
        if cont in entries:
            entries.remove(cont)
        entries.insert(0, cont)
        del entries[POOL_PER_KEY:]

    def _extend(self, new: list[int]) -> None:
        """Commit tokens; with `pool_from_context`, pool the n-grams they complete."""
        n = self.N
        for t in new:
            self._tokens.append(t)
            if self.pool_from_context and len(self._tokens) >= n:
                self._add(tuple(self._tokens[-n:]))

    def _tree(self, k: int) -> tuple[list[int], list[int]]:
        """Up to G pool continuations of the last token, cut to k, merged into a trie."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for cont in self._pool.get(self._tokens[-1], [])[: self.G]:
            par = -1
            for tok in cont[:k]:
                node = children.get((par, tok))
                if node is None:
                    node = len(tokens)
                    tokens.append(tok)
                    parents.append(par)
                    children[(par, tok)] = node
                par = node
        return tokens, parents

    def _window_rows(self) -> ExtraRows | None:
        levels = self._levels
        if not levels or len(self._tokens) - 1 + self.W + len(levels) > self._max_pos:
            self._rows = []  # no window (W = 0), or it would run past the model's context
            return None
        rows = [(lvl, i) for lvl in range(len(levels)) for i in range(self.W)]
        index = {rc: r for r, rc in enumerate(rows)}
        mask = torch.zeros(len(rows), len(rows), dtype=torch.bool)
        for r, (lvl, i) in enumerate(rows):
            for j in range(i + 1):
                mask[r, index[(0, j)]] = True  # level 0, columns 0..i
            for m in range(1, lvl + 1):
                mask[r, index[(m, i)]] = True  # own column, levels 1..lvl
        self._rows = rows
        toks = torch.tensor([levels[lvl][i] for lvl, i in rows], dtype=torch.long, device=self._device)
        offsets = torch.tensor([1 + i + lvl for lvl, i in rows], dtype=torch.long, device=self._device)
        return ExtraRows(toks, offsets, mask.to(self._device))

    def propose(self, k: int) -> Draft:
        tokens, parents = self._tree(k) if k > 0 else ([], [])
        self._proposal = tokens
        t = torch.tensor(tokens, dtype=torch.long, device=self._device)
        return Draft(t, None, parents=parents, extra=self._window_rows())

    def _scored_window(self, logits: torch.Tensor) -> None:
        """logits [R, V] of the window rows: the top level's argmaxes are the next guesses."""
        if not self._rows:
            return
        top = len(self._levels) - 1
        guess = logits.argmax(-1).tolist()
        new = [guess[r] for r, (lvl, _) in enumerate(self._rows) if lvl == top]
        if len(self._levels) == self.N - 1:
            for i in range(self.W):  # column i's levels plus its new guess: an n-gram
                self._add(tuple(level[i] for level in self._levels) + (new[i],))
            self._levels = self._levels[1:]
        self._levels.append(new)

    def accepted(self, feedback: Feedback) -> None:
        if feedback.extra_logits is not None:
            self._scored_window(feedback.extra_logits)
        self._extend([self._proposal[j] for j in feedback.path] + [feedback.next_token])
        self._proposal = []
