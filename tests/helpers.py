"""Helpers shared by the tests: statistics of the exactness tests, shared inputs, small builders."""

from __future__ import annotations

import random
import re
import socket
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import uvicorn
from scipy.stats import chisquare

from specdec.adaptive import Chooser
from specdec.costs import Costs
from specdec.drafters import Draft, DraftModelDrafter, Feedback
from specdec.networks.eagle3 import Eagle3Head, HeadConfig, config_for_target
from specdec.networks.vocabulary import attach as attach_target
from specdec.sampling import probs

ALPHA = 1e-3  # significance level of every statistical test; all runs are seeded


def chi2_pvalue(
    counts: dict[tuple, int] | np.ndarray, expected_probs: dict[tuple, float] | np.ndarray, min_expected: float = 5.0
) -> float:
    """Pearson chi-square p-value of observed counts against exact probabilities. Cells with
    expected count < `min_expected` are pooled into one cell. An outcome with probability 0
    that was observed makes the p-value 0."""
    if isinstance(expected_probs, dict):
        keys = sorted(set(expected_probs) | set(counts))
        obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
        prob = np.array([expected_probs.get(k, 0.0) for k in keys], dtype=float)
    else:
        obs, prob = np.asarray(counts, dtype=float), np.asarray(expected_probs, dtype=float)
    if obs[prob <= 0].sum() > 0:
        return 0.0
    n = obs.sum()
    prob = prob / prob.sum()
    exp = prob * n
    small = exp < min_expected
    obs_cells = np.append(obs[~small], obs[small].sum())
    exp_cells = np.append(exp[~small], exp[small].sum())
    if exp_cells[-1] == 0:
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    return float(chisquare(obs_cells, exp_cells).pvalue)


# -- shared inputs ---------------------------------------------------------------------------
PROMPTS = [
    "The cat sat on the mat. The cat sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "aaaaaaaaaaaaaaaaaaaaaaaa",
    "Q: 17 * 23 = ?\nA:",
    "x",
    "Speculative decoding proposes several tokens and verifies them in one pass.",
]
V_SMALL = 8  # vocabulary of the statistical tests' models: every joint outcome can be enumerated
PROMPT_IDS = [1, 2, 3]
# lookahead's window W, n-gram size N and guesses G in its identity tests (tiny models, SmolLM2)
LOOKAHEAD_CONFIGS = [
    dict(window=2, ngram=3, guesses=2),
    dict(window=4, ngram=4, guesses=3),
    dict(window=0, ngram=2, guesses=2),
]


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str


def run_cli(capsys, *args: str) -> CliRun:
    """`specdec ARGS` run in this process (`specdec.cli.main`) with its streams captured: the exit
    code and output a shell would see, without starting an interpreter and torch per case."""
    from specdec.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own errors; the status the interpreter would exit with
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    out = capsys.readouterr()
    return CliRun(code, out.out, out.err)


def fb(path: list[int] | int, next_token: int, extra_logits=None):
    """A drafter's feedback for a unit test: accepted `path` (or the first n of a chain)."""
    nodes = list(range(path)) if isinstance(path, int) else list(path)
    return Feedback(nodes, next_token, torch.zeros(len(nodes) + 1, 1), extra_logits)


def verify_vs_decode(model, prompt_len: int, k: int, seed: int = 0):
    """Logits of one k-token pass and of k one-token passes over the same random prefix."""
    ids = torch.randint(
        0, min(model.args.vocab_size, 250), (1, prompt_len + k), generator=torch.Generator().manual_seed(seed)
    )
    cache = model.new_cache(prompt_len + k)
    model(ids[:, :prompt_len], cache)
    together = model(ids[:, prompt_len:], cache).logits
    cache.truncate(prompt_len)
    alone = torch.cat([model(ids[:, i : i + 1], cache).logits for i in range(prompt_len, prompt_len + k)], 1)
    return together, alone


