"""Verification rules: pure functions of target/draft distributions and the draft tokens.

Vocabulary (as in vLLM): of the K drafted tokens, the first `num_accepted` are *accepted*;
then the target adds one token: the *recovered* token (drawn after a rejection) or, when all
K pass, the *bonus* token (drawn from the target's distribution after the last draft).
Every step therefore yields between 1 and K + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .sampling import sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: torch.Tensor  # [B] int64, in [0, K]
    next_token: torch.Tensor  # [B] int64: recovered or bonus token


def greedy_verify(
    target_logits: torch.Tensor,  # [B, K+1, V]: logits after the last committed token and each draft
    draft_tokens: torch.Tensor,  # [B, K]
) -> Verdict:
    """Accept the longest prefix on which the draft equals the target's argmax, then add the
    target's own argmax at the first mismatch (or after the last draft)."""
    target_choice = target_logits.argmax(-1)  # [B, K+1]
    K = draft_tokens.shape[1]
    match = (draft_tokens == target_choice[:, :K]).long()  # [B, K]
    num_accepted = match.cumprod(-1).sum(-1)  # [B]
    next_token = target_choice.gather(1, num_accepted[:, None]).squeeze(1)
    return Verdict(num_accepted, next_token)


def rejection_sample(
    p: torch.Tensor,  # [B, K+1, V] target probabilities (temperature/top-k/top-p applied)
    q: torch.Tensor,  # [B, K, V] draft probabilities the drafts were sampled from (same processing)
    draft_tokens: torch.Tensor,  # [B, K]
    generator: torch.Generator,
) -> Verdict:
    """Exact speculative sampling (Leviathan et al. 2022, Alg. 1; Chen et al. 2023).

    Draft x̃_i is accepted with probability min(1, p_i(x̃_i) / q_i(x̃_i)); at the first rejection
    the recovered token is drawn from norm(max(0, p_i - q_i)); if all K pass, the bonus token
    is drawn from p_{K+1}. The output is distributed exactly as p, whatever q is.
    A point-mass q (one-hot, for deterministic drafters) reduces to: accept with p(x̃), else
    draw from p with x̃ removed.
    """
    B, K = draft_tokens.shape
    V = p.shape[-1]
    p, q = p.float(), q.float()
    u = torch.rand(B, K, generator=generator, device=p.device)  # [B, K]
    q_x = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    # A draft vocabulary may be larger than the target's (padding rows): p is 0 there.
    in_vocab = draft_tokens < V
    p_x = p[:, :K].gather(-1, draft_tokens.clamp_max(V - 1)[..., None]).squeeze(-1) * in_vocab  # [B, K]
    q = q[..., :V]
    if q.shape[-1] < V:
        q = torch.nn.functional.pad(q, (0, V - q.shape[-1]))
    # u < p/q without dividing: q = 0 < p accepts (ratio infinite), p = 0 always rejects.
    accept = (u * q_x < p_x).long()
    num_accepted = accept.cumprod(-1).sum(-1)  # [B]
    # Residual max(0, p - q) at the first rejected position; with q padded by a zero row at
    # position K it is simply p_{K+1} for the bonus token.
    q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # [B, K+1, V]
    idx = num_accepted[:, None, None].expand(B, 1, V)
    residual = (p.gather(1, idx) - q_pad.gather(1, idx)).clamp_min(0).squeeze(1)  # [B, V]
    mass = residual.sum(-1, keepdim=True)
    # A rejection implies p(x̃) < q(x̃), hence some y with p(y) > q(y): mass > 0. Guard rounding.
    residual = torch.where(mass > 0, residual, p.gather(1, idx).squeeze(1))
    next_token = sample(residual, generator)
    return Verdict(num_accepted, next_token)


