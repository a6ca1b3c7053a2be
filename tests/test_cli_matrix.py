"""Every subcommand with bad values: exit code 2 and one clear line, never a traceback.

Run in process (`specdec.cli.main`): an exception that escapes fails the test with its
traceback, which is what a user would have seen. Targets are tiny models where a value is
only checked once a model is loaded."""

from __future__ import annotations

import pytest
from helpers import run_cli

from specdec.cli import main

TINY = "{tiny}"
BAD = [
    # generate
    ["generate", "--target", TINY, "--prompt", "x", "--max-new-tokens", "-1"],
    ["generate", "--target", TINY, "--prompt", "x", "--max-new-tokens", "abc"],
    ["generate", "--target", TINY, "--prompt", "x", "--temperature", "-1"],
    ["generate", "--target", TINY, "--prompt", "x", "--top-p", "2"],
    ["generate", "--target", TINY, "--prompt", "x", "--top-k", "-3"],
    ["generate", "--target", TINY, "--prompt", "x", "--seed", "x"],
    ["generate", "--target", TINY, "--prompt", "x", "--drafter", "prompt-lookup", "-k", "0"],
    ["generate", "--target", TINY, "--prompt", "x", "--drafter", "bogus"],
    ["generate", "--target", TINY, "--prompt", "x", "--dtype", "bogus"],
    ["generate", "--target", TINY, "--prompt", "x", "--device", "foo"],
    ["generate", "--target", TINY, "--prompt", "x", "--device", "cuda:7"],
    ["generate", "--target", TINY, "--prompt-file", "/nonexistent/prompt.txt"],
    ["generate", "--target", TINY, "--prompt", "   "],
    ["generate", "--target", "no-such-model", "--prompt", "x"],
    ["generate", "--target", "/nonexistent/model.gguf", "--prompt", "x"],
    ["generate", "--target", TINY, "--prompt", "x", "--context-overflow", "bogus"],
    ["generate", "--target", TINY, "--prompt", "x", "--acceptance", "bogus"],
    ["generate", "--target", TINY, "--prompt", "x", "--acceptance", "typical"],  # greedy: typical needs T > 0
    ["generate", "--target", TINY, "--prompt", "x", "--draft", TINY, "--drafter", "prompt-lookup"],
    ["generate", "--target", TINY, "--prompt", "x", "--drafter", "early-exit", "--exit-layer", "99"],
    ["generate", "--target", TINY, "--prompt", "x", "--drafter", "prompt-lookup", "--ngram-max", "-1"],
    ["generate", "--target", TINY, "--prompt", "x", "--drafter", "eagle3", "--head", "/nonexistent/head"],
    ["generate", "--target", TINY, "--prompt", "x", "--drafter", "medusa", "--head", "/nonexistent/head"],
    ["generate", "--target", TINY, "--prompt", "x", "--head", "/nonexistent/head"],  # an option of no drafter given
    ["generate", "--target", TINY, "--prompt", "x", "--compare"],
    ["generate", "--target", TINY, "--prompt", "x", "--stream", "--json"],
    ["generate"],
    # models and data
    ["models", "install", "bogus"],
    ["models", "path", "bogus"],
    ["models", "remove", "bogus"],
    ["models", "vocab", "bogus"],
    ["models", "vocab", TINY, "--limit", "0"],
    ["models", "vocab", TINY, "--data", "/nonexistent/data.json"],
    ["models", "bogus"],
    ["data", "install", "bogus"],
    ["data", "path", "bogus"],
    # bench
    ["bench", "--target", TINY, "--methods", "bogus"],
    ["bench", "--target", TINY, "--repeats", "0"],
    ["bench", "--target", TINY, "--prompts", "/nonexistent/prompts.jsonl"],
    ["bench", "--target", TINY, "--temperatures", "-1"],
    ["bench", "--target", TINY, "--categories", "no-such-category"],
    ["bench", "forward", "--model", "bogus"],
    ["bench", "forward", "--model", TINY, "--context", "-5"],
    ["bench", "forward", "--model", TINY, "--repeats", "0"],
    ["bench", "forward", "--model", TINY, "--draft-vocab", "64"],
    ["bench", "forward", "--model", TINY, "--draft", TINY, "--draft-vocab", "-3"],
    ["generate", "--target", TINY, "--draft", TINY, "--draft-vocab", "-1", "--prompt", "x"],
    ["bench", "batch", "--target", TINY, "--batch", "0"],
    ["bench", "serve", "--requests", "0"],
    ["bench", "serve", "--concurrency", "0"],
    # train and export
    ["train", "eagle3", "--target", TINY, "--data", "/nonexistent/data.json", "--out", "{tmp}/h"],
    ["train", "medusa", "--target", TINY, "--heads", "0", "--out", "{tmp}/h"],
    ["train", "hydra", "--target", TINY, "--lr", "-1", "--out", "{tmp}/h"],
    ["train", "eagle3", "--target", "no-such-model", "--out", "{tmp}/h"],
    ["export", "eagle3", "/nonexistent/head", "--out", "{tmp}/out"],
    ["export", "medusa", "/nonexistent/head", "--out", "{tmp}/out"],
    # serve
    ["serve", "--target", TINY, "--port", "0"],
    ["serve", "--target", TINY, "--max-batch", "0"],
    ["serve", "--target", "no-such-model"],
    ["serve", "--target", TINY, "--drafter", "draft-model"],
    # certify
    ["certify", "--target", TINY],
    ["certify", "--target", TINY, "--drafter", "prompt-lookup", "--samples", "5"],
    ["certify", "--target", TINY, "--drafter", "prompt-lookup", "--alpha", "2"],
    ["certify", "--target", TINY, "--drafter", "prompt-lookup", "--temperature", "0"],
    ["certify", "--target", TINY, "--drafter", "prompt-lookup", "--top-p", "5"],
    ["certify", "--target", TINY, "--drafter", "draft-model"],
    ["certify", "--target", TINY, "--drafter", "prompt-lookup", "--tokens", "0"],
    # info
    ["info", "--bogus"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a)[:80] for a in BAD])
@pytest.mark.slow
def test_bad_value_is_one_clear_line(argv, tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_DEBUG", "1")  # a bug escapes with its traceback here, for the test report
    argv = [a.replace(TINY, str(tiny_dir("llama"))).replace("{tmp}", str(tmp_path)) for a in argv]
    res = run_cli(capsys, *argv)  # (argparse's own errors exit: unknown choice, not a number, missing argument)
    err = res.stderr
    assert res.returncode == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("specdec")]
    assert lines and len(lines[-1]) > len("specdec: error: "), err


def test_a_bug_is_one_line_for_the_user_and_a_traceback_on_request(monkeypatch, capsys):
    from specdec import info

    def broken(**kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(info, "collect", broken)
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    assert main(["info"]) == 1
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: boom" in err and "SPECDEC_DEBUG=1" in err and "Traceback" not in err
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["info"])