# a target pass: 30 ms for one row, +6 ms per extra row (the q4k 1.5B here, roughly)
PASS = Costs({r: 30.0 + 6.0 * (r - 1) for r in range(1, 10)})


def no_timing(monkeypatch) -> None:
    """Every model's pass costs are `PASS`: the controllers decide without timing anything."""
    from specdec import costs

    monkeypatch.setattr(costs, "pass_costs", lambda target, max_rows: PASS)
    monkeypatch.setattr(costs, "draft_step_ms", lambda model, key, step, reset: PASS.target(1))


class Forced(Chooser):
    """A chooser whose pick is `rule(offers, plain)` (a test's), logged as such: handed to a
    request (`chooser=`), it replaces the rule of `adaptive.Chooser` for auto and the schedule."""

    def __init__(self, rule, margin: float = 1.03) -> None:
        super().__init__(margin)
        self.rule = rule

    def choose(self, offers, plain, remaining=None):
        pick = self.rule(offers, plain)
        self.log.append({"offers": [], "pick": pick.row(), "why": "forced"})
        return pick


def always_draft(margin: float) -> Chooser:
    """`chooser=`: every step drafts, with the deepest k the drafter's offer allows (a draft
    model sizes its proposals itself); a plain step only where nothing is offered."""
    return Forced(
        lambda offers, plain: replace(offers[0], k=max(offers[0].k, offers[0].most)) if offers else plain, margin
    )


class Switching:
    """`chooser=`: every step a seeded random offer (or a plain step), a chain at a random k
    within what its member could offer (suffix decoding's own tree, where it offers one, as
    offered); `picks` holds them, as they are made, over every sequence it chose for."""

    def __init__(self, seed: int) -> None:
        self.rng, self.picks = random.Random(seed), []

    def pick(self, offers, plain):
        options = [plain] + [
            o if o.tree is not None else replace(o, k=self.rng.randint(1, max(o.k, o.most))) for o in offers
        ]
        pick = self.rng.choice(options)
        self.picks.append((pick.member, pick.k))
        return pick

    def __call__(self, margin: float) -> Chooser:
        return Forced(self.pick, margin)


