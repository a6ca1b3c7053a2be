"""EAGLE-3 heads: the head and its files, training (training-time test layout = drafting),
greedy identity of the drafter in the exact modes, the sampling law of its sampled trees
(with a negative control), the recipe and its CLI, DDP under torchrun."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import EXACT_MODES
from helpers import PROMPTS, random_head

import specdec
from specdec import engine
from specdec.config import GenerationConfig, SamplingParams
from specdec.drafters import Eagle3Drafter, make_drafter
from specdec.drafters.eagle3 import _Runner
from specdec.networks.eagle3 import Eagle3Head, HeadConfig, config_for_target
from specdec.networks.vocabulary import attach as attach_target
from specdec.training import features as fe
from specdec.training.loop import TrainConfig, evaluate, sequence_loss, train, unroll


def _examples(model, n: int, length: int, seed: int) -> list[fe.Example]:
    g = torch.Generator().manual_seed(seed)
    layers = HeadConfig.default_feature_layers(model.args.n_layers)
    out = []
    for _ in range(n):
        ids = torch.randint(0, min(model.args.vocab_size, 250), (length,), generator=g).tolist()
        ex = fe.target_features(model, ids, layers, 4)
        ex.mask = torch.ones(length, dtype=torch.bool)
        out.append(ex)
    return out


# -- the head ---------------------------------------------------------------------------------
def test_vocabulary_maps_follow_the_eagle3_format(tiny):
    model = tiny("llama").model
    head = random_head(model)
    ids = torch.tensor([7, 3, 250, 11] + list(range(20, 20 + head.cfg.draft_vocab_size - 4)))
    head.set_vocab(ids)
    want = ids.sort().values
    assert torch.equal(head.draft_ids, want)  # draft id j -> target id j + d2t[j], increasing
    assert torch.equal(head.d2t, want - torch.arange(want.numel()))
    assert head.t2d.sum() == want.numel() and bool(head.t2d[want].all())
    with pytest.raises(ValueError, match="distinct"):
        head.set_vocab(torch.zeros(head.cfg.draft_vocab_size, dtype=torch.long))


def test_head_files_round_trip(tiny, tmp_path):
    lm = tiny("llama")
    head = random_head(lm.model, seed=3)
    head.save(tmp_path / "h", extra={"seed": 3})
    back = attach_target(Eagle3Head.load(tmp_path / "h"), lm.model, lm.path)
    assert back.cfg == head.cfg and Eagle3Head.training_record(tmp_path / "h") == {"seed": 3}
    ex = _examples(lm.model, 1, 12, seed=0)[0]
    for a, b in zip(unroll(head, ex.tokens, ex.features, 2), unroll(back, ex.tokens, ex.features, 2), strict=True):
        # weights are stored as float16: the same head to float16 precision
        assert torch.allclose(head.logits(a), back.logits(b), atol=2e-3)
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
    with pytest.raises(FileNotFoundError, match="not an EAGLE-3 head"):
        Eagle3Head.load(tmp_path)


def test_a_head_refuses_another_target(tiny):
    import dataclasses

    head = random_head(tiny("llama").model)
    wider = Eagle3Head(dataclasses.replace(head.cfg, hidden_size=2 * head.cfg.hidden_size))
    with pytest.raises(ValueError, match="trained for"):
        attach_target(wider, tiny("llama").model)


# -- training -----------------------------------------------------------------------------------
def test_training_layout_is_what_drafting_computes(tiny):
    """The training-time test's unrolled steps (all anchors at once, step-1 keys causal plus
    each anchor's own chain) give, for an anchor i, exactly what the drafter computes: the
    committed rows 0..i through the head's cache, then a chain of draft rows."""
    model = tiny("llama").model
    head = random_head(model, seed=1, scale=20.0)
    ex = _examples(model, 1, 24, seed=2)[0]
    steps = 3
    gs = unroll(head, ex.tokens, ex.features, steps)
    run = _Runner(head, model)  # (an fp32 target: the head runs on its own float weights)
    c = head.cfg
    for i in (0, 5, 17):
        kc = torch.zeros(c.num_key_value_heads, 32, c.head_dim)
        vc = torch.zeros_like(kc)
        pos = torch.arange(i + 1)
        g, logits = run.step(
            head.embed(ex.tokens[1 : i + 2]),
            run.project(ex.features[: i + 1]),
            pos,
            kc,
            vc,
            pos,
            torch.ones(i + 1, i + 1, dtype=torch.bool).tril(),
        )
        assert torch.allclose(g[-1], gs[0][i], atol=1e-4)
        # catching up computes the last row alone (every row's keys and values still cached)
        kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
        g1, logits1 = run.step(
            head.embed(ex.tokens[1 : i + 2]),
            run.project(ex.features[: i + 1]),
            pos,
            kc2,
            vc2,
            pos,
            torch.ones(i + 1, i + 1, dtype=torch.bool).tril(),
            last_only=True,
        )
        assert g1.shape[0] == 1 and torch.allclose(g1[0], g[-1], atol=1e-5) and torch.equal(kc2, kc)
        assert torch.allclose(logits1[0], logits[-1], atol=1e-4) and torch.equal(vc2, vc)
        prev = g[-1]
        for j in range(2, steps + 1):
            slot = i + j - 1
            mask = torch.ones(1, slot + 1, dtype=torch.bool)
            g, _ = run.step(
                head.embed(ex.tokens[i + j : i + j + 1]),
                prev[None],
                torch.tensor([i + j - 1]),
                kc,
                vc,
                torch.tensor([slot]),
                mask,
            )
            assert torch.allclose(g[0], gs[j - 1][i], atol=1e-4), (i, j)
            prev = g[0]


