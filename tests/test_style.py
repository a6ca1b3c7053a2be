"""The tree passes the formatter and linter configured in pyproject.toml (ruff), so `.ci/run`
keeps the house style without a separate step; and the line-length budget holds."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINE_LENGTH = 120  # pyproject.toml's [tool.ruff] line-length
OVER_BUDGET = 20  # lines past it (pragma lines the formatter leaves alone)


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def _python_files() -> list[Path]:
    if shutil.which("git") and (ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
        return [ROOT / p for p in out.stdout.split()]
    return sorted(p for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py"))


@pytest.fixture(scope="module")
def ruff() -> None:
    try:
        import ruff  # noqa: F401
    except ImportError:
        pytest.fail("ruff is not installed: pip install -e '.[test]' brings it")


def test_ruff_check_passes(ruff):
    res = _ruff("check", "--no-cache", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format_leaves_the_tree_as_it_is(ruff):
    res = _ruff("format", "--check", "--no-cache", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_lines_stay_within_the_length_budget():
    files = _python_files()
    assert len(files) > 50  # (the tree was found)
    over = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > LINE_LENGTH
    ]
    assert len(over) <= OVER_BUDGET, f"{len(over)} lines over {LINE_LENGTH} columns: {over[:10]}"
    skips = [str(p.relative_to(ROOT)) for p in files if "fmt: " + "skip" in p.read_text()]
    assert not skips, f"formatter escapes came back: {skips}"
