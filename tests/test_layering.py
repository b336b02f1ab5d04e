"""Imports inside seer_engine go one way: down the layers, never in a circle.

Layers, lowest first (a module may import from its own layer and from lower ones):

    0  kernels            pure Triton kernels; they import nothing from seer_engine
       native             seer_engine._C and seer_engine._cpu_ops, the C++ extensions built
                          from csrc/ (leaves)
    1  core               + seer_engine/sampling_params.py, seer_engine/outputs.py
    2  model_executor, spec_decode
    3  engine
    4  kv_connector
    5  rollout
    6  workloads, tasks
    7  sim
    8  entrypoints        + seer_engine/__init__.py (the package facade)

Every ``import`` and ``from ... import`` of every module counts, wherever it sits:
inside functions (a lazy import is still a dependency, and still a cycle) and inside
``if TYPE_CHECKING:`` blocks (a type-only import still ties the lower layer to the
higher one's types; a Protocol in the lower layer avoids it). Relative imports are
resolved against the importing module. ``from pkg import name`` counts as importing
``pkg.name`` when that is a module, else ``pkg``. Only the named target counts, not
the parent packages Python initialises on the way (else every module would import
the facade).

Layers of the same rank (model_executor and spec_decode; workloads and tasks) may
import each other; the cycle check still applies. A few downward imports are ruled
out as well (``FORBIDDEN``): a KV connector never imports ``LLMEngine``. Imports of
seer_engine modules that do not exist (a stale lazy import) fail too.

A module outside every layer (a new top-level folder or file) fails until it is
given one here. Cycles are strongly connected components of the module graph; each
is reported as one concrete cycle with the file:line of every edge.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "seer_engine"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

LAYER_RANK = {
    "kernels": 0,
    "native": 0,
    "core": 1,
    "model_executor": 2,
    "spec_decode": 2,
    "engine": 3,
    "kv_connector": 4,
    "rollout": 5,
    "workloads": 6,
    "tasks": 6,
    "sim": 7,
    "entrypoints": 8,
}
# Downward imports that are still not allowed: (importing layer, module, name, why).
FORBIDDEN = [
    (
        "kv_connector",
        f"{PACKAGE}.engine.llm_engine",
        "LLMEngine",
        "a connector reaches an engine's KV blocks only through the KVBlockIO protocol it implements",
    ),
]
# Modules directly under seer_engine/ that are not packages of their own.
TOP_LEVEL_MODULES = {
    PACKAGE: "entrypoints",  # the facade: re-exports LLM, SamplingParams, ...
    f"{PACKAGE}.sampling_params": "core",
    f"{PACKAGE}.outputs": "core",
    f"{PACKAGE}._C": "native",
    f"{PACKAGE}._cpu_ops": "native",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: str  # its file, relative to the repository root
    line: int
    target: str  # the seer_engine module imported
    name: str | None = None  # the name taken from it (``from target import name``)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The layer of a seer_engine module; None when it has none."""
    if module in TOP_LEVEL_MODULES:
        return TOP_LEVEL_MODULES[module]
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYER_RANK and parts[1] != "native":
        return parts[1]  # seer_engine.<layer> and everything in it
    return None


def collect_imports(root: Path) -> tuple[list[Import], set[str]]:
    """Every import of a ``root`` module (``root`` is the package folder) as an edge to a
    module of the same package, and the set of its modules."""
    files = sorted(root.rglob("*.py"))
    native = {n for n, layer in TOP_LEVEL_MODULES.items() if layer == "native"}  # built from csrc/
    modules = {module_name(f, root) for f in files} | native
    package = root.name
    edges: list[Import] = []
    for file in files:
        module = module_name(file, root)
        is_package = file.name == "__init__.py"
        rel = file.relative_to(root.parent).as_posix()
        tree = ast.parse(file.read_text(), filename=str(file))
        for node in ast.walk(tree):
            targets: list[tuple[str, str | None]] = []
            if isinstance(node, ast.Import):
                targets = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    drop = node.level - 1 if is_package else node.level
                    if drop >= len(base):
                        raise AssertionError(f"{rel}:{node.lineno}: relative import beyond the package")
                    base = base[: len(base) - drop]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append((sub, None) if sub in modules else (source, alias.name))
            for target, name in targets:
                if target == package or target.startswith(package + "."):
                    edges.append(Import(module, rel, node.lineno, target, name))
    return edges, modules