@pytest.mark.slow
def test_training_learns_and_is_reproducible(tiny, tmp_path):
    lm = tiny("llama")
    model = lm.model
    data = _examples(model, 12, 32, seed=5)
    before = evaluate(random_head(model, seed=0, width=128), data, 2, 64)
    cfg = TrainConfig(steps=2, lr=3e-3, warmup=5, seqs_per_step=4, epochs=20, seed=0)
    heads = []
    for run in ("a", "b"):
        head = random_head(model, seed=0, width=128)
        result = train(head, data, cfg, tmp_path / run, progress=False)
        heads.append(head)
    after = evaluate(heads[0], data, 2, 64)
    assert result["optimizer_steps"] == 20 * (12 // 4) and result["world_size"] == 1
    assert all(a > b + 0.2 for a, b in zip(after, before, strict=True)), (before, after)
    hist = json.loads((tmp_path / "a" / "history.json").read_text())
    assert hist[-1]["loss"] < 0.7 * hist[0]["loss"]
    assert (tmp_path / "a" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the learning curve
    for (n, p), (_, q) in zip(heads[0].named_parameters(), heads[1].named_parameters(), strict=True):
        assert torch.equal(p, q), n  # same seed, same data order: the same head


def test_training_resumes_from_its_checkpoint(tiny, tmp_path):
    model = tiny("llama").model
    data = _examples(model, 8, 30, seed=6)
    full = random_head(model)
    train(full, data, TrainConfig(steps=2, seqs_per_step=2, epochs=2, seed=1), tmp_path / "full", progress=False)
    part = random_head(model)
    # stop after about half the steps (a budget of 0 minutes stops after the first step)
    r = train(
        part,
        data,
        TrainConfig(steps=2, seqs_per_step=2, epochs=2, seed=1, minutes=0.0),
        tmp_path / "part",
        progress=False,
    )
    assert r["optimizer_steps"] == 1 and (tmp_path / "part" / "checkpoint.pt").exists()
    resumed = random_head(model)
    r = train(resumed, data, TrainConfig(steps=2, seqs_per_step=2, epochs=2, seed=1), tmp_path / "part", progress=False)
    assert r["optimizer_steps"] == 8 and not (tmp_path / "part" / "checkpoint.pt").exists()
    for (n, p), (_, q) in zip(full.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), n


def test_loss_counts_only_answer_tokens(tiny):
    model = tiny("llama").model
    head = random_head(model)
    ex = _examples(model, 1, 20, seed=7)[0]
    ex.mask = torch.zeros(20, dtype=torch.bool)
    loss, stats = sequence_loss(head, ex, 2, 64)
    assert float(loss.detach()) == 0.0 and all(m == 0 for _, m in stats)
    ex.mask[2:] = True
    _, stats = sequence_loss(head, ex, 2, 64)
    # step j counts anchors i >= 0 whose predicted token i+j+1 is an answer's: tokens 2..19 for
    # step 1 (anchors 0..17); step 2 cannot predict token 2 (it would need anchor -1)
    assert [m for _, m in stats] == [18, 17]


@pytest.mark.slow
def test_conversation_mask_marks_the_answers(smollm2):
    messages = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello there, friend."},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Hello again."},
    ]
    ids, mask = fe.tokenize_conversation(smollm2.tokenizer, messages, 512)
    # each answer with the end-of-turn marker the template closes it with (the head learns to end)
    answer = smollm2.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert answer == "Hello there, friend.<|im_end|>\nHello again.<|im_end|>\n"
    prompt = smollm2.tokenizer.encode_chat(messages[:1])  # what inference feeds the target
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    short, _ = fe.tokenize_conversation(smollm2.tokenizer, messages, 10)
    assert short == ids[:10]


