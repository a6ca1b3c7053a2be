"""The commands the issues write out must work as written.

Run in this process (`specdec.cli.main` with its streams captured: the exit code, stdout and
stderr a shell would see, without a new interpreter and torch per case); one end-to-end run per
command group in a real subprocess stays (`generate --stream` here, `bench` in
test_bench_grid.py, `serve` in test_server.py, `info` in test_kernels.py, `train` in
test_eagle3.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from helpers import assert_bench_page


@pytest.mark.real
def test_generate_compare_json_as_written(specdec_cli):
    res = specdec_cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--draft",
        "smollm2-135m",
        "-k",
        "4",
        "--temperature",
        "0",
        "--max-new-tokens",
        "40",
        "--compare",
        "--json",
        "--prompt",
        "Name three planets of the solar system.",
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    for key in ("identical", "speedup", "acceptance_rate", "mean_accepted_tokens", "tokens_per_second"):
        assert key in out, key
    assert out["identical"] is True and out["speedup"] > 0 and out["tokens_per_second"] > 0
    # a draft as costly as the target cannot pay: the never-slower guard keeps most steps plain
    # and says so (how many probe steps it spends depends on measured times: 0-6 of ~22 seen)
    members = out["speculative"]["metrics"]["drafter_info"]["schedule"]["members"]
    assert members.get("plain", {}).get("steps", 0) >= sum(m["steps"] for m in members.values()) / 2
    fixed = specdec_cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--draft",
        "smollm2-135m",
        "-k",
        "4",
        "--no-adaptive-k",
        "--temperature",
        "0",
        "--max-new-tokens",
        "40",
        "--compare",
        "--json",
        "--prompt",
        "Name three planets of the solar system.",
    )
    out = json.loads(fixed.stdout)
    assert out["identical"] is True
    assert out["acceptance_rate"] == 1.0  # the draft is the target itself
    assert 1.0 < out["mean_accepted_tokens"] <= 5.0
    # what the run paid: drafting per draft token, and the target's passes by the rows they scored
    m = out["speculative"]["metrics"]
    assert m["draft_ms_per_token"] > 0 and set(m["target_ms_by_rows"]) <= {"1", "2", "3", "4", "5"}
    assert sum(v["passes"] for v in m["target_ms_by_rows"].values()) == m["target_forwards"]


@pytest.mark.real
def test_sampled_generation_reports_seed_and_reproduces(specdec_cli):
    args = (
        "generate",
        "--target",
        "smollm2-135m",
        "--draft",
        "smollm2-135m",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--max-new-tokens",
        "16",
        "--json",
        "--prompt",
        "Once upon a time",
    )
    a, b = specdec_cli(*args), specdec_cli(*args)
    assert a.returncode == 0, a.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["seed"] == 7 and ja["token_ids"] == jb["token_ids"]


def test_models_list(specdec_cli):
    res = specdec_cli("models", "list")
    assert res.returncode == 0
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"):
        assert name in res.stdout


@pytest.mark.real
def test_prompt_lookup_compare_json_as_written(specdec_cli):
    """`specdec generate --target NAME --drafter prompt-lookup --compare --json ...` with the
    same JSON fields as the draft-model path."""
    res = specdec_cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--drafter",
        "prompt-lookup",
        "--ngram-max",
        "3",
        "-k",
        "5",
        "--max-new-tokens",
        "40",
        "--compare",
        "--json",
        "--no-chat",
        "--prompt",
        "one two three four five. one two three four five. one two",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip())
    for key in ("identical", "speedup", "acceptance_rate", "mean_accepted_tokens", "tokens_per_second"):
        assert key in out, key
    assert out["identical"] is True and out["drafter"] == "prompt-lookup" and out["draft"] is None
    assert out["mean_accepted_tokens"] > 1.0


@pytest.mark.real
def test_auto_compare_json_as_written(specdec_cli):
    """`specdec generate --drafter auto [--draft NAME] --compare --json`: auto's choices in the
    metrics and on stderr, output identical to plain decoding."""
    res = specdec_cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--drafter",
        "auto",
        "--draft",
        "smollm2-135m",
        "-k",
        "4",
        "--max-new-tokens",
        "32",
        "--compare",
        "--json",
        "--no-chat",
        "--prompt",
        "one two three four five. one two three four five. one two",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip())
    assert out["identical"] is True and out["drafter"] == "auto"
    auto = out["speculative"]["metrics"]["drafter_info"]["schedule"]
    assert auto["methods"] == ["draft-model", "prompt-lookup", "suffix"] and "prompt-lookup" in auto["steps"]
    text = specdec_cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--drafter",
        "auto",
        "--max-new-tokens",
        "8",
        "--no-chat",
        "--prompt",
        "one two three one two three one two",
    )
    assert text.returncode == 0 and "steps: " in text.stderr


@pytest.mark.real
@pytest.mark.parametrize(
    "drafter, extra",
    [
        ("early-exit", []),
        ("early-exit", ["--exit-layer", "24"]),
        ("lookahead", ["--window", "3", "--ngram", "4", "--guesses", "3"]),
    ],
)
def test_other_drafters_compare_json_as_written(drafter, extra, specdec_cli):
    """`specdec generate --target NAME --drafter early-exit|lookahead --compare --json ...`: the
    same JSON fields as the draft-model path; early exit reports its layer."""
    res = specdec_cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--drafter",
        drafter,
        *extra,
        "-k",
        "3",
        "--max-new-tokens",
        "24",
        "--compare",
        "--json",
        "--prompt",
        "Name three planets.",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip())
    for key in ("identical", "speedup", "acceptance_rate", "mean_accepted_tokens", "tokens_per_second"):
        assert key in out, key
    assert out["identical"] is True and out["drafter"] == drafter
    info = out["speculative"]["metrics"]["drafter_info"]
    if drafter == "early-exit" and extra:
        assert info == {"layer": 24, "n_layers": 30, "calibrated": False}
    elif drafter == "early-exit":  # calibrated: the candidate with the best predicted speedup, reported
        assert info["calibrated"] is True and info["n_layers"] == 30 and info["k"] == 3
        best = max(info["candidates"], key=lambda L: info["candidates"][L]["predicted_speedup"])
        assert str(info["layer"]) == best and 15 <= info["layer"] <= 29


@pytest.mark.parametrize(
    "args, message",
    [
        (["--drafter", "draft-model"], "--drafter draft-model needs --draft MODEL"),
        (["--drafter", "early-exit", "--exit-layer", "9"], "early-exit layer 9 is out of range"),
        (["--drafter", "lookahead", "--ngram", "1"], "lookahead needs window >= 0, ngram >= 2"),
        (["--drafter", "prompt-lookup", "--draft", "x"], "--draft is only used by the draft-model and auto drafters"),
        (["--drafter", "auto", "--auto-methods", "lookahead"], "auto cannot switch to 'lookahead'; choose among"),
        (["--drafter", "auto", "--auto-methods", "draft-model"], "auto with draft-model needs a draft model (--draft"),
        (["--auto-methods", "prompt-lookup"], "--auto-methods is an option of the auto drafter"),
        (["--drafter", "prompt-lookup", "--ngram-min", "3", "--ngram-max", "2"], "min_ngram <= max_ngram"),
        (["--compare"], "--compare needs --draft or --drafter"),
        (["--drafter", "prompt-lookup", "--window", "2"], "--window is an option of the lookahead drafter"),
        (["--exit-layer", "1"], "--exit-layer is an option of the early-exit drafter"),
        (["--drafter", "prompt-lookup", "--stream", "--json"], "--stream prints text as it is committed"),
    ],
)
@pytest.mark.slow
def test_drafter_option_errors_are_one_line(tiny_dir, args, message, specdec_cli):
    res = specdec_cli("generate", "--target", str(tiny_dir("llama")), "--max-new-tokens", "4", "--prompt", "ab", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.real
def test_generate_stream_as_written(specdec_cli):
    """`specdec generate --target smollm2-135m --drafter prompt-lookup --stream --max-new-tokens
    40 --prompt "..."` prints the text as it is committed: stdout carries the same text as
    the non-streamed run, written in several pieces."""
    args = (
        "generate",
        "--target",
        "smollm2-135m",
        "--drafter",
        "prompt-lookup",
        "--max-new-tokens",
        "40",
        "--prompt",
        "Repeat after me: the quick brown fox jumps over the lazy dog.",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", *args, "--stream"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pieces = []
    while chunk := proc.stdout.read(1):  # type: ignore[union-attr]
        pieces.append(chunk)
    assert proc.wait() == 0, proc.stderr.read()  # type: ignore[union-attr]
    whole = specdec_cli(*args)
    assert whole.returncode == 0
    assert "".join(pieces).strip() == whole.stdout.strip() and len(whole.stdout.strip()) > 10
    assert "tokens/pass" in proc.stderr.read()  # type: ignore[union-attr]


def test_stream_writes_each_step_as_it_is_committed(tiny_dir, monkeypatch):
    """Each step's text reaches stdout before the next step runs."""
    from specdec import cli, engine

    steps = [0]
    writes: list[int] = []  # the step count at each non-empty write
    real_step = engine.Engine.step
    monkeypatch.setattr(engine.Engine, "step", lambda self: (steps.__setitem__(0, steps[0] + 1), real_step(self))[1])

    class Spy(io.StringIO):
        def write(self, s: str) -> int:
            if s.strip():
                writes.append(steps[0])
            return super().write(s)

    monkeypatch.setattr(sys, "stdout", Spy())
    rc = cli.main(
        [
            "generate",
            "--target",
            str(tiny_dir("llama")),
            "--drafter",
            "prompt-lookup",
            "--stream",
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--no-chat",
            "--prompt",
            "abcabcabcabc",
        ]
    )
    assert rc == 0 and len(set(writes)) > 2  # text written during several different steps


