"""The verifiers on random inputs (hypothesis, derandomized: the same examples every run):
zeros in p or q, tiny values, one-hot rows, chains of up to 16 drafts, random trees. Whatever
the input, a verifier returns a path of accepted drafts that the target could have produced
(no accepted token the target gives probability 0), a next token the target gives positive
probability after that path, and the greedy rules follow the argmax exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from specdec.verify import (
    greedy_verify,
    lossy_typical_acceptance,
    point_mass_sample,
    rejection_sample,
    tree_greedy_verify,
    tree_point_mass_sample,
    tree_rejection_sample,
)

FUZZ = settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def distribution(draw, V: int) -> torch.Tensor:
    """A probability row over V tokens: random weights with zeros, tiny values or one-hot."""
    kind = draw(st.sampled_from(["mixed", "one-hot", "tiny"]))
    if kind == "one-hot":
        row = torch.zeros(V, dtype=torch.float64)
        row[draw(st.integers(0, V - 1))] = 1.0
        return row
    w = draw(st.lists(st.sampled_from([0.0, 1e-30, 1e-8, 0.01, 0.3, 1.0, 5.0]), min_size=V, max_size=V))
    row = torch.tensor(w, dtype=torch.float64)
    if kind == "tiny":
        row = row * 1e-6
    assume(float(row.sum()) > 0)
    return row / row.sum()


@st.composite
def chain_case(draw):
    V = draw(st.integers(2, 12))
    K = draw(st.integers(0, 16))
    p = torch.stack([draw(distribution(V)) for _ in range(K + 1)]).float()  # [K+1, V]
    q = torch.stack([draw(distribution(V)) for _ in range(K)]).float() if K else torch.zeros(0, V)
    tokens = torch.tensor([draw(st.integers(0, V - 1)) for _ in range(K)], dtype=torch.long)
    return p, q, tokens, draw(st.integers(0, 2**31 - 1))


@st.composite
def tree_case(draw):
    V = draw(st.integers(2, 10))
    K = draw(st.integers(1, 16))
    parents: list[int] = []
    tokens: list[int] = []
    for j in range(K):
        par = draw(st.integers(-1, j - 1))
        used = {tokens[c] for c in range(j) if parents[c] == par}
        free = [t for t in range(V) if t not in used]
        assume(free)
        parents.append(par)
        tokens.append(draw(st.sampled_from(free)))
    p = torch.stack([draw(distribution(V)) for _ in range(K + 1)]).float()  # row 0, then after each node
    q = torch.stack([draw(distribution(V)) for _ in range(K)]).float()
    return p, q, tokens, parents, draw(st.integers(0, 2**31 - 1))


def _check_path(path: list[int], parents: list[int]) -> None:
    prev = -1
    for node in path:
        assert parents[node] == prev, (path, parents)
        prev = node


@FUZZ
@given(chain_case())
@pytest.mark.slow
def test_chain_rules_return_what_the_target_could_produce(case):
    p, q, tokens, seed = case
    K = tokens.numel()
    g = torch.Generator().manual_seed(seed)
    for verdict in (
        rejection_sample(p[None], q[None], tokens[None], g) if K else None,
        point_mass_sample(p[None], tokens[None], g),
    ):
        if verdict is None:
            continue
        n, nxt = int(verdict.num_accepted[0]), int(verdict.next_token[0])
        assert 0 <= n <= K
        assert all(float(p[i, tokens[i]]) > 0 for i in range(n))  # never accepts what p rules out
        assert float(p[n, nxt]) > 0
    logits = torch.where(p > 0, p.log(), torch.full_like(p, -1e9))
    v = greedy_verify(logits[None], tokens[None])
    n = int(v.num_accepted[0])
    argmax = logits.argmax(-1)
    assert torch.equal(tokens[:n], argmax[:n]) and (n == K or int(tokens[n]) != int(argmax[n]))
    assert int(v.next_token[0]) == int(argmax[n])


@FUZZ
@given(tree_case())
@pytest.mark.slow
def test_tree_rules_return_what_the_target_could_produce(case):
    p, q, tokens, parents, seed = case
    g = torch.Generator().manual_seed(seed)
    exact = [tree_rejection_sample(p, q, tokens, parents, g), tree_point_mass_sample(p, tokens, parents, g)]
    for tv in exact:
        _check_path(tv.path, parents)
        rows = [0] + [j + 1 for j in tv.path]
        assert all(float(p[rows[i], tokens[j]]) > 0 for i, j in enumerate(tv.path))
        assert float(p[rows[-1], tv.next_token]) > 0
    lossy = lossy_typical_acceptance(p, tokens, parents, 0.09, 0.3, g)
    _check_path(lossy.path, parents)  # a valid path (it is lossy, not arbitrary)
    assert float(p[([0] + [j + 1 for j in lossy.path])[-1], lossy.next_token]) > 0
    tv = tree_greedy_verify(p.log(), tokens, parents)  # the argmax walked down the tree
    _check_path(tv.path, parents)
    row = 0
    for node in tv.path:
        assert tokens[node] == int(p[row].argmax())
        row = node + 1
    assert tv.next_token == int(p[row].argmax())
    assert not any(tokens[c] == tv.next_token for c in range(len(tokens)) if parents[c] == row - 1)


# -- the GGUF reader on damaged files ------------------------------------------------------------
_GGUF: dict[str, bytes] = {}


def _small_gguf(tmp: str) -> bytes:
    """A valid one-tensor GGUF file's bytes (written once)."""
    if "base" not in _GGUF:
        from helpers import write_gguf

        _GGUF["base"] = write_gguf(Path(tmp) / "base.gguf", "llama", 16, block_count=1).read_bytes()
    return _GGUF["base"]


@settings(
    max_examples=300, derandomize=True, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    flips=st.lists(st.tuples(st.integers(0, 199), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(8, 10_000)),
)
def test_damaged_gguf_headers_get_one_clear_error(tmp_path_factory, flips, cut):
    """Bytes of the header, key-value table and tensor table flipped, the file cut short: the
    reader says it cannot use the file (UnsupportedArchitectureError, one line) or reads it;
    nothing else escapes, and nothing hangs (2 s per file at most)."""
    from specdec import store

    tmp = tmp_path_factory.getbasetemp()
    data = bytearray(_small_gguf(str(tmp)))
    for pos, value in flips:
        data[pos % len(data)] = value
    if cut is not None:
        data = data[: min(cut, len(data))]
    path = tmp / "damaged.gguf"
    path.write_bytes(bytes(data))
    try:
        store.gguf_architecture(path)
    except store.UnsupportedArchitectureError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
