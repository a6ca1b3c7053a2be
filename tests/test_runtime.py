"""What a process learns about a model lives outside the model (`specdec.runtime`): kept per
model weakly, memory dropped by `forget`, artifacts kept; the model layer imports nothing
above it, and no import in the package closes a circle."""

from __future__ import annotations

import ast
import gc
import json
import weakref
from pathlib import Path

from specdec import runtime

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "src" / "specdec"
MODEL_DIR = PACKAGE_DIR / "model"


class _Model:
    """A stand-in model: anything weakly referenceable keys the caches."""


def test_entries_go_with_their_model():
    cache = runtime.per_model(memory=False)
    m = _Model()
    made = cache.of(m, list)
    assert cache.of(m, list) is made and len(cache) == 1  # made once
    del m
    gc.collect()
    assert len(cache) == 0


def test_an_entry_that_holds_its_model_does_not_keep_it_alive():
    """A draft vocabulary or a head's runner refers to its model: the entry must still go with
    the model (a WeakKeyDictionary would keep such a key alive for the process's life)."""
    cache = runtime.per_model(memory=False)
    m = _Model()
    cache.of(m, dict)["model"] = m
    probe = weakref.ref(m)
    del m
    gc.collect()
    assert probe() is None and len(cache) == 0
    leaky: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # control: the pitfall is real
    k = _Model()
    leaky[k] = {"model": k}
    probe = weakref.ref(k)
    del k
    gc.collect()
    assert probe() is not None and len(leaky) == 1


def test_forget_drops_memory_and_keeps_artifacts():
    memory, artifact = runtime.per_model(memory=True), runtime.per_model(memory=False)
    a, b = _Model(), _Model()
    for m in (a, b):
        memory.of(m, dict)["seen"] = 1
        artifact.of(m, dict)["table"] = 2
    runtime.forget(a)
    assert a not in memory and b in memory and a in artifact and b in artifact
    runtime.forget_all()
    assert len(memory) == 0 and len(artifact) == 2


def _upward(source: str, package_depth: int = 1) -> list[str]:
    """Imports in a module of specdec/model/ that reach the package outside model/ (except
    `paths`, the cache root every layer reads), type-only ones included."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > package_depth:
            target = (node.module or "").split(".")[0] or node.names[0].name
            if target != "paths":
                out.append(f"{'.' * node.level}{node.module or ''}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            out += [
                n for n in names if n.startswith("specdec") and not n.startswith(("specdec.model", "specdec.paths"))
            ]
    return out


def test_the_model_layer_imports_nothing_above_it():
    files = sorted(MODEL_DIR.rglob("*.py"))
    assert len(files) > 10
    found = {str(p.relative_to(MODEL_DIR)): up for p in files if (up := _upward(p.read_text()))}
    assert not found, found


def test_the_layer_check_sees_an_upward_import():
    """Negative control: a type-only import of an upper layer is found."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..costs import Costs\n"
    assert _upward(source) == ["..costs"]
    assert _upward("from ..paths import cache_root\nfrom .cache import KVCache\n") == []
    assert _upward("import specdec.adaptive\n") == ["specdec.adaptive"]


def _imports(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every import: inside functions and type-only
    ones included). `modules`: dotted name -> source; a package is named by its __init__."""
    packages = {name for name in modules if any(other.startswith(name + ".") for other in modules)}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, source in modules.items():
        here = name.split(".") if name in packages else name.split(".")[:-1]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:  # (a name inside a module: the module)
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].add(t)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                out.append(sorted(group))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_closes_a_circle():
    modules = {}
    for p in PACKAGE_DIR.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p.read_text()
    edges = _imports(modules)
    assert len(edges) > 80 and sum(map(len, edges.values())) > 300
    assert _circles(edges) == []


def test_the_circle_check_sees_a_circle_through_a_function_level_import():
    """Negative control: a circle closed by an import inside a function, through a package."""
    modules = {
        "p": "",
        "p.a": "from . import b\n",
        "p.b": "def f():\n    from .c import g\n",
        "p.c": "import p.a\n",
        "p.d": "from .a import x\n",
    }
    assert _circles(_imports(modules)) == [["p.a", "p.b", "p.c"]]


def test_the_suite_leaves_no_measurements_of_its_temporary_models(tmp_path):
    from helpers import drop_entries_under

    table = tmp_path / "pass_costs.json"
    table.write_text(json.dumps({"/tmp/pytest-of-me/pytest-3/tiny0/llama|q4k|cpu": 1, "/home/me/m|q4k|cpu": 2}))
    assert drop_entries_under(table, "/tmp/pytest-of-me") == 1
    assert json.loads(table.read_text()) == {"/home/me/m|q4k|cpu": 2}  # a user's own model is kept
    assert drop_entries_under(table, "/tmp/pytest-of-me") == 0 and drop_entries_under(tmp_path / "none", "/") == 0
