"""The commands the issues write out must work as written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def specdec_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True)


@pytest.mark.real
def test_generate_compare_json_as_written():
    res = specdec_cli("generate", "--target", "smollm2-135m", "--draft", "smollm2-135m", "-k", "4",
                      "--temperature", "0", "--max-new-tokens", "40", "--compare", "--json",
                      "--prompt", "Name three planets of the solar system.")  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    for key in ("identical", "speedup", "acceptance_rate", "mean_accepted_tokens", "tokens_per_second"):
        assert key in out, key
    assert out["identical"] is True
    assert out["acceptance_rate"] == 1.0  # the draft is the target itself
    assert 1.0 < out["mean_accepted_tokens"] <= 5.0
    assert out["speedup"] > 0 and out["tokens_per_second"] > 0


@pytest.mark.real
def test_sampled_generation_reports_seed_and_reproduces():
    args = ("generate", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--temperature", "0.8",
            "--top-p", "0.9", "--seed", "7", "--max-new-tokens", "16", "--json", "--prompt", "Once upon a time")  # fmt: skip
    a, b = specdec_cli(*args), specdec_cli(*args)
    assert a.returncode == 0, a.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["seed"] == 7 and ja["token_ids"] == jb["token_ids"]


def test_models_list():
    res = specdec_cli("models", "list")
    assert res.returncode == 0
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"):
        assert name in res.stdout


@pytest.mark.real
def test_prompt_lookup_compare_json_as_written():
    """`specdec generate --target NAME --drafter prompt-lookup --compare --json ...` with the
    same JSON fields as the draft-model path."""
    res = specdec_cli("generate", "--target", "smollm2-135m", "--drafter", "prompt-lookup", "--ngram-max", "3",
                      "-k", "5", "--max-new-tokens", "40", "--compare", "--json", "--no-chat",
                      "--prompt", "one two three four five. one two three four five. one two")  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip())
    for key in ("identical", "speedup", "acceptance_rate", "mean_accepted_tokens", "tokens_per_second"):
        assert key in out, key
    assert out["identical"] is True and out["drafter"] == "prompt-lookup" and out["draft"] is None
    assert out["mean_accepted_tokens"] > 1.0


@pytest.mark.real
@pytest.mark.parametrize("drafter, extra", [("early-exit", []), ("early-exit", ["--exit-layer", "24"]),
                                            ("lookahead", ["--window", "3", "--ngram", "4", "--guesses", "3"])])
def test_other_drafters_compare_json_as_written(drafter, extra):
    """`specdec generate --target NAME --drafter early-exit|lookahead --compare --json ...`: the
    same JSON fields as the draft-model path; early exit reports its layer."""
    res = specdec_cli("generate", "--target", "smollm2-135m", "--drafter", drafter, *extra, "-k", "3",
                      "--max-new-tokens", "24", "--compare", "--json", "--prompt", "Name three planets.")  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip())
    for key in ("identical", "speedup", "acceptance_rate", "mean_accepted_tokens", "tokens_per_second"):
        assert key in out, key
    assert out["identical"] is True and out["drafter"] == drafter
    info = out["speculative"]["metrics"]["drafter_info"]
    if drafter == "early-exit":
        assert info["layer"] == (24 if extra else info["layer"]) and info["calibrated"] is (not extra)
        assert 1 <= info["layer"] < info["n_layers"] == 30


@pytest.mark.parametrize("args, message", [
    (["--drafter", "draft-model"], "--drafter draft-model needs --draft MODEL"),
    (["--drafter", "early-exit", "--exit-layer", "9"], "early-exit layer 9 is out of range"),
    (["--drafter", "lookahead", "--ngram", "1"], "lookahead needs window >= 0, ngram >= 2"),
    (["--drafter", "prompt-lookup", "--draft", "x"], "--draft is only used by the draft-model drafter"),
    (["--drafter", "prompt-lookup", "--ngram-min", "3", "--ngram-max", "2"], "min_ngram <= max_ngram"),
    (["--compare"], "--compare needs --draft or --drafter"),
])  # fmt: skip
def test_drafter_option_errors_are_one_line(tiny_dir, args, message):
    res = specdec_cli("generate", "--target", str(tiny_dir("llama")), "--max-new-tokens", "4", "--prompt", "ab", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
