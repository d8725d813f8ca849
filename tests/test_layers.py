"""Imports point one way: the import graph of the package, read from source, against the layers that
docs/ARCHITECTURE.md lists (its "Layers" table is the one place they are written); and the core loads,
and its tests run, without the driver."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from switchps import names
from switchps.optim.optimizers import OPTIMIZERS
from switchps.ps_server.core.protocols import PROTOCOLS
from switchps.optim.schedules import SCHEDULES

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
CORE_TESTS = ("tests/test_core.py", "tests/test_core_switching.py", "tests/test_core_state.py", "tests/test_rescale.py",
              "tests/test_policies_online.py")

# Known violations, each to be deleted once it is gone (the test fails while an entry is stale).
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_ARROWS: set[tuple[str, str]] = set()

Graph = dict[str, set[str]]


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name, the linked folders (ps_server, ...) under their
    package names, each file by its real path."""
    found: dict[str, Path] = {}

    def walk(directory: Path, package: str) -> None:
        for path in sorted(directory.iterdir()):
            if path.is_dir() and (path / "__init__.py").is_file():
                walk(path.resolve(), f"{package}.{path.name}")
            elif path.suffix == ".py":
                found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path

    walk(ROOT / "switchps", "switchps")
    return found


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> list[str]:
    """The modules an import statement names (``from p import m`` names ``p.m`` when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph() -> tuple[Graph, list[str]]:
    """module -> the project modules it imports (anywhere in the file), and the imports of ``switchps``
    that name no module."""
    modules = _modules()
    graph: Graph = {}
    unresolved = []
    for name, path in modules.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, package, modules):
                    if target.split(".")[0] != "switchps" or target == name:
                        continue
                    if target in modules:
                        graph[name].add(target)
                    else:
                        unresolved.append(f"{name} imports {target}")
    return graph, unresolved


def read_layers() -> tuple[list[tuple[str, list[str]]], dict[str, set[str]]]:
    """The "Layers" table: (layer, module patterns) bottom to top, and each layer's reach (the layers it
    may import, transitively)."""
    section = DOC.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")][2:]  # past the header and its rule
    layers = [(layer, re.findall(r"`([^`]+)`", patterns)) for layer, patterns, _ in rows]
    uses = {layer: {u.strip() for u in below.split(",") if u.strip()} for layer, _, below in rows}
    unknown = {u for below in uses.values() for u in below} - set(uses)
    assert not unknown, f"the Layers table names layers it does not define: {unknown}"
    reach: dict[str, set[str]] = {}

    def below(layer: str) -> set[str]:
        if layer not in reach:
            reach[layer] = set().union(*({u} | below(u) for u in uses[layer]))
        return reach[layer]

    for layer in uses:
        below(layer)
    return layers, reach


def matches(path: str, pattern: str) -> bool:
    """``*`` stands for one name of a path (a module in that folder), ``**/`` for any folders."""
    one = ["[^/]*".join(re.escape(part) for part in deep.split("*")) for deep in pattern.split("**/")]
    return re.fullmatch("(?:[^/]+/)*".join(one), path) is not None


def layer_of(modules: dict[str, Path], layers: list[tuple[str, list[str]]]) -> dict[str, str | None]:
    """Each module's layer: the row of the most specific pattern matching its path (without .py): a name
    before a folder's ``*``, a deeper folder before the folder above it; a package's ``__init__`` is shared."""
    paths = {name: str(path.relative_to(ROOT).with_suffix("")) for name, path in modules.items()}
    ranked = sorted(((("*" not in pat.rsplit("/", 1)[-1], len(pat)), pat, layer) for layer, patterns in layers for pat in patterns),
                    reverse=True)
    return {name: next((layer for _, pat, layer in ranked if matches(p, pat)), None) for name, p in paths.items()}


def cycles(graph: Graph) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_names_a_module_and_every_module_has_a_layer():
    graph, unresolved = import_graph()
    assert len(graph) > 70 and sum(map(len, graph.values())) > 180, "the graph was read"
    assert unresolved == []
    layers, _ = read_layers()
    placed = layer_of(_modules(), layers)
    assert sorted(m for m, layer in placed.items() if layer is None) == [], "add them to the Layers table"


def test_no_import_points_up_or_across():
    graph, _ = import_graph()
    layers, reach = read_layers()
    placed = layer_of(_modules(), layers)
    found = {(src, dst) for src, dsts in graph.items() for dst in dsts
             if placed[src] != placed[dst] and placed[dst] not in reach[placed[src] or ""]}
    wrong = sorted(f"{src} ({placed[src]}) -> {dst} ({placed[dst]})" for src, dst in found - KNOWN_ARROWS)
    assert wrong == [], "imports the Layers table does not allow:\n" + "\n".join(wrong)
    assert sorted(KNOWN_ARROWS - found) == [], "no longer found: remove them from KNOWN_ARROWS"


def test_no_import_cycles():
    graph, _ = import_graph()
    found = set(cycles(graph))
    assert sorted(map(sorted, found - KNOWN_CYCLES)) == []
    assert sorted(map(sorted, KNOWN_CYCLES - found)) == [], "no longer found: remove them from KNOWN_CYCLES"


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"e"}, "f": set()}
    assert cycles(graph) == [frozenset("abc")]


def test_each_registry_holds_the_shared_names():
    assert tuple(PROTOCOLS) == names.PROTOCOLS
    assert tuple(OPTIMIZERS) == names.OPTIMIZERS
    assert tuple(SCHEDULES) == names.SCHEDULES


def test_importing_the_core_loads_no_driver_worker_or_tensorflow():
    probe = "import sys, switchps.ps_server.core; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = set(out.stdout.split())
    assert not loaded & {"grpc", "asyncio", "tensorflow", "keras", "tensorboardX"}
    layers, reach = read_layers()
    placed = layer_of(_modules(), layers)
    allowed = {"core"} | reach["core"]
    assert sorted(m for m in loaded if m in placed and placed[m] not in allowed) == []


def test_the_core_tests_pass_with_grpc_unimportable(tmp_path):
    (tmp_path / "grpc").mkdir()
    (tmp_path / "grpc" / "__init__.py").write_text("raise ImportError('grpc is unimportable in this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    blocked = subprocess.run([sys.executable, "-c", "import grpc"], capture_output=True, text=True, env=env,
                             timeout=60)
    assert "grpc is unimportable" in blocked.stderr
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CORE_TESTS],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert re.search(r"\d+ passed", out.stdout)