@pytest.mark.real
def test_bench_batch_as_written(tmp_path, specdec_cli):
    """`specdec bench batch --target smollm2-135m --batch 1 2 4 8 --json` prints per batch size
    and method (plain, draft-model, prompt-lookup) the aggregate tokens/s and the speedup over
    plain decoding at that batch size; --out DIR writes the JSON and a PNG."""
    res = specdec_cli(
        "bench",
        "batch",
        "--target",
        "smollm2-135m",
        "--batch",
        "1",
        "2",
        "4",
        "8",
        "--json",
        "--max-new-tokens",
        "16",
        "--out",
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    rows = {(r["batch"], r["method"]): r for r in out["summary"]}
    assert set(rows) == {(b, m) for b in (1, 2, 4, 8) for m in ("plain", "draft-model", "prompt-lookup")}
    for (_batch, m), r in rows.items():
        assert r["tokens_per_second"] > 0
        assert r["speedup"] == 1.0 if m == "plain" else r["speedup"] > 0
        lo, hi = r["speedup_band"]
        assert lo <= r["speedup"] <= hi
        assert r["identical"] is (None if m == "plain" else True)  # every sequence equals plain decoding
    assert out["draft"] == "smollm2-135m" and len(out["prompts"]) == 8
    assert json.loads((tmp_path / "batch.json").read_text())["summary"] == out["summary"]
    assert (tmp_path / "batch.png").read_bytes()[:4] == b"\x89PNG"
    assert_bench_page(tmp_path / "batch.html", "prompt-lookup", "identical")


def test_json_output_still_reports_the_early_exit_choice_on_stderr(tiny_dir, capsys):
    import json as _json

    from specdec.cli import main

    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_dir("llama")),
                "--drafter",
                "early-exit",
                "--prompt",
                "hello hello",
                "--max-new-tokens",
                "4",
                "--json",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    info = _json.loads(out)["metrics"]["drafter_info"]
    assert f"early exit after layer {info['layer']} of {info['n_layers']}" in err


