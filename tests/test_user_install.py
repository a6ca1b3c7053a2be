"""Every command a user can run works after the README's install alone (`pip install -e .`,
no test extra): nothing in the package imports what only the tests install.

Two layers: every import statement in the package (at the top of a module or inside a
function) is served by the package's own dependencies; and the commands' smallest real
invocations run in a process where what only the test extra brings cannot be imported."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import specdec

PACKAGE = Path(specdec.__file__).parent
# imported only after `importlib.util.find_spec` says they are there (peers of the benchmark)
OPTIONAL = {"llama_cpp"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(extra: str) -> set[str]:
    """The distributions `pip install -e .` (extra "") or `.[extra]` brings, by normalised name."""
    todo = [Requirement(r) for r in metadata.requires("specdec") or []]
    todo = [r for r in todo if r.marker is None or r.marker.evaluate({"extra": extra})]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            # (a requirement asked with several extras brings what any of them brings)
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in sorted(req.extras) or [""]):
                todo.append(r)
    return seen


def _imports() -> dict[str, list[str]]:
    """Top-level module name -> where the package imports it (file:line)."""
    out: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                out.setdefault(name.split(".")[0], []).append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return out


def _test_only_modules() -> set[str]:
    """Top-level modules that only the test extra's distributions provide."""
    core, full = _closure(""), _closure("test")
    only = full - core
    return {
        mod
        for mod, dists in metadata.packages_distributions().items()
        if {_norm(d) for d in dists} & only and not {_norm(d) for d in dists} & core
    }


def test_every_import_is_served_by_the_install():
    core = _closure("")
    providers = metadata.packages_distributions()
    missing = []
    for mod, where in _imports().items():
        if mod in sys.stdlib_module_names or mod in ("specdec", "__future__") or mod in OPTIONAL:
            continue
        dists = {_norm(d) for d in providers.get(mod, [])}
        if not dists & core:
            missing.append(f"{mod} ({', '.join(sorted(dists)) or 'no installed distribution'}) at {where[0]}")
    assert not missing, "imported by the package but not brought by `pip install -e .`: " + "; ".join(missing)


def test_the_check_sees_a_test_only_import():
    """Negative control: the test extra's own modules are found as test-only (were the import
    check blind to them, the test above could not fail)."""
    only = _test_only_modules()
    assert {"pytest", "hypothesis", "openai"} <= only
    assert not only & {"torch", "numpy", "scipy", "fastapi", "transformers"}


def _site_without_test_extra(tmp: Path) -> Path:
    """A view of this environment's site-packages without what only the test extra installs
    (its packages and their metadata): what `pip install -e .` alone leaves."""
    only = _closure("test") - _closure("")
    site = Path(pytest.__file__).resolve().parents[1]
    blocked = set()
    for dist in metadata.distributions():
        if _norm(dist.metadata["Name"]) in only:
            blocked |= {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    view = tmp / "site-packages"
    view.mkdir()
    for entry in site.iterdir():
        if entry.name not in blocked:
            (view / entry.name).symlink_to(entry)
    return view


def _python(view: Path, code: str) -> list[str]:
    """This interpreter, with `view` as its only site directory (its .pth files read: the
    editable install's finder among them)."""
    return [sys.executable, "-S", "-c", f"import site, sys; site.addsitedir({str(view)!r}); {code}"]


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.parametrize(
    "args",
    [
        ["info", "--no-bandwidth"],
        ["models", "list"],
        [
            "generate",
            "--target",
            "smollm2-135m",
            "--drafter",
            "prompt-lookup",
            "--compare",
            "--repeats",
            "2",
            "--max-new-tokens",
            "6",
            "--prompt",
            "one two three one two three one two",
        ],
        [
            "certify",
            "--target",
            "smollm2-135m",
            "--drafter",
            "prompt-lookup",
            "--temperature",
            "1",
            "--samples",
            "100",
            "--no-control",
        ],
        [
            "bench",
            "--target",
            "smollm2-135m",
            "--quick",
            "--no-peers",
            "--methods",
            "prompt-lookup",
            "--categories",
            "chat",
            "--temperatures",
            "0",
            "--repeats",
            "1",
            "--max-new-tokens",
            "4",
            "--out",
            "{tmp}",
        ],
        ["bench", "forward", "--model", "smollm2-135m", "--modes", "q4k", "--repeats", "2"],
        ["bench", "peers"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_a_command_runs_without_the_test_extra(args, tmp_path):
    view = _site_without_test_extra(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path / "out")) for a in args]
    cmd = _python(view, f"sys.argv = ['specdec', *{args!r}]; from specdec.cli import main; sys.exit(main())")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert "internal error" not in run.stderr and "ModuleNotFoundError" not in run.stderr, run.stderr[-2000:]
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_view_lacks_the_test_extra(tmp_path):
    """Negative control of the runs above: in that environment a test-only package cannot be
    imported, and a package of the install can."""
    view = _site_without_test_extra(tmp_path)
    missing = subprocess.run(_python(view, "import pytest"), capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "No module named 'pytest'" in missing.stderr
    there = subprocess.run(_python(view, "import specdec, scipy, fastapi"), capture_output=True, text=True, timeout=120)
    assert there.returncode == 0, there.stderr