def test_self_distillation_keeps_the_generating_passes_features(smollm2_exact):
    """Self-distilled examples: the answers are the target's greedy continuations, and the
    features and distributions kept from the batched generating passes are bitwise those of
    one prefill over the finished sequence (batch-invariant mode); only answers are masked."""
    lm = smollm2_exact
    layers = HeadConfig.default_feature_layers(lm.model.args.n_layers)
    convs = [[{"role": "user", "content": t}] for t in PROMPTS[:3]]
    exs = list(fe.self_distill_examples(lm, convs, layers=layers, top_k=4, max_len=256, max_new_tokens=12, batch=2))
    assert len(exs) == 3
    for conv, ex in zip(convs, exs, strict=True):
        P = len(lm.tokenizer.encode_chat(conv))
        L = int(ex.tokens.numel())
        assert ex.tokens[:P].tolist() == lm.tokenizer.encode_chat(conv) and 2 <= L - P <= 12
        assert ex.mask.tolist() == [False] * P + [True] * (L - P)
        ref = fe.target_features(lm.model, ex.tokens.tolist(), layers, 4)
        assert torch.equal(ex.features[: L - 1], ref.features[: L - 1])
        assert torch.equal(ex.top_ids[P - 1 : L - 1], ref.top_ids[P - 1 : L - 1])
        assert ex.tokens[P:].tolist() == ref.top_ids[P - 1 : L - 1, 0].tolist()  # greedy


def test_draft_vocabulary_prefers_what_the_target_predicts(tiny):
    model = tiny("llama").model
    ex = _examples(model, 3, 30, seed=8)
    vocab = fe.draft_vocabulary(ex, 5, model.args.vocab_size)
    counts = torch.bincount(torch.cat([e.top_ids[:-1, 0] for e in ex]), minlength=model.args.vocab_size)
    assert set(vocab.tolist()) <= set(counts.argsort(descending=True)[:8].tolist())
    assert counts[vocab].min() >= counts.sort(descending=True).values[4]


# -- drafting -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_greedy_identity_with_a_trained_head_on_smollm2(smollm2_exact, tmp_path):
    lm = smollm2_exact
    model = lm.model
    layers = HeadConfig.default_feature_layers(model.args.n_layers)
    texts = [p * 3 for p in PROMPTS]
    data = []
    for t in texts:
        ex = fe.target_features(model, lm.tokenizer.encode(t), layers, 4)
        ex.mask = torch.ones(ex.tokens.numel(), dtype=torch.bool)
        data.append(ex)
    cfg = config_for_target(model, "smollm2-135m", draft_vocab_size=2048, intermediate_size=64)
    head = Eagle3Head(cfg)
    head.init_weights(torch.Generator().manual_seed(0))
    head.set_vocab(fe.draft_vocabulary(data, 2048, model.args.vocab_size))
    attach_target(head, model, lm.path)
    train(head, data, TrainConfig(steps=2, lr=2e-3, warmup=2, seqs_per_step=2, epochs=15), tmp_path, progress=False)
    gen = GenerationConfig(max_new_tokens=40, k=4, ignore_eos=True, adaptive_k=False)
    accepted = proposed = 0
    for p in PROMPTS:
        ids = lm.tokenizer.encode(p * 2)
        plain = engine.run(model, ids, gen, SamplingParams())
        drafter = make_drafter("eagle3", target=model, head=str(tmp_path), total=24)
        out = engine.run(model, ids, gen, SamplingParams(), drafter)
        assert out.token_ids == plain.token_ids, p
        accepted, proposed = accepted + out.metrics.accepted, proposed + out.metrics.target_forwards
    assert accepted / proposed > 0.5  # trained on these texts: it drafts them well


