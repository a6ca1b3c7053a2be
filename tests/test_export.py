"""Files out (`specdec models export`): what llama.cpp, transformers and vLLM load."""

from __future__ import annotations

import pytest
import torch

from specdec import export, registry, store
from specdec.model import sparse
from specdec.paths import sha256_file

pytestmark = pytest.mark.real
NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def installed():
    if not store.is_installed(NAME):
        pytest.skip(f"{NAME} is not installed (specdec models install {NAME})")
    return store.gguf_path(registry.MODELS[NAME])


def test_the_gguf_comes_out_whole_and_checked(installed, tmp_path):
    """The cache's file may be sparse (its packed blocks are holes); the export is the whole
    file, its pinned sha256, and the cache's file is left as it was."""
    before = sparse.state(installed)
    out = export.export_gguf(NAME, tmp_path / "smollm2.gguf", log=str)
    assert sha256_file(out) == registry.MODELS[NAME].sha256
    assert sparse.state(installed) == before


def test_the_hf_directory_loads_in_transformers_as_the_file_does(installed, tmp_path):
    """The exported directory is a bfloat16 Hugging Face model with its architecture, tokenizer
    and chat template; transformers loads it to the logits it reads from the GGUF itself in
    bfloat16 (bitwise), and a model that is not it is told apart (the control)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export.export_hf(NAME, tmp_path / "hf", log=str)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.architectures == ["LlamaForCausalLM"] and model.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template
    ids = tokenizer("def fib(n):", return_tensors="pt").input_ids
    with sparse.full(installed):
        direct = AutoModelForCausalLM.from_pretrained(
            str(installed.parent),
            gguf_file=installed.name,
            config=model.config,
            dtype=torch.bfloat16,
        )
    with torch.no_grad():
        ours, theirs = model(ids).logits, direct(ids).logits
    assert torch.equal(ours, theirs)
    with torch.no_grad():
        direct.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # the control: one layer off by 1%
        assert not torch.equal(model(ids).logits, direct(ids).logits)


def test_exporting_into_a_full_directory_is_refused(installed, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        export.export_hf(NAME, tmp_path / "x", log=str)