# -- EAGLE-3 heads ---------------------------------------------------------------------------
def random_head(
    model, seed: int = 0, draft_vocab: int | None = None, scale: float = 1.0, model_dir=None, width: int = 32
) -> Eagle3Head:
    """A seeded random head for `model` (draft vocabulary: every other token, or the first n)."""
    V = model.args.vocab_size
    cfg = config_for_target(model, "test", draft_vocab_size=draft_vocab or V // 2, intermediate_size=width)
    head = Eagle3Head(cfg)
    head.init_weights(torch.Generator().manual_seed(seed))
    if scale != 1.0:
        with torch.no_grad():
            for p in head.parameters():
                if p.dim() == 2:
                    p.mul_(scale)
    ids = torch.arange(cfg.draft_vocab_size) * (V // cfg.draft_vocab_size)
    head.set_vocab(ids)
    attach_target(head, model, model_dir)
    return head


def small_head(target) -> Eagle3Head:
    """A peaked random head for the `small_vocab` target (the statistical tests)."""
    cfg = HeadConfig(
        "v8",
        V_SMALL,
        target.args.dim,
        target.args.n_heads,
        target.args.n_kv_heads,
        target.args.head_dim,
        16,
        6,
        HeadConfig.default_feature_layers(target.args.n_layers),
        target.args.norm_eps,
        target.args.rope_theta,
        target.args.max_seq_len,
    )
    head = Eagle3Head(cfg)
    head.init_weights(torch.Generator().manual_seed(9))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(40.0)  # a peaked draft distribution, as a trained head has
    head.set_vocab(torch.tensor([0, 1, 2, 4, 5, 7]))  # two tokens the head can never draft
    return attach_target(head, target)


# -- Medusa / Hydra heads --------------------------------------------------------------------
def random_heads(
    model,
    kind: str = "medusa",
    seed: int = 0,
    num_heads: int = 3,
    noise: float = 0.02,
    draft_vocab: int | None = None,
    hydra_inner: int = 16,
    vocab_ids=None,
    model_dir=None,
):
    """Seeded heads for `model`: Medusa's initialisation (each head starts as the target's own
    LM head) plus `noise` on every weight; draft vocabulary every other token, or `vocab_ids`."""
    from specdec.networks.medusa import MedusaHeads
    from specdec.networks.medusa import config_for_target as heads_config
    from specdec.networks.vocabulary import attach as attach_heads

    V = model.args.vocab_size
    n = len(vocab_ids) if vocab_ids is not None else draft_vocab or V // 2
    heads = MedusaHeads(
        heads_config(model, "test", kind, num_heads=num_heads, draft_vocab_size=n, hydra_inner=hydra_inner)
    )
    g = torch.Generator().manual_seed(seed)
    heads.init_weights(g)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    heads.set_vocab(torch.as_tensor(vocab_ids) if vocab_ids is not None else torch.arange(n) * (V // n))
    return attach_heads(heads, model, model_dir)


def write_gguf(path, arch: str, size: int, block_count: int | None = None):
    """A small valid GGUF file: one float32 [size, size] embedding tensor of architecture `arch`."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    if block_count is not None:
        w.add_uint32(f"{arch}.block_count", block_count)
    w.add_tensor("token_embd.weight", np.zeros((size, size), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class WholeDraftQ(DraftModelDrafter):
    """Negative control of a draft that reads less than the whole model or context (a cut
    vocabulary, a window): draws as configured, but tells the verifier the q of the whole
    draft model over the whole context, not the q the drafts were drawn from."""

    @classmethod
    def propose_batch(cls, drafters, ks):
        drafts = super().propose_batch(drafters, ks)
        out = []
        for d, draft in zip(drafters, drafts, strict=True):
            if draft.probs is None or not len(draft.tokens):
                out.append(draft)
                continue
            ctx = d._tokens + draft.tokens.tolist()
            base = len(d._tokens)
            logits = d.model(torch.tensor([ctx]), d.model.new_cache(len(ctx))).logits[0]  # [T, V]
            q = torch.stack([probs(logits[base - 1 + j], d.session.sampling) for j in range(len(draft.tokens))])
            out.append(Draft(draft.tokens, q))
        return out


def drop_entries_under(table: Path, root: str) -> int:
    """Remove from a measurement table (JSON, keyed by strings that name a model directory) the
    entries of models under `root`; returns how many went."""
    import json

    from specdec.paths import write_json

    try:
        entries = json.loads(table.read_text())
    except (OSError, json.JSONDecodeError):
        return 0
    if not isinstance(entries, dict):
        return 0
    kept = {k: v for k, v in entries.items() if root not in k}
    if len(kept) < len(entries):
        write_json(table, kept)
    return len(entries) - len(kept)


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it has started (an event to wait on, not a flag to poll)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


class Running:
    """A uvicorn server for an app, in a thread, on a free port."""

    def __init__(self, app, graceful_s: float | None = None) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=graceful_s)
        self.server = _Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        if not self.server.ready.wait(120):
            raise RuntimeError("the server did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def assert_bench_page(path: Path, *shown: str) -> None:
    """A benchmark's page (`bench serve`/`batch`/`trace`): its table (holding `shown`) and its plot
    in one file, nothing to fetch from elsewhere."""
    page = path.read_text()
    table = re.search(r"<pre><code>(.*?)</code></pre>", page, re.S)
    assert table and all(s in table.group(1) for s in ("tok/s", *shown)), page[:2000]
    assert page.count('src="data:image/png;base64,') == 1 and not re.search(r'(src|href)="(https?:)?//', page)