def point_mass_sample(
    p: torch.Tensor,  # [B, K+1, V] target probabilities (temperature/top-k/top-p applied)
    draft_tokens: torch.Tensor,  # [B, K] from a deterministic drafter (n-gram lookup, lookahead)
    generator: torch.Generator,
) -> Verdict:
    """Exact speculative sampling for drafts without probabilities: q is a point mass on x̃.

    The general rule with q = δ(x̃) reduces to: accept x̃_i with probability p_i(x̃_i); at the
    first rejection draw the recovered token from p_i with x̃_i removed and renormalised
    (= norm(max(0, p_i - δ(x̃_i)))); if all K pass, draw the bonus token from p_{K+1}. The
    output is distributed exactly as p. Same random draws, in the same order, as
    `rejection_sample` with a one-hot q, without building the [B, K, V] one-hot tensor.
    """
    B, K = draft_tokens.shape
    V = p.shape[-1]
    p = p.float()
    u = torch.rand(B, K, generator=generator, device=p.device)  # [B, K]
    in_vocab = draft_tokens < V
    x = draft_tokens.clamp_max(V - 1)
    p_x = p[:, :K].gather(-1, x[..., None]).squeeze(-1) * in_vocab  # [B, K]
    accept = (u < p_x).long()
    num_accepted = accept.cumprod(-1).sum(-1)  # [B]
    p_next = p.gather(1, num_accepted[:, None, None].expand(B, 1, V)).squeeze(1)  # [B, V]
    residual = p_next
    if K:
        # remove the rejected draft token (after all K pass, the bonus comes from p itself)
        pos = num_accepted.clamp_max(K - 1)[:, None]  # [B, 1]
        tok = x.gather(1, pos)  # [B, 1]
        remove = (num_accepted < K)[:, None] & in_vocab.gather(1, pos)
        residual = p_next.scatter(1, tok, torch.where(remove, 0.0, p_next.gather(1, tok)))
    mass = residual.sum(-1, keepdim=True)
    # A rejection implies p(x̃) < 1, hence mass elsewhere. Guard rounding.
    residual = torch.where(mass > 0, residual, p_next)
    next_token = sample(residual, generator)
    return Verdict(num_accepted, next_token)


# -- token trees (batch of one) ----------------------------------------------------------
@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted draft nodes, root first (each the child of the one before)
    next_token: int  # recovered or bonus token after the last accepted node


def _children(parents: list[int], tokens: list[int]) -> dict[int, list[int]]:
    """Row -> child nodes in the order given (row 0 is the last committed token, row j + 1 is
    draft node j). Checks the tree: parents before children, distinct sibling tokens."""
    kids: dict[int, list[int]] = {}
    for j, par in enumerate(parents):
        if not -1 <= par < j:
            raise ValueError(f"tree node {j} has parent {par}; parents must come before their children (or be -1)")
        siblings = kids.setdefault(par + 1, [])
        if any(tokens[c] == tokens[j] for c in siblings):
            raise ValueError(f"tree node {j} repeats a sibling's token {tokens[j]}; merge equal siblings")
        siblings.append(j)
    return kids


def tree_greedy_verify(
    target_logits: torch.Tensor,  # [K+1, V]: row 0 after the last committed token, row j+1 after node j
    tokens: list[int],  # [K] draft node tokens
    parents: list[int],  # [K] parent node index, -1 = the last committed token
) -> TreeVerdict:
    """Walk down the tree while some child equals the target's argmax; the argmax at the node
    where the walk stops is the next token. Same output as greedy decoding."""
    kids = _children(parents, tokens)
    choice = target_logits.argmax(-1).tolist()  # [K+1]
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in kids.get(row, []) if tokens[c] == choice[row]), None)
        if nxt is None:
            return TreeVerdict(path, int(choice[row]))
        path.append(nxt)
        row = nxt + 1


def tree_point_mass_sample(
    p: torch.Tensor,  # [K+1, V] target probabilities (temperature/top-k/top-p applied)
    tokens: list[int],  # [K] deterministic draft node tokens
    parents: list[int],  # [K]
    generator: torch.Generator,
) -> TreeVerdict:
    """Exact sampling over a tree of deterministic drafts (point masses; SpecInfer-style
    recursive rejection). At a node, its children x_1, x_2, ... are tried in order: x_i is
    accepted with probability r(x_i), where r is the target's p there with the already
    rejected siblings removed and renormalised; each rejection removes x_i from r. Accepting
    moves down to x_i; if every child is rejected the next token is drawn from r. Each step
    draws exactly from p: P(x_1) = p(x_1), P(x_2) = (1 - p(x_1)) p(x_2) / (1 - p(x_1)), ...
    With one child per node this is `point_mass_sample`."""
    kids = _children(parents, tokens)
    p = p.float()
    V = p.shape[-1]
    path: list[int] = []
    row = 0
    while True:
        r = p[row].clone()
        moved = False
        for c in kids.get(row, []):
            x = tokens[c]
            mass = float(r.sum())
            u = float(torch.rand(1, generator=generator, device=p.device))
            p_x = float(r[x]) if x < V else 0.0
            if mass > 0 and u * mass < p_x:  # u < r(x) / sum(r), without dividing
                path.append(c)
                row, moved = c + 1, True
                break
            if x < V:
                r[x] = 0.0
        if not moved:
            if float(r.sum()) <= 0:  # rounding: every token was tried and removed
                r = p[row]
            return TreeVerdict(path, int(sample(r, generator)))


