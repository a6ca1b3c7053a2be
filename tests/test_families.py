"""Every model family through the GGUF reader: a tiny random model of the family, written into a
GGUF file as llama.cpp writes that family (`specdec.testing.write_tiny_gguf`, with the gguf
package), loaded by specdec from the file computes what it computes loaded from its Hugging Face
directory. (Gemma 3's GGUF reading is tested on the registered gemma3-270m file.)"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from specdec.model import load_transformer
from specdec.model.config import ModelArgs
from specdec.model.families import FAMILIES, GGUF_ARCHITECTURES, llama3_factors, llama3_from_factors
from specdec.model.gguf_file import gguf_blocks
from specdec.model.kquant import F32, Q4K, dequantize
from specdec.model.linear import Linear
from specdec.testing import make_tiny_model, write_tiny_gguf

GGUF_FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(HF directory, GGUF file, the directory specdec converted the file into), per family."""
    from specdec import store

    root = tmp_path_factory.mktemp("families")
    out = {}

    def get(arch: str):
        if arch not in out:
            # (Mistral's GGUF is llama's, which has no sliding window: the tiny one's never slides)
            kw = {"sliding_window": 512} if arch == "mistral" else {}
            hf = _float32_eps(make_tiny_model(root / arch, arch, seed=4, **kw))
            gguf = write_tiny_gguf(hf, root / f"{arch}.gguf", name=f"tiny-{arch}")
            out[arch] = hf, gguf, store.resolve(gguf)
        return out[arch]

    return get


def _float32_eps(hf):
    """A GGUF holds the norms' epsilon as float32: the checkpoint's is made one that float32 holds
    exactly, so both read the same number."""
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 2.0**-20}))
    return hf


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, model.new_cache(ids.shape[1])).logits


IDS = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))  # past the tiny windows (8)


@pytest.mark.parametrize("arch", GGUF_FAMILIES)
def test_a_family_read_from_its_gguf_computes_what_its_checkpoint_does(written, arch, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))  # (packed weights of these throwaway models)
    hf, _, converted = written(arch)
    want = ModelArgs.from_dir(hf)
    if arch == "mistral":  # llama.cpp writes Mistral as llama, which has no sliding window
        want = dataclasses.replace(want, model_type="llama", sliding_window=None, layer_sliding=())
    assert ModelArgs.from_dir(converted) == want  # the config, as transformers and llama.cpp read it
    # fp32: every weight de-quantized by transformers from the GGUF
    torch.testing.assert_close(
        _logits(load_transformer(converted, dtype="fp32", device="cpu"), IDS),
        _logits(load_transformer(hf, dtype="fp32", device="cpu"), IDS),
        rtol=0,
        atol=0,
    )
    # q4k: norms from the GGUF, linear layers and embedding rows read from its tensors by our reader
    # (q/k rows, stacked layers) and run as the file holds them (float32 rows): the checkpoint's
    # float32 logits up to the order of the sums (a row put in the wrong place is far off)
    from_gguf = load_transformer(converted, dtype="q4k", device="cpu")
    assert isinstance(from_gguf.model.embed_tokens, torch.nn.Module) and from_gguf.mode == "q4k"
    assert {m.kernel.kind for m in from_gguf.modules() if isinstance(m, Linear)} == {F32}
    torch.testing.assert_close(
        _logits(from_gguf, IDS), _logits(load_transformer(hf, dtype="fp32", device="cpu"), IDS), rtol=1e-4, atol=1e-4
    )


def test_the_comparison_sees_a_gguf_written_another_familys_way(written, tmp_path):
    """Negative control: llama's q/k rows written without llama.cpp's interleave (as qwen2
    writes them) give other logits, so the test above can fail."""
    from specdec import store
    from specdec.model import families

    hf, _, _ = written("llama")
    real = families.FAMILIES["llama"]
    families.FAMILIES["llama"] = families.Family(**{**real.__dict__, "gguf_qk_interleaved": False})
    try:
        gguf = write_tiny_gguf(hf, tmp_path / "plain-rows.gguf", name="tiny-llama")
    finally:
        families.FAMILIES["llama"] = real
    converted = store.resolve(gguf)
    got = _logits(load_transformer(converted, dtype="fp32", device="cpu"), IDS)
    assert not torch.allclose(got, _logits(load_transformer(hf, dtype="fp32", device="cpu"), IDS), atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_k_quant_blocks_are_read_per_layer_from_interleaved_and_stacked_tensors(arch, tmp_path, monkeypatch):
    """The q4k reader's own path, the file's Q4_K blocks with no re-quantizing: every layer's
    blocks de-quantize to exactly the weights transformers reads from the same file — q/k rows
    put back in transformers' order (llama), a stacked tensor cut into its layers (Phi-3)."""
    from safetensors.torch import load_file

    from specdec import store
    from specdec.model.convert import float_weights
    from specdec.model.families import family, unstack

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    hf = _float32_eps(make_tiny_model(tmp_path / "hf", arch, seed=5, hidden=256))
    gguf = write_tiny_gguf(hf, tmp_path / "q4k.gguf", q4k=True)
    converted = store.resolve(gguf)
    args = ModelArgs.from_dir(converted)
    theirs = unstack(family(args.model_type), load_file(str(float_weights(converted) / "model.safetensors")), args)
    sizes = {k.removesuffix(".weight"): v.shape[0] for k, v in theirs.items() if "proj" in k and k.endswith("weight")}
    ours = gguf_blocks(gguf, sizes, args)
    assert set(ours) == set(sizes) and all(b.kind == Q4K for b in ours.values())
    for module, b in ours.items():
        want = theirs[f"{module}.weight"].numpy()
        assert np.array_equal(dequantize(b)[:, : want.shape[1]], want), module


def test_llama3_scaling_is_recovered_from_llama_cpps_divisors():
    for head_dim, theta, scaling in (
        (128, 500_000.0, (8.0, 1.0, 4.0, 8192)),  # Llama 3.1 8B
        (64, 500_000.0, (32.0, 1.0, 4.0, 8192)),  # Llama 3.2 1B
        (16, 10_000.0, (8.0, 1.0, 4.0, 64)),  # the tiny test model's
    ):
        factors = [float(np.float32(f)) for f in llama3_factors(head_dim, theta, *scaling)]
        got = llama3_from_factors(factors, head_dim, theta, None)
        assert got is not None and (got["factor"], got["original_max_position_embeddings"]) == (scaling[0], scaling[3])
    assert llama3_from_factors([1.0, 1.5, 3.0, 1.0], 8, 10_000.0, None) is None  # not Llama 3's shape


def test_the_table_is_the_one_place():
    """The architectures the store accepts and the families the config reads are the table's."""
    from specdec import store
    from specdec.model.config import SUPPORTED_MODEL_TYPES

    assert store.SUPPORTED_GGUF_ARCHITECTURES == GGUF_ARCHITECTURES
    assert set(GGUF_ARCHITECTURES) == {"llama", "qwen2", "qwen3", "phi3", "gemma3"}
    assert set(SUPPORTED_MODEL_TYPES) == set(FAMILIES)
    bad = json.loads(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not supported; supported: llama"):
        ModelArgs.from_hf(bad)