def test_tree_shapes(tiny):
    lm = tiny("llama")
    head = random_head(lm.model, seed=4, scale=20.0)
    ids = lm.tokenizer.encode(PROMPTS[1])
    for sampling, opts, most in (
        (SamplingParams(), {"topk": 3, "total": 7}, 7),
        (SamplingParams(temperature=1.0, seed=1), {"sample_children": 2, "sample_frontier": 2}, 2 + 3 * 4),
    ):
        d = Eagle3Drafter(lm.model, head=head, **opts)
        seen = []
        orig = d.propose

        def spy(k, orig=orig, seen=seen):
            draft = orig(k)
            seen.append(draft)
            return draft

        d.propose = spy
        engine.run(
            lm.model, ids, GenerationConfig(max_new_tokens=12, k=4, ignore_eos=True, adaptive_k=False), sampling, d
        )
        assert seen
        for draft in seen:
            depths = draft.depths()  # checks parents come first
            assert max(depths) <= 4 and draft.tokens.numel() <= most
            kids: dict[int, list[int]] = {}
            for j, p in enumerate(draft.parents):
                kids.setdefault(p, []).append(int(draft.tokens[j]))
            assert all(len(set(v)) == len(v) for v in kids.values())  # siblings distinct
            assert bool(head.t2d[draft.tokens].all())  # only draft-vocabulary tokens
            if not sampling.greedy:
                assert all(len(v) <= 2 for v in kids.values())
                assert torch.allclose(draft.probs.sum(-1), torch.ones(draft.tokens.numel()))


def test_cost_model_sizes_trees_by_the_price_of_rows(tiny):
    """Free rows: send every candidate worth anything; dear rows: only the likeliest."""
    from specdec.costs import Costs

    model = tiny("llama").model
    d = Eagle3Drafter(model, head=random_head(model), max_total=20)
    d._sizes, d._step_ms = [], 1.0
    scores = [math.log(p) for p in (0.9, 0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005)]
    d.run.pass_ms = Costs({r: 10.0 for r in (1, 4, 8, 16, 21)})
    assert d._tree_size(scores) == len(scores)
    d.run.pass_ms = Costs({1: 10.0, 2: 15.0, 21: 110.0})  # each extra row costs half a token
    cheap = d._tree_size(scores)
    assert 1 <= cheap <= 3
    d.run.accepted_sum, d.run.predicted_sum = 1.0, 10.0  # the head has been far too confident
    assert d._tree_size(scores) <= cheap
    d.run.pass_ms = Costs({1: 10.0, 2: 20.0, 21: 210.0})  # a row costs a whole token: no tree pays
    assert d._tree_size(scores) == 0
    assert d.info["tree_tokens_mean"] > 0
    d.total = 4  # an explicit size is kept
    assert d._tree_size(scores) == 4