def tree_rejection_sample(
    p: torch.Tensor,  # [K+1, V] target probabilities (temperature/top-k/top-p applied)
    q: torch.Tensor,  # [K, V] row j: the draft distribution node j was drawn from (the same processing)
    tokens: list[int],  # [K] draft node tokens
    parents: list[int],  # [K]
    generator: torch.Generator,
) -> TreeVerdict:
    """Exact sampling over a token tree whose siblings were drawn from the draft distribution
    q *without replacement*, in the order listed (recursive rejection sampling: SpecInfer's
    multi-draft rule; Jeon et al. 2024 for drafts without replacement).

    At a node, with r = p there and s = q there: child x_i is accepted with probability
    min(1, r(x_i) / s(x_i)); on rejection r <- norm(max(0, r - s)) and x_i is removed from s
    (s <- norm(s without x_i), the law the next sibling was drawn from). Accepting moves down
    to x_i; when every child is rejected the next token is drawn from r; below the last
    accepted leaf the bonus token comes from p. The output is distributed exactly as p. With
    one child per node this is `rejection_sample`."""
    kids = _children(parents, tokens)
    p, q = p.float(), q.float()
    V = p.shape[-1]
    path: list[int] = []
    row = 0
    while True:
        children = kids.get(row, [])
        r = p[row].clone()
        moved = False
        if children:
            s = q[children[0], :V].clone()
            for c in children:
                x = tokens[c]
                u = float(torch.rand(1, generator=generator, device=p.device))
                r_x, s_x = (float(r[x]), float(s[x])) if x < V else (0.0, 0.0)
                if u * s_x < r_x:  # u < r/s without dividing: s = 0 < r accepts, r = 0 rejects
                    path.append(c)
                    row, moved = c + 1, True
                    break
                residual = (r - s).clamp_min(0)
                mass = float(residual.sum())
                # a rejection implies r(x) < s(x), hence mass elsewhere; guard rounding
                r = residual / mass if mass > 0 else r
                if x < V:
                    s[x] = 0.0
                    total = float(s.sum())
                    s = s / total if total > 0 else s
        if not moved:
            return TreeVerdict(path, int(sample(r, generator)))


def tree_mixed_sample(
    p: torch.Tensor,  # [K+1, V] target probabilities (temperature/top-k/top-p applied)
    q: torch.Tensor,  # [K, V] row j: the law node j's sampled attempt was drawn from (other rows unused)
    tokens: list[int],  # [K] draft node tokens
    parents: list[int],  # [K]
    attempts: list[tuple[int, bool]],  # (node, drawn from q[node]?) in the order they are tried at their parent
    generator: torch.Generator,
) -> TreeVerdict:
    """Exact sampling over a token tree whose children mix drafts drawn from a draft model's q
    with deterministic ones (prompt lookup, suffix decoding: point masses): recursive rejection
    sampling over each node's *attempts*, in order. With r = p at the node, an attempt of token
    x with proposal law s (q's row, or the point mass on x) is accepted with probability
    min(1, r(x) / s(x)); on rejection r <- norm(max(0, r - s)) (for a point mass: x removed
    from r). Accepting moves down to x's node; when every attempt fails the next token is drawn
    from r. The output is distributed exactly as p.

    Why: write R_i = (P(reaching attempt i)) * r_i. Attempt i outputs y with probability
    min(R_i(y), M_i s_i(y)) (M_i = P(reaching it)), and R_{i+1} = max(0, R_i - M_i s_i), so the
    outputs of all attempts plus the final draw sum to R_0 - R_n + R_n = p (telescoping). This
    needs each attempt's token drawn from its s independently of the others' draws and of the
    verification's: a deterministic attempt is fixed by the context, a sampled one is the draft
    model's own draw. Hence two attempts may name one node (the draft model drew the token a
    deterministic drafter proposed too): both are tried, in order, and neither may be dropped
    for the other — which siblings are tried must not depend on what the draft model drew."""
    _children(parents, tokens)  # checks the tree
    K = len(tokens)
    seen: set[tuple[int, bool]] = set()
    order: dict[int, list[tuple[int, bool]]] = {}
    for j, sampled in attempts:
        if not 0 <= j < K or (j, sampled) in seen:
            raise ValueError(
                f"attempt ({j}, {sampled}) names no node or repeats one; each node is tried at most "
                "once as drawn and once as fixed"
            )
        seen.add((j, sampled))
        order.setdefault(parents[j] + 1, []).append((j, sampled))
    if {j for j, _ in attempts} != set(range(K)):
        raise ValueError("every draft node needs an attempt (a node no attempt names can never be reached)")
    p, q = p.float(), q.float()
    V = p.shape[-1]
    path: list[int] = []
    row = 0
    while True:
        r = p[row].clone()
        moved = False
        for j, sampled in order.get(row, []):
            x = tokens[j]
            u = float(torch.rand(1, generator=generator, device=p.device))
            r_x = float(r[x]) if x < V else 0.0
            if sampled:
                s = q[j, :V]
                s_x = float(s[x]) if x < V else 0.0
                accept = u * s_x < r_x  # u < r/s without dividing: s = 0 < r accepts, r = 0 rejects
                residual = (r - s).clamp_min(0) if not accept else r
            else:
                accept = u < r_x
                residual = r.clone()
                if not accept and x < V:
                    residual[x] = 0.0
            if accept:
                path.append(j)
                row, moved = j + 1, True
                break
            mass = float(residual.sum())
            # a rejection implies mass elsewhere; guard rounding
            r = residual / mass if mass > 0 else r
        if not moved:
            return TreeVerdict(path, int(sample(r, generator)))