def test_auto_takes_the_installed_draft_of_its_target(monkeypatch, capsys, tmp_path):
    """`--drafter auto` without --draft drafts with the target's registered draft where it is
    installed, and says so; --no-auto-draft, an explicit --draft or another drafter leave it.
    (A cache of its own, where the draft's converted files stand and nothing else does.)"""
    import argparse
    import shutil

    from specdec import registry, store
    from specdec.cli.common import auto_draft
    from specdec.model.convert import BASE_WEIGHTS

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    converted = store.converted_dir(store.get_spec(registry.DEFAULT_DRAFT).sha256)
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    (converted / BASE_WEIGHTS).write_bytes(b"")
    assert store.is_installed(registry.DEFAULT_DRAFT) and not store.is_installed(registry.DEFAULT_TARGET)

    def ns(**kw):
        return argparse.Namespace(**{"target": registry.DEFAULT_TARGET, "draft": None, "auto_draft": True, **kw})

    got = ns()
    auto_draft(got, "auto")
    assert got.draft == registry.DEFAULT_DRAFT and "--no-auto-draft" in capsys.readouterr().err
    for kept, method in (
        (ns(auto_draft=False), "auto"),
        (ns(draft="other"), "auto"),
        (ns(), "suffix"),
        (ns(target="smollm2-135m"), "auto"),
    ):
        before = kept.draft
        auto_draft(kept, method)
        assert kept.draft == before
    shutil.rmtree(converted)  # the draft not installed: nothing said, no draft
    missing = ns()
    auto_draft(missing, "auto")
    assert missing.draft is None and capsys.readouterr().err == ""


def test_prediction_file_drafts_and_logprobs_come_with_json(tiny_dir, tmp_path, capsys):
    """`specdec generate --prediction-file F`: the prediction drafter (auto with --draft) drafts
    from F; the output equals plain decoding's; --logprobs N adds each token's to --json."""
    import json as _json

    from specdec.cli import main

    args = [
        "generate",
        "--target",
        str(tiny_dir("llama")),
        "--prompt",
        "hello hello",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--no-chat",
        "--json",
        "--logprobs",
        "2",
    ]
    assert main(args) == 0
    plain = _json.loads(capsys.readouterr().out)
    assert len(plain["logprobs"]) == 12 and all(len(lp["top"]) == 2 for lp in plain["logprobs"])
    from specdec.tokenizer import Tokenizer

    (tmp_path / "p.txt").write_text(Tokenizer.from_dir(tiny_dir("llama")).decode(plain["token_ids"]))
    assert main([*args, "--prediction-file", str(tmp_path / "p.txt"), "--no-adaptive-k", "-k", "4"]) == 0
    out = _json.loads(capsys.readouterr().out)
    assert out["drafter"] == "prediction" and out["token_ids"] == plain["token_ids"]
    assert out["logprobs"] == plain["logprobs"] and out["metrics"]["drafter_info"]["prediction"]["accepted_tokens"] > 0
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_dir("llama")),
                "--prompt",
                "x",
                "--prediction-file",
                str(tmp_path / "missing.txt"),
            ]
        )
        == 2
    )
    assert "cannot read the prediction file" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_dir("llama")),
                "--prompt",
                "x",
                "--drafter",
                "suffix",
                "--prediction-file",
                str(tmp_path / "p.txt"),
            ]
        )
        == 2
    )
    assert "does not draft from a prediction" in capsys.readouterr().err