# -- recipe, CLI, DDP -------------------------------------------------------------------------
def _jsonl(path, n: int = 12) -> None:
    rows = []
    for i in range(n):
        q = f"What is {i} plus {i}?"
        rows.append(
            {
                "id": f"c{i}",
                "category": "chat",
                "turns": [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * 3},
                ],
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _train_cmd(tiny_path, data, out) -> list[str]:
    return [
        "train",
        "eagle3",
        "--target",
        str(tiny_path),
        "--data",
        str(data),
        "--out",
        str(out),
        "--tokens",
        "1000",
        "--draft-vocab",
        "64",
        "--intermediate-size",
        "32",
        "--epochs",
        "2",
        "--seqs-per-step",
        "2",
        "--no-progress",
    ]


def test_train_cli_writes_a_usable_head(tiny_dir, tmp_path, capsys):
    from specdec.cli import main

    data = tmp_path / "conv.jsonl"
    _jsonl(data, 40)
    out = tmp_path / "head"
    assert main(_train_cmd(tiny_dir("llama"), data, out)) == 0
    rec = Eagle3Head.training_record(out)
    assert (
        rec["data"] == str(data)
        and rec["seed"] == 0
        and 1000 <= rec["feature_tokens"] < 1200
        and rec["cpu_seconds"] > 0
    )
    assert "specdec train eagle3" in rec["command"] and len(rec["validation_top1_by_step"]) == 3
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_dir("llama")),
                "--drafter",
                "eagle3",
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
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["metrics"]["target_forwards"] > 0


def test_train_cli_self_distillation(tiny_dir, tmp_path):
    """--data-mode self: the target writes the answers; the manifest counts them and keys the
    cache on the answer length (a second run with other training settings reuses it)."""
    from specdec.cli import main

    data = tmp_path / "conv.jsonl"
    _jsonl(data, 40)
    out = tmp_path / "head"
    cmd = [*_train_cmd(tiny_dir("llama"), data, out), "--data-mode", "self", "--answer-tokens", "8", "--gen-batch", "3"]
    assert main(cmd) == 0
    manifest = json.loads((out / "features" / fe.MANIFEST).read_text())
    _, examples = fe.load_examples(out / "features")
    assert manifest["data_mode"] == "self" and manifest["max_answer_tokens"] == 8
    assert manifest["answer_tokens"] == sum(int(e.mask.sum()) for e in examples) > 0
    assert all(1 <= int(e.mask.sum()) <= 8 for e in examples)
    mtime = (out / "features" / fe.MANIFEST).stat().st_mtime
    assert main([*cmd[:-6], "--data-mode", "self", "--answer-tokens", "8", "--epochs", "1"]) == 0
    assert (out / "features" / fe.MANIFEST).stat().st_mtime == mtime  # reused


@pytest.mark.parametrize("mode", ["teacher", "self"])
def test_a_stopped_extraction_resumes_where_it_was(tiny, tmp_path, mode):
    """Killed after some shards, rerun with the same record: the shards written are kept, only
    the other conversations are extracted, and the cache holds what one uninterrupted run
    gives (the same examples per conversation; batch-invariant mode, so an answer does not
    depend on what shares its passes); a larger token count grows a finished cache."""
    lm = tiny("llama", dtype=EXACT_MODES[-1])
    layers = HeadConfig.default_feature_layers(lm.model.args.n_layers)
    convs = [
        [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * (1 + i % 3)},
        ]
        for i in range(14)
    ]

    def examples(done):
        if mode == "self":
            return fe.self_distill_examples(
                lm, convs, layers=layers, top_k=4, max_len=128, max_new_tokens=6, batch=3, skip=done
            )
        return fe.teacher_examples(lm, convs, layers=layers, top_k=4, max_len=128, skip=done)

    def killed_after(n):
        def make(done):
            for i, ex in enumerate(examples(done)):
                if i == n:
                    raise KeyboardInterrupt
                yield ex

        return make

    record = {"data": "test", "tokens_wanted": 10**6}
    whole = fe.extract(examples, tmp_path / "whole", max_tokens=10**6, shard_tokens=60, progress=False, record=record)
    with pytest.raises(KeyboardInterrupt):
        fe.extract(killed_after(7), tmp_path / "cut", max_tokens=10**6, shard_tokens=60, progress=False, record=record)
    partial = json.loads((tmp_path / "cut" / fe.PARTIAL).read_text())
    assert 0 < partial["conversations"] < 7 and not (tmp_path / "cut" / fe.MANIFEST).exists()
    with pytest.raises(KeyboardInterrupt):  # a second stop, after none of the rest is written
        fe.extract(killed_after(0), tmp_path / "cut", max_tokens=10**6, shard_tokens=60, progress=False, record=record)
    resumed = fe.extract(examples, tmp_path / "cut", max_tokens=10**6, shard_tokens=60, progress=False, record=record)
    assert not (tmp_path / "cut" / fe.PARTIAL).exists()
    for key in ("conversations", "tokens", "answer_tokens", "sources"):
        assert resumed[key] == whole[key], key
    by_source = {e.source: e for e in fe.load_examples(tmp_path / "whole")[1]}
    got = fe.load_examples(tmp_path / "cut")[1]
    assert sorted(e.source for e in got) == sorted(by_source) == list(range(len(convs)))
    for e in got:
        ref = by_source[e.source]
        assert torch.equal(e.tokens, ref.tokens) and torch.equal(e.features, ref.features)
        assert torch.equal(e.mask, ref.mask) and torch.equal(e.top_ids, ref.top_ids)
    # a finished cache with fewer tokens than now wanted grows; another record starts anew
    small = fe.extract(
        examples,
        tmp_path / "grow",
        max_tokens=100,
        shard_tokens=60,
        progress=False,
        record={**record, "tokens_wanted": 100},
    )
    grown = fe.extract(examples, tmp_path / "grow", max_tokens=10**6, shard_tokens=60, progress=False, record=record)
    assert small["conversations"] < grown["conversations"] == len(convs) and grown["sources"] == whole["sources"]
    other = fe.extract(
        examples, tmp_path / "grow", max_tokens=100, shard_tokens=60, progress=False, record={**record, "data": "other"}
    )
    assert other["conversations"] == small["conversations"] and other["shards"] == small["shards"]


