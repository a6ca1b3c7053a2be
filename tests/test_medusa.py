"""Medusa and Hydra heads: files, Medusa's tree construction, training (learns, reproducible,
the layout drafting reads), greedy identity of the drafters in the exact modes, the sampling
law of their sampled trees (with a negative control), the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ALPHA, PROMPTS, chi2_pvalue, random_heads

import specdec
from specdec import engine
from specdec.config import GenerationConfig, SamplingParams
from specdec.costs import Costs
from specdec.drafters import DraftSession, HydraDrafter, MedusaDrafter, make_drafter
from specdec.networks.medusa import MedusaHeads, greedy_tree
from specdec.networks.vocabulary import attach as attach_target
from specdec.training import features as fe
from specdec.training.loop import TrainConfig, train
from specdec.training.medusa import head_states, heads_loss, topk_accuracy

KINDS = ["medusa", "hydra"]
DRAFTER = {"medusa": MedusaDrafter, "hydra": HydraDrafter}


def _examples(model, n: int, length: int, seed: int, period: int = 5) -> list[fe.Example]:
    """Sequences that repeat a random phrase of `period` tokens (learnable: each token fixes
    the ones after it), with the target's last-layer features."""
    g = torch.Generator().manual_seed(seed)
    last = (model.args.n_layers - 1,)
    out = []
    for _ in range(n):
        phrase = torch.randint(0, min(model.args.vocab_size, 250), (period,), generator=g).tolist()
        ids = (phrase * (length // period + 1))[:length]
        ex = fe.target_features(model, ids, last, 4)
        ex.mask = torch.ones(length, dtype=torch.bool)
        out.append(ex)
    return out


# -- heads and tree ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_head_files_round_trip(tiny, tmp_path, kind):
    model = tiny("llama").model
    heads = random_heads(model, kind, seed=3)
    heads.save(tmp_path, extra={"validation_topk_accuracy": [[0.5, 0.1]] * 3})
    back = attach_target(MedusaHeads.load(tmp_path), model)
    assert back.cfg == heads.cfg and back.record["validation_topk_accuracy"][0] == [0.5, 0.1]
    for (n, p), (_, q) in zip(heads.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.allclose(p.float(), q.float(), atol=1e-3), n  # float16 on disk
    import dataclasses

    wider = MedusaHeads(dataclasses.replace(heads.cfg, hidden_size=2 * heads.cfg.hidden_size))
    with pytest.raises(ValueError, match=f"this {kind} head was trained for 'test'"):
        attach_target(wider, model)
    with pytest.raises(FileNotFoundError, match="specdec train medusa"):
        MedusaHeads.load(tmp_path / "nothing")


def test_greedy_tree_is_medusas_construction():
    acc = [[0.8, 0.1], [0.5, 0.3]]
    paths, probs = greedy_tree(acc, 5)
    # best first: (0) .8, (0,0) .4, (0,1) .24, (1) .1, (1,0) .05
    assert paths == [(0,), (0, 0), (0, 1), (1,), (1, 0)]
    assert probs == pytest.approx([0.8, 0.4, 0.24, 0.1, 0.05])
    for n in range(1, 6):  # every prefix is a tree: parents and better-ranked siblings come first
        kept = set(paths[:n])
        assert all(p[:-1] in kept or len(p) == 1 for p in kept)
        assert all(p[:-1] + (p[-1] - 1,) in kept for p in kept if p[-1] > 0)
    assert greedy_tree(acc, 100)[0] == paths + [(1, 1)]  # every node of depth <= 2, rank <= 2


# -- training --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_training_learns_and_is_reproducible(tiny, tmp_path, kind):
    lm = tiny("llama")
    model, norm = lm.model, lm.model.model.norm
    data = _examples(model, 4, 30, seed=5)
    before = topk_accuracy(random_heads(model, kind, noise=0.0, hydra_inner=64), data, norm, 64, topk=2)
    cfg = TrainConfig(lr=1e-2, warmup=5, seqs_per_step=4, epochs=25, seed=0)
    trained = []
    for run in ("a", "b"):
        heads = random_heads(model, kind, noise=0.0, hydra_inner=64)
        result = train(
            heads,
            data,
            cfg,
            tmp_path / run,
            progress=False,
            name=kind,
            loss=lambda h, ex, f, g: heads_loss(h, ex, norm, 64, f, g),
        )
        trained.append(heads)
    after = topk_accuracy(trained[0], data, norm, 64, topk=2)
    assert result["optimizer_steps"] == 25 and len(result["history"][0]["acc"]) == 3
    assert all(a[0] > b[0] + 0.15 for a, b in zip(after, before, strict=True)), (before, after)
    assert all(0 <= x <= 1 for row in after for x in row) and all(row[0] + row[1] <= 1.0 + 1e-9 for row in after)
    for (n, p), (_, q) in zip(trained[0].named_parameters(), trained[1].named_parameters(), strict=True):
        assert torch.equal(p, q), n  # same seed, same data order: the same heads
    saved = MedusaHeads.load(tmp_path / "a")  # the trainer wrote them where drafting reads them
    assert saved.cfg.kind == kind and saved.record["optimizer_steps"] == 25


def test_loss_counts_only_answer_tokens(tiny):
    model = tiny("llama").model
    ex = _examples(model, 1, 20, seed=1)[0]
    heads = random_heads(model, "hydra")
    ex.mask[:12] = False  # tokens 12..19 are the answer
    _, stats = heads_loss(heads, ex, model.model.norm, 64)
    # head d at anchor t predicts token t + 1 + d: answer tokens 12..19 from anchors 11-d..18-d
    assert [n for _, n in stats] == [8, 8, 8]


@pytest.mark.parametrize("kind", KINDS)
def test_drafting_reads_what_training_trained(tiny, kind):
    """The drafter's chain from a prompt's last position is what the training layout computes
    there (Medusa: each head on h_t; Hydra: each head on the previous state and the token
    guessed before it, starting from the target's own next token)."""
    lm = tiny("llama")
    model = lm.model
    heads = random_heads(model, kind, seed=7, noise=0.5)
    ids = lm.tokenizer.encode(PROMPTS[1])
    ex = fe.target_features(model, ids, (model.args.n_layers - 1,), 4)
    y1 = int(ex.top_ids[-1, 0])  # the target's own next token
    d = DRAFTER[kind](model, head=heads)
    d.begin(
        DraftSession(
            ids + [y1],
            64,
            SamplingParams(),
            torch.Generator(),
            model,
            None,
            {model.args.n_layers - 1: ex.features.float()},
            chain_only=True,
        )
    )
    drafted = d.propose(3).tokens.tolist()
    # the same in the training layout: anchor = the prompt's last position, y = [y1, guesses...]
    seq = fe.Example(
        torch.tensor(ids + [y1] + drafted),
        torch.ones(len(ids) + 4, dtype=torch.bool),
        torch.cat([ex.features, torch.zeros(4, ex.features.shape[1], dtype=ex.features.dtype)]),
        ex.top_ids,
        ex.top_p,
    )
    anchors, states = head_states(heads, seq, model.model.norm, len(ids) + 4)
    t = len(ids) - 1
    expected = [int(heads.draft_ids[heads.logits(z[t]).argmax()]) for z in states]
    assert drafted == expected


# -- drafting: exactness ---------------------------------------------------------------------
def test_cost_model_sizes_the_tree(tiny):
    model = tiny("llama").model
    d = MedusaDrafter(model, head=random_heads(model, "medusa"), max_total=16)
    d.accuracy = [[0.6, 0.3]] * 3
    d.pass_ms = Costs({r: 30.0 + 0.5 * (r - 1) for r in range(1, 18)})  # rows nearly free: a big tree
    big = len(d._shape(3))
    d.pass_ms = Costs({r: 30.0 + 8.0 * (r - 1) for r in range(1, 18)})  # rows dear: the likeliest chain only
    small = d._shape(3)
    assert big >= 8 and 1 <= len(small) <= 3 and all(set(p) == {0} for p in small)
    d.pass_ms = Costs({1: 10.0, 2: 20.0, 17: 170.0})  # a row costs a whole token: no tree pays
    assert d._shape(3) == [] and d.info["tree_tokens_mean"] > 0
    d.total = 4
    assert len(d._shape(3)) == 4  # an explicit size is kept


def _v8_heads(target, kind):
    """Heads over the 8-token vocabulary (accepted 13-31% of the time at the settings tested);
    two tokens they can never draft."""
    return random_heads(target, kind, seed=9, num_heads=2, noise=0.3, hydra_inner=8, vocab_ids=[0, 1, 2, 4, 5, 7])


# -- CLI ----------------------------------------------------------------------------------------
def _jsonl(path, n: int) -> None:
    rows = [
        {
            "id": f"c{i}",
            "category": "chat",
            "turns": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * 3},
            ],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("kind", KINDS)
def test_train_cli_writes_usable_heads(tiny_dir, tmp_path, capsys, kind):
    from specdec.cli import main

    data = tmp_path / "conv.jsonl"
    _jsonl(data, 40)
    out = tmp_path / "heads"
    assert (
        main(
            [
                "train",
                kind,
                "--target",
                str(tiny_dir("llama")),
                "--data",
                str(data),
                "--out",
                str(out),
                "--tokens",
                "1000",
                "--draft-vocab",
                "64",
                "--heads",
                "3",
                "--epochs",
                "2",
                "--seqs-per-step",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "validation top-1 accuracy by head" in capsys.readouterr().err
    rec = MedusaHeads.load(out).record
    assert (
        rec["data"] == str(data)
        and rec["seed"] == 0
        and 1000 <= rec["feature_tokens"] < 1200
        and rec["cpu_seconds"] > 0
    )
    assert f"specdec train {kind}" in rec["command"]
    acc = rec["validation_topk_accuracy"]
    assert len(acc) == 3 and all(len(row) == 8 for row in acc)
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_dir("llama")),
                "--drafter",
                kind,
                "--head",
                str(out),
                "--prompt",
                "What is 3 plus 3?",
                "--max-new-tokens",
                "8",
                "--json",
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["metrics"]["target_forwards"] > 0 and res["metrics"]["drafter_info"]["accuracy"] == "measured"
    other = "hydra" if kind == "medusa" else "medusa"
    model = specdec.load(str(tiny_dir("llama")), dtype="fp32").model
    with pytest.raises(ValueError, match=f"holds {kind} heads; use --drafter {kind}"):
        make_drafter(other, target=model, head=str(out))


def test_heads_drafters_without_heads_say_how_to_get_them(tiny_dir, capsys):
    from specdec.cli import main

    for kind in KINDS:
        assert (
            main(
                [
                    "generate",
                    "--target",
                    str(tiny_dir("llama")),
                    "--drafter",
                    kind,
                    "--prompt",
                    "hi",
                    "--max-new-tokens",
                    "4",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert (
            f"no {kind} head ships for this target" in err and f"specdec train {kind}" in err and "Traceback" not in err
        )


# -- typical acceptance (lossy, opt-in) ----------------------------------------------------------
def test_typical_acceptance_by_hand():
    from specdec.verify import lossy_typical_acceptance

    g = torch.Generator().manual_seed(0)
    confident = torch.tensor([0.90, 0.05, 0.03, 0.02])  # low entropy: threshold min(0.09, 0.3 e^-H) ~ 0.09
    flat = torch.full((4,), 0.25)  # high entropy (ln 4): threshold 0.3 / 4 = 0.075, every token passes
    p = torch.stack([confident, flat, confident, confident])  # rows: root, after node 0, after node 1, after node 2
    # chain 0 -> 1 -> 2: token 0 passes at the root, token 3 passes the flat row, token 1 (0.05) fails
    v = lossy_typical_acceptance(p, [0, 3, 1], None, 0.09, 0.3, g)
    assert v.path == [0, 1]
    # tree: the root's second child (token 1, 0.05) fails; the deepest acceptable path wins
    tree_p = torch.stack([confident, confident, flat, confident])  # the row after node 1 is the flat one
    v = lossy_typical_acceptance(tree_p, [1, 0, 2], [-1, -1, 1], 0.09, 0.3, g)
    assert v.path == [1, 2]  # token 0 at the root, then token 2 (0.25) in the flat row
    v = lossy_typical_acceptance(p, [1, 0, 2], [-1, -1, 1], 0.09, 0.3, g)
    assert v.path == [1]  # after node 1 the target is confident: token 2 (0.03) fails
    v = lossy_typical_acceptance(p, [1], None, 0.09, 0.3, g)
    assert v.path == [] and v.next_token in range(4)
    with pytest.raises(ValueError, match="repeats a sibling"):
        lossy_typical_acceptance(p, [0, 0], [-1, -1], 0.09, 0.3, g)


@pytest.mark.slow
def test_typical_acceptance_is_lossy_and_flagged(small_vocab, exact_joint, sample_joint):
    """Measured, not assumed: with typical acceptance the output law is detectably not the
    target's (so every output says so); the same drafter verified exactly keeps it."""
    target, _ = small_vocab
    lossy = SamplingParams(temperature=1.0, acceptance="typical", epsilon=0.3, delta=0.6)
    heads = _v8_heads(target, "medusa")
    drafter = MedusaDrafter(target, head=heads, total=5)
    counts = sample_joint(
        target, lambda: MedusaDrafter(target, head=heads, total=5), lossy, runs=3000, k=2, bounds=(0.0, 1.0)
    )
    assert chi2_pvalue(counts, exact_joint(target, SamplingParams(temperature=1.0), 4)) <= ALPHA
    out = engine.run(target, [1, 2, 3], GenerationConfig(max_new_tokens=4, k=2, ignore_eos=True), lossy, drafter)
    assert out.metrics.exact is False and out.metrics.to_dict()["exact"] is False
    out = engine.run(
        target,
        [1, 2, 3],
        GenerationConfig(max_new_tokens=4, k=2, ignore_eos=True),
        SamplingParams(temperature=1.0),
        drafter,
    )
    assert out.metrics.exact is True
    with pytest.raises(ValueError, match="typical acceptance is a sampling rule"):
        SamplingParams(acceptance="typical")
    with pytest.raises(ValueError, match="epsilon in"):
        SamplingParams(temperature=1.0, acceptance="typical", epsilon=0.0)


def test_typical_acceptance_on_the_command_line(tiny_dir, capsys):
    from specdec.cli import main

    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_dir("llama")),
                "--drafter",
                "prompt-lookup",
                "--prompt",
                "a b a b a b a b",
                "--max-new-tokens",
                "6",
                "--temperature",
                "0.8",
                "--acceptance",
                "typical",
                "--json",
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    cap = capsys.readouterr()
    res = json.loads(cap.out.strip().splitlines()[-1])
    assert res["exact"] is False and res["metrics"]["exact"] is False and "NOT EXACT" in cap.err
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_dir("llama")),
                "--drafter",
                "prompt-lookup",
                "--prompt",
                "a b",
                "--max-new-tokens",
                "4",
                "--acceptance",
                "typical",
            ]
        )
        == 2
    )  # greedy: refused, one line
    err = capsys.readouterr().err
    assert "typical acceptance is a sampling rule" in err and "Traceback" not in err


# -- export -------------------------------------------------------------------------------------
def test_export_writes_vllms_medusa_layout_and_loads_back(tiny, tmp_path):
    from specdec.training.export import export_medusa as export
    from specdec.training.export import load_medusa as load_exported

    model = tiny("llama").model
    heads = random_heads(model, "medusa", seed=4, noise=0.3)
    out = export(heads, tmp_path / "vllm", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == 1 and cfg["original_lm_head"] is True
    assert cfg["truncated_vocab_size"] == heads.cfg.draft_vocab_size < cfg["vocab_size"] == model.args.vocab_size
    # vLLM's loader renames every config key holding "num" and "heads"/"layers": only its own two may
    assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"]
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert names == {f"blocks.{d}.layers.0.{w}" for d in range(3) for w in ("weight", "bias")} | {
        "lm_head.weight",
        "token_map",
    }
    back = load_exported(out)
    h = torch.randn(5, model.args.dim, generator=torch.Generator().manual_seed(0))
    for d in range(3):  # the same logits, the same draft -> target ids
        assert torch.allclose(back.logits(back.block(d, h)), heads.logits(heads.block(d, h)), atol=1e-4)
    assert torch.equal(back.draft_ids, heads.draft_ids)
    with pytest.raises(ValueError, match="no loader for Hydra"):
        export(random_heads(model, "hydra"), tmp_path / "h")
