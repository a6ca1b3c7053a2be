"""SYNTHETIC model files: real shapes, llama.cpp's tensor-type mix, random weights that run."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from specdec.model import kquant, native, synthetic

TINY = synthetic.Shape("qwen2", 256, 8, 4, 2, 64, 512, 300, 1e6, 1e-6, 512, qkv_bias=True)
TINY3 = synthetic.Shape("qwen3", 256, 2, 4, 2, 64, 512, 300, 1e6, 1e-6, 512, qk_norm=True)


def test_the_type_mix_is_llama_cpps():
    """Q4_K_M over 8 layers: attn_v and ffn_down in Q6_K where `use_more_bits` says (layers 0, 3, 6,
    7: the first eighth, the last eighth, every third between), the output in Q6_K, the rest Q4_K;
    Q8_0 keeps its output in Q8_0, Q4_0 puts it in Q6_K."""
    more = [i for i in range(8) if synthetic.tensor_type(f"blk.{i}.attn_v.weight", "Q4_K_M", i, 8) == T.Q6_K]
    assert more == [0, 3, 6, 7]
    assert synthetic.tensor_type("blk.1.ffn_down.weight", "Q4_K_M", 1, 8) == T.Q4_K
    assert synthetic.tensor_type("blk.3.ffn_down.weight", "Q5_K_M", 3, 8) == T.Q6_K
    assert synthetic.tensor_type("blk.3.ffn_up.weight", "Q5_K_M", 3, 8) == T.Q5_K
    assert synthetic.tensor_type("output.weight", "Q4_K_M", -1, 8) == T.Q6_K
    assert synthetic.tensor_type("output.weight", "Q8_0", -1, 8) == T.Q8_0
    assert synthetic.tensor_type("output.weight", "Q4_0", -1, 8) == T.Q6_K
    assert synthetic.tensor_type("blk.0.attn_v.weight", "Q4_0", 0, 8) == T.Q4_0


def test_the_real_shapes_have_their_published_sizes():
    assert round(synthetic.SHAPES["qwen2.5-7b"].parameters() / 1e9, 1) == 7.6
    assert round(synthetic.SHAPES["qwen2.5-14b"].parameters() / 1e9, 1) == 14.8
    assert round(synthetic.SHAPES["llama-3.1-8b"].parameters() / 1e9, 1) == 8.0
    assert round(synthetic.SHAPES["qwen3-8b"].parameters() / 1e9, 1) == 8.2


@pytest.mark.skipif(not native.available(), reason="the q4k kernel cannot be built on this machine")
@pytest.mark.parametrize("file_type", list(synthetic.FILE_TYPES))
def test_a_synthetic_file_is_named_so_and_runs_in_its_own_blocks(file_type, tmp_path, monkeypatch):
    from specdec import store
    from specdec.model import load_transformer
    from specdec.model.linear import Linear

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    shape = TINY3 if file_type == "Q5_K_M" else TINY  # (Qwen3's q/k norms on one of them)
    monkeypatch.setitem(synthetic.SHAPES, "tiny", shape)
    path = synthetic.write("tiny", file_type, log=str)
    assert "SYNTHETIC" in path.name and synthetic.write("tiny", file_type, log=str) == path  # once
    reader = GGUFReader(path)
    assert "SYNTHETIC" in reader.fields["general.name"].contents()
    types = {t.name: t.tensor_type for t in reader.tensors}
    for name, qtype in types.items():
        if name.endswith(".weight") and "norm" not in name:
            layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
            assert qtype == synthetic.tensor_type(name, file_type, layer, shape.layers), name
    model = load_transformer(store.resolve(path), dtype="q4k", device="cpu")
    kinds = {m.kernel.kind for m in model.modules() if isinstance(m, Linear)}
    layers = [t for n, t in types.items() if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n]
    assert kinds == {kquant.KIND_OF_TYPE[t] for t in [*layers, types["output.weight"]]}  # each as the file holds it
    ids = torch.arange(10)[None] + 3
    logits = model(ids, model.new_cache(10)).logits
    assert torch.isfinite(logits).all() and logits.abs().max() > 0
    size, directory = path.stat().st_size, store.resolve(path)
    assert store.packed_files(directory)
    assert store.remove_synthetic(path) > size  # the file and its packed weights
    assert not path.exists() and not directory.exists() and not store.packed_files(directory)