def layer_violations(edges: list[Import], modules: set[str]) -> list[str]:
    """Modules without a layer, imports of modules that do not exist, imports into a
    higher layer, the ``FORBIDDEN`` ones, and any import of the package from kernels/."""
    problems = []
    for module in sorted(modules):
        if layer_of(module) is None:
            problems.append(f"{module}: in no layer; give its top-level folder one in test_layering.py")
    for e in edges:
        src, dst = layer_of(e.module), layer_of(e.target)
        what = f"{e.name} from {e.target}" if e.name else e.target
        where = f"{e.path}:{e.line}: {e.module} ({src}) imports {what} ({dst})"
        if e.target not in modules:
            problems.append(f"{where}: there is no such module")
            continue
        if src is None or dst is None:
            continue  # reported above as a module in no layer
        if src == "kernels":
            problems.append(f"{where}: kernels import nothing from {PACKAGE}")
        elif LAYER_RANK[dst] > LAYER_RANK[src]:
            problems.append(f"{where}: layer {src} may not import from the higher layer {dst}")
        else:
            for layer, target, name, why in FORBIDDEN:
                if (src, e.target, e.name) == (layer, target, name):
                    problems.append(f"{where}: {why}")
    return problems


def import_cycles(edges: list[Import]) -> list[str]:
    """One concrete cycle per strongly connected component of more than one module (or a
    module importing itself): each module with the file:line where it imports the next."""
    graph: dict[str, dict[str, Import]] = {}
    for e in edges:
        graph.setdefault(e.module, {}).setdefault(e.target, e)
        graph.setdefault(e.target, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm, iterative over each node's edges
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles = []
    for component in components:
        members = set(component)
        start = min(component)
        if len(component) == 1 and start not in graph[start]:
            continue
        # Shortest path from start back to start inside the component (BFS).
        parent: dict[str, str] = {}
        frontier = [start]
        found = False
        while frontier and not found:
            nxt = []
            for u in frontier:
                for w in sorted(graph[u]):
                    if w not in members:
                        continue
                    if w == start:
                        parent[start] = u
                        found = True
                        break
                    if w not in parent:
                        parent[w] = u
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        hops = [start]
        while True:
            prev = parent[hops[-1]]
            hops.append(prev)
            if prev == start:
                break
        hops.reverse()
        steps = [graph[a][b] for a, b in zip(hops, hops[1:])]
        text = " -> ".join(f"{s.module} ({s.path}:{s.line})" for s in steps) + f" -> {start}"
        cycles.append(f"import cycle among {len(component)} modules: {text}")
    return cycles


@pytest.fixture(scope="module")
def graph() -> tuple[list[Import], set[str]]:
    return collect_imports(ROOT)


def test_imports_only_go_down_the_layers(graph) -> None:
    problems = layer_violations(*graph)
    assert not problems, f"{len(problems)} layering violations:\n" + "\n".join(problems)


def test_no_import_cycles(graph) -> None:
    cycles = import_cycles(graph[0])
    assert not cycles, "\n".join(cycles)


# -- the checker itself, on a made-up package ---------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / PACKAGE
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/request.py": "def f():\n    from ..engine import llm_engine\n",
            "core/seeds.py": "import typing\nif typing.TYPE_CHECKING:\n    from .. import rollout\n",
            "engine/__init__.py": "",
            "engine/llm_engine.py": "from seer_engine.core.request import f\nfrom . import config\n",
            "engine/config.py": "",
            "rollout/__init__.py": "",
        },
    )
    edges, modules = collect_imports(root)
    seen = {(e.module, e.target, e.line) for e in edges}
    assert ("seer_engine.core.request", "seer_engine.engine.llm_engine", 2) in seen
    assert ("seer_engine.core.seeds", "seer_engine.rollout", 3) in seen
    assert ("seer_engine.engine.llm_engine", "seer_engine.core.request", 1) in seen
    assert ("seer_engine.engine.llm_engine", "seer_engine.engine.config", 2) in seen
    problems = layer_violations(edges, modules)
    assert len(problems) == 2
    assert problems[0].startswith("seer_engine/core/request.py:2: seer_engine.core.request (core) imports")
    assert "may not import from the higher layer engine" in problems[0]
    assert "seer_engine/core/seeds.py:3:" in problems[1] and "(rollout)" in problems[1]
    cycles = import_cycles(edges)
    assert len(cycles) == 1 and "seer_engine/core/request.py:2" in cycles[0]
    assert "seer_engine/engine/llm_engine.py:1" in cycles[0]


