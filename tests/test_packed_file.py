"""The packed-weight file: plain safetensors, 64-byte aligned, read into memory of its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from specdec.model import packed_file


def test_written_aligned_and_read_back_by_us_and_by_safetensors(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"layer{i}": rng.integers(0, 256, (i + 1, 64 * (i + 2)), dtype=np.uint8) for i in range(3)}
    path = tmp_path / "p.safetensors"
    packed_file.save(tensors, path, {"layer0": "4", "specdec.source": "x"})
    got, meta = packed_file.load(path)
    assert meta == {"layer0": "4", "specdec.source": "x"}
    for name, t in tensors.items():
        assert np.array_equal(got[name].numpy(), t)
        assert got[name].data_ptr() % 64 == 0  # on a cache line
    with safe_open(str(path), framework="pt") as f:  # any safetensors reader
        assert f.metadata()["specdec.source"] == "x"
        assert torch.equal(f.get_tensor("layer2"), torch.from_numpy(tensors["layer2"]))


def test_a_file_of_an_earlier_version_reads_the_same(tmp_path):
    path = tmp_path / "old.safetensors"
    t = np.arange(64 * 3, dtype=np.uint8).reshape(3, 64)
    save_file({"a": t}, str(path), metadata={"a": "6"})  # safetensors' own writer: 8-byte header padding
    got, meta = packed_file.load(path)
    assert np.array_equal(got["a"].numpy(), t) and meta == {"a": "6"}
    assert got["a"].data_ptr() % 64 == 0


def test_a_tensor_that_is_not_whole_lines_is_refused(tmp_path):
    with pytest.raises(ValueError, match="whole cache lines"):
        packed_file.save({"a": np.zeros((3, 10), np.uint8)}, tmp_path / "x.safetensors", {})