def test_eagle3_without_a_head_says_how_to_get_one(tiny_dir, capsys):
    from specdec.cli import main

    rc = main(
        [
            "generate",
            "--target",
            str(tiny_dir("llama")),
            "--drafter",
            "eagle3",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "4",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "specdec train eagle3" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_train_runs_under_torchrun_with_two_processes(tiny_dir, tmp_path):
    """Scale-out is DDP: two CPU processes (gloo) train one head; each takes half the data."""
    data = tmp_path / "conv.jsonl"
    _jsonl(data, 40)
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "specdec.cli",
        *_train_cmd(tiny_dir("llama"), data, out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = Eagle3Head.training_record(out)
    assert rec["world_size"] == 2
    assert (out / "features" / "rank-0" / fe.MANIFEST).exists() and (out / "features" / "rank-1" / fe.MANIFEST).exists()
    Eagle3Head.load(out)


# -- export -------------------------------------------------------------------------------------
def _proposals(model, head, prompt_ids) -> list[list[int]]:
    d = Eagle3Drafter(model, head=head, topk=3, total=8)
    seen: list[list[int]] = []
    orig = d.propose

    def spy(k):
        draft = orig(k)
        seen.append(draft.tokens.tolist() + list(draft.parents))
        return draft

    d.propose = spy
    engine.run(
        model,
        prompt_ids,
        GenerationConfig(max_new_tokens=16, k=4, ignore_eos=True, adaptive_k=False),
        SamplingParams(),
        d,
    )
    return seen


def test_export_writes_the_engines_layout_and_loads_back(tiny, tmp_path):
    from safetensors.torch import load_file

    from specdec.training.export import EAGLE3_WEIGHT_NAMES as WEIGHT_NAMES
    from specdec.training.export import export_eagle3 as export

    lm = tiny("llama")
    model = lm.model
    head = random_head(model, seed=3, scale=20.0)
    c = head.cfg
    H, nh, nkv, D, FF, N, V = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        c.draft_vocab_size,
        c.target_vocab_size,
    )
    shapes = {  # as vLLM's and SGLang's Eagle3 Llama layers allocate them (q/k/v read embeds + hidden)
        "midlayer.self_attn.q_proj.weight": (nh * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": (nkv * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, nh * D),
        "midlayer.mlp.gate_proj.weight": (FF, H),
        "midlayer.mlp.up_proj.weight": (FF, H),
        "midlayer.mlp.down_proj.weight": (H, FF),
        "fc.weight": (H, 3 * H),
        "lm_head.weight": (N, H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "d2t": (N,),
        "t2d": (V,),
    }
    prompt = lm.tokenizer.encode(PROMPTS[0])
    for fmt in ("vllm", "sglang"):
        out = export(head, tmp_path / fmt, fmt, torch.float32)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
        assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"]) == (N, V, H)
        assert cfg["tie_word_embeddings"] is False and cfg["eagle_aux_hidden_state_layer_ids"] == [
            i + 1 for i in c.feature_layers
        ]
        tensors = load_file(str(out / "model.safetensors"))
        assert set(tensors) == set(WEIGHT_NAMES) == set(shapes)
        assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        assert torch.equal(tensors["d2t"] + torch.arange(N), head.draft_ids)  # target id = draft id + d2t
        back = attach_target(Eagle3Head.load(out), model)
        assert not back.cfg.tie_lm_head and back.cfg.feature_layers == c.feature_layers
        assert _proposals(model, back, prompt) == _proposals(model, head, prompt)


def test_export_cli(tiny_dir, tmp_path):
    from specdec.cli import main

    lm = specdec.load(tiny_dir("llama"), dtype="fp32", device="cpu")
    head = random_head(lm.model)
    import dataclasses

    # the head records the directory it was trained for: export attaches that target's rows
    tied = Eagle3Head(dataclasses.replace(head.cfg, target=str(tiny_dir("llama"))))
    tied.load_state_dict(head.state_dict(), strict=False)
    tied.save(tmp_path / "h")
    assert main(["export", "eagle3", str(tmp_path / "h"), "--format", "sglang", "--out", str(tmp_path / "x")]) == 0
    assert json.loads((tmp_path / "x" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(SystemExit):  # argparse: one usage line naming the choices
        main(["export", "eagle3", str(tmp_path / "h"), "--format", "tensorrt", "--out", str(tmp_path / "y")])


def test_loss_fraction_draws_a_seeded_subset(tiny):
    model = tiny("llama").model
    head = random_head(model)
    ex = _examples(model, 1, 40, seed=9)[0]
    full = sequence_loss(head, ex, 2, 64)[1]
    a = sequence_loss(head, ex, 2, 64, 0.25, torch.Generator().manual_seed(1))[1]
    b = sequence_loss(head, ex, 2, 64, 0.25, torch.Generator().manual_seed(1))[1]
    assert a == b and all(0 < m < f for (_, m), (_, f) in zip(a, full, strict=True))
    with pytest.raises(ValueError, match="loss_fraction"):
        TrainConfig(loss_fraction=0.0)


def test_training_in_bf16_autocast(tiny, tmp_path):
    """What runs where the CPU has AMX (forced here): the same loop under bfloat16 autocast."""
    model = tiny("llama").model
    data = _examples(model, 8, 30, seed=10)
    head = random_head(model, width=128)
    r = train(
        head, data, TrainConfig(steps=2, lr=3e-3, seqs_per_step=2, epochs=6, dtype="bf16"), tmp_path, progress=False
    )
    hist = r["history"]
    assert r["compute_dtype"] == "bf16" and all(math.isfinite(h["loss"]) for h in hist)
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert all(p.dtype == torch.float32 for p in head.parameters())  # weights stay float32


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("avx2 fma amx_tile amx_bf16 amx_int8", True),
        ("avx2 avx512f avx512_bf16 avx512_vnni", True),
        ("avx2 avx512f avx512_vnni", False),
        ("avx2 fma", False),
    ],
)
def test_auto_compute_dtype_is_bf16_where_the_cpu_has_bf16_matmuls(monkeypatch, flags, expected):
    """bf16 autocast where oneDNN has bf16 instructions (AMX tiles, AVX512-BF16), fp32 elsewhere;
    an explicit choice overrides the CPU."""
    from specdec.model import native

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(native, "cpu_info", lambda: {"flags": flags})
    assert TrainConfig().autocast_bf16() is expected
    assert TrainConfig(dtype="fp32").autocast_bf16() is False and TrainConfig(dtype="bf16").autocast_bf16() is True


def test_when_no_tree_pays_it_stops_drafting_and_stays_exact(tiny, monkeypatch):
    """Rows that cost a whole token each: the cost model sends nothing and backs off (plain
    steps without drafting), and the output is still plain decoding's."""
    from specdec.costs import Costs

    lm = tiny("llama", dtype=EXACT_MODES[-1])
    model = lm.model
    head = random_head(model, seed=2, scale=20.0)
    d = Eagle3Drafter(model, head=head)
    d.run.pass_ms = Costs({1: 10.0, 2: 20.0, 49: 490.0})
    ids = lm.tokenizer.encode(PROMPTS[0])
    cfg = GenerationConfig(max_new_tokens=40, k=4, ignore_eos=True, adaptive_k=False)
    out = engine.run(model, ids, cfg, SamplingParams(), d)
    assert out.token_ids == engine.run(model, ids, cfg, SamplingParams()).token_ids
    # 40 plain steps; the head looked on steps 1, 3, 6, 11, 20, 37 only (backing off 1, 2, 4, 8, 16)
    assert out.metrics.proposed == 0 and out.metrics.target_forwards == 39 and len(d._sizes) == 6


def test_a_deeper_level_is_drafted_only_where_it_can_pay(tiny):
    """Each depth of the tree costs a head call: another level is drafted only where its best
    case (a child as likely as each expanded parent) beats the candidates at hand in expected
    tokens per ms; a head that has not timed a call yet times one; fixed trees keep their depth.
    In a run where a call costs five tokens, every step stops at the first level (the
    catch-up's call only) and greedy output is plain decoding's."""
    import time

    from specdec.costs import Costs

    model = tiny("llama").model
    d = Eagle3Drafter(model, head=random_head(model), max_total=20)
    d._t0 = time.perf_counter()  # a proposal has just begun
    scores = [math.log(p) for p in (0.9, 0.5, 0.2)]
    d.run.pass_ms = Costs({1: 10.0, 40: 10.0})  # rows are free
    d.run.call_ms = None
    assert d._deeper_pays(scores, scores[:2])
    d.run.call_ms = 0.5
    assert d._deeper_pays(scores, scores[:2])
    d.run.call_ms = 50.0  # a call costs more than the best it could add
    assert not d._deeper_pays(scores, scores[:2])
    d.run.pass_ms, d.run.call_ms = Costs({1: 10.0, 2: 20.0, 40: 400.0}), 0.5  # a row costs a token: no tree pays
    assert not d._deeper_pays(scores, scores[:2])
    d.total = 4
    assert d._deeper_pays(scores, scores[:2])

    lm = tiny("llama", dtype=EXACT_MODES[-1])
    head = random_head(lm.model, seed=2, scale=20.0)
    ids = lm.tokenizer.encode(PROMPTS[1])
    cfg = GenerationConfig(max_new_tokens=24, k=4, ignore_eos=True, adaptive_k=False)
    d = Eagle3Drafter(lm.model, head=head)
    d.run.pass_ms, d.run.call_ms = Costs({1: 10.0, 2: 10.5, 40: 30.0}), 50.0
    out = engine.run(lm.model, ids, cfg, SamplingParams(), d)
    assert out.token_ids == engine.run(lm.model, ids, cfg, SamplingParams()).token_ids
    assert len(d._sizes) > 0 and d.forwards == len(d._sizes)  # one call (the catch-up) per look


def test_pass_costs_are_timed_once_per_machine(tiny, tmp_path, monkeypatch):
    from specdec import costs

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    model = tiny("llama").model
    calls = []
    real = costs._time_rows
    monkeypatch.setattr(costs, "_time_rows", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    monkeypatch.delitem(costs.PASS_TABLES, model, raising=False)  # nothing timed in this process yet
    first = costs.pass_costs(model, 9)
    assert costs.pass_costs(model, 9) is first  # kept in this process
    costs.PASS_TABLES.pop(model, None)  # "a new process": read back from disk
    again = costs.pass_costs(model, 9)
    assert len(calls) == 1 and again.target_ms == pytest.approx(first.target_ms, abs=1e-3)
    assert sorted(first.target_ms) == list(range(1, 10)) and (tmp_path / costs.PASS_COSTS_FILE).exists()
    ms = [first.target_ms[r] for r in range(1, 10)]
    assert ms == sorted(ms)  # more rows never cost less (a real timing, which noise can make non-monotone)
    costs.pass_costs(model, 20)  # a wider range than stored: timed again
    assert len(calls) == 2