def test_checker_flags_kernels_unknown_folders_and_missing_modules(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "kernels/__init__.py": "",
            "kernels/attn.py": "import torch\nfrom seer_engine.kernels import util\n",
            "kernels/util.py": "",
            "extras/thing.py": "",
            "helpers.py": "",
            "engine/__init__.py": "",
            "engine/llm_engine.py": "class LLMEngine: ...\ndef resolve_model_path(): ...\n",
            "kv_connector/__init__.py": "",
            "kv_connector/base.py": "from ..engine.llm_engine import resolve_model_path, LLMEngine\n",
            "core/__init__.py": "",
            "core/x.py": "from seer_engine import SamplingParams\nimport seer_engine.core.gone\n",
        },
    )
    problems = layer_violations(*collect_imports(root))
    assert problems == [
        "seer_engine.extras.thing: in no layer; give its top-level folder one in test_layering.py",
        "seer_engine.helpers: in no layer; give its top-level folder one in test_layering.py",
        "seer_engine/core/x.py:1: seer_engine.core.x (core) imports SamplingParams from seer_engine "
        "(entrypoints): layer core may not import from the higher layer entrypoints",
        "seer_engine/core/x.py:2: seer_engine.core.x (core) imports seer_engine.core.gone (core): "
        "there is no such module",
        "seer_engine/kernels/attn.py:2: seer_engine.kernels.attn (kernels) imports seer_engine.kernels.util "
        "(kernels): kernels import nothing from seer_engine",
        "seer_engine/kv_connector/base.py:1: seer_engine.kv_connector.base (kv_connector) imports LLMEngine "
        "from seer_engine.engine.llm_engine (engine): a connector reaches an engine's KV blocks only "
        "through the KVBlockIO protocol it implements",
    ]


def test_checker_reports_a_three_module_cycle_in_order(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "sim/__init__.py": "",
            "sim/a.py": "from seer_engine.sim import b\n",
            "sim/b.py": "\n\nimport seer_engine.sim.c\n",
            "sim/c.py": "def g():\n    import seer_engine.sim.a as a\n",
        },
    )
    edges, modules = collect_imports(root)
    assert layer_violations(edges, modules) == []
    assert import_cycles(edges) == [
        "import cycle among 3 modules: seer_engine.sim.a (seer_engine/sim/a.py:1) -> "
        "seer_engine.sim.b (seer_engine/sim/b.py:3) -> seer_engine.sim.c (seer_engine/sim/c.py:2) "
        "-> seer_engine.sim.a"
    ]


MAX_FILE_LINES = 500


def test_no_module_is_over_500_lines() -> None:
    """One job per file: a module that grows past this wants splitting."""
    long = {
        str(path.relative_to(ROOT.parent)): n
        for path in ROOT.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"modules over {MAX_FILE_LINES} lines: {long}"