def lossy_typical_acceptance(
    p: torch.Tensor,  # [K+1, V] target probabilities (temperature/top-k/top-p applied)
    tokens: list[int],  # [K] draft node tokens
    parents: list[int] | None,  # [K] token tree; None: a chain
    epsilon: float,
    delta: float,
    generator: torch.Generator,
) -> TreeVerdict:
    """NOT EXACT: Medusa's typical acceptance (Cai et al. 2024, §2.3.1), a lossy criterion
    that trades the target's distribution for longer accepted drafts. A draft token x is
    acceptable where the target gives it p(x) > min(epsilon, delta * exp(-H(p))), H the
    entropy of p there (a confident target accepts only its likely tokens, an uncertain one
    accepts more); the accepted path is the longest root-to-node path of acceptable tokens
    (the first listed among equally long ones), and the next token is drawn from p after it.
    The output is *not* distributed as the target's p; specdec runs it only when asked for
    (`--acceptance typical`) and flags every such output as not exact."""
    K = len(tokens)
    parents = parents if parents is not None else list(range(-1, K - 1))
    _children(parents, tokens)  # checks the tree
    p = p.float()
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    entropy = -(p * logp).sum(-1)  # [K+1]
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    depth = [0] * K
    ok = [False] * K
    for j, par in enumerate(parents):
        row = par + 1
        ok[j] = (par < 0 or ok[par]) and tokens[j] < p.shape[-1] and float(p[row, tokens[j]]) > float(threshold[row])
        depth[j] = 1 + (depth[par] if par >= 0 else 0)
    best = max((j for j in range(K) if ok[j]), key=lambda j: (depth[j], -j), default=None)
    path: list[int] = []
    j = best
    while j is not None and j >= 0:
        path.append(j)
        j = parents[j] if parents[j] >= 0 else None
    path.reverse()
    row = path[-1] + 1 if path else 0
    return TreeVerdict(path, int(sample(p[row], generator)))


@dataclass(frozen=True)
class Rules:
    """The sampling rules an engine verifies with (greedy verification has no alternative).
    `EXACT` is every engine's; `specdec certify` and the tests hand an engine a deliberately
    broken set as the negative control their statistics must catch."""

    rejection: Callable[..., Any] = rejection_sample  # a chain with draft probabilities q
    point_mass: Callable[..., Any] = point_mass_sample  # a chain of deterministic drafts
    tree_point_mass: Callable[..., Any] = tree_point_mass_sample  # a tree of deterministic drafts
    tree_rejection: Callable[..., Any] = tree_rejection_sample  # a tree whose siblings were drawn from q
    tree_mixed: Callable[..., Any] = tree_mixed_sample  # a tree mixing drafts drawn from q with fixed ones


EXACT = Rules()
