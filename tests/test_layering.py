"""The package is a one-way house (docs/architecture.md): each module imports only its own layer and lower ones,
and no modules import each other in a circle.

Every ``import`` / ``from ... import`` of every module counts, wherever it stands: at the top, in a function body,
under ``if TYPE_CHECKING:``. The layers, lowest first:

0. kernels  ``model_support.kernels.*``
1. core     ``model_support.core.*`` except the command line
2. plugins  ``model_support.handlers.*`` and ``model_support.plugins.*``
3. harness  ``model_support.validation.*``
4. cli      ``model_support.core.cli`` and ``model_support.core.serving.cli``
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "model_support"
# model_support.<folder> is the repository's top-level <folder> (pyproject.toml's package-dir).
FOLDERS = ("kernels", "core", "handlers", "plugins", "validation")
LAYERS = ("kernels", "core", "plugins", "harness", "cli")
CLI_MODULES = frozenset({f"{PACKAGE}.core.cli", f"{PACKAGE}.core.serving.cli"})
FOLDER_LAYER = {"kernels": 0, "core": 1, "handlers": 2, "plugins": 2, "validation": 3}


def _excluded(relative: Path) -> bool:
    """Directories that are not modules of the package: the plugin distributions under plugins/ (their own
    packages), the cookiecutter template (``{{ }}`` in its paths), build outputs and caches."""
    parts = relative.parts
    if parts[0] == "plugins" and len(parts) > 1 and (parts[1].startswith("model-support-") or parts[1] == "template"):
        return True
    return any(part in ("build", "__pycache__") for part in parts)


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (an index into :data:`LAYERS`), or None for a name outside the layer map."""
    if module in CLI_MODULES:
        return LAYERS.index("cli")
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != PACKAGE:
        return None
    return FOLDER_LAYER.get(parts[1])


@dataclass
class Graph:
    """The package's modules (name -> file) and its import edges (importer -> imported -> first line)."""

    root: Path
    modules: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, dict[str, int]] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)  # imports of package modules that do not exist

    def where(self, module: str, line: int) -> str:
        return f"{self.modules[module].relative_to(self.root)}:{line}"


def _module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def find_modules(root: Path) -> dict[str, Path]:
    modules = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            if not _excluded(relative):
                modules[_module_name(relative)] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[tuple[str, str | None]]:
    """(module, name) pairs an import node names; relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, None
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    for alias in node.names:
        yield base, None if alias.name == "*" else alias.name


def _targets(modules: dict[str, Path], base: str, name: str | None) -> list[str]:
    """The package modules an import of ``name`` from ``base`` depends on: ``base`` itself (the longest prefix that
    is a module; ``from package import x`` reads the package's namespace, so its ``__init__`` counts) and
    ``base.name`` when that is a module too. Empty outside the package."""
    if base != PACKAGE and not base.startswith(f"{PACKAGE}."):
        return []
    parts = base.split(".")
    while len(parts) > 2 and ".".join(parts) not in modules:
        parts.pop()
    found = [".".join(parts)]
    if name is not None and f"{base}.{name}" in modules:
        found.append(f"{base}.{name}")
    return found


def build_graph(root: Path) -> Graph:
    graph = Graph(root=root, modules=find_modules(root))
    for module, path in graph.modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = graph.edges.setdefault(module, {})
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for base, name in _imported(node, module, path.name == "__init__.py"):
                for target in _targets(graph.modules, base, name):
                    if target == module:
                        continue
                    if target not in graph.modules:
                        graph.unknown.append(f"{graph.where(module, node.lineno)}: imports {target}, no such module")
                        continue
                    edges.setdefault(target, node.lineno)
    return graph


def back_edges(graph: Graph) -> list[str]:
    """Every import of a higher layer, as ``file:line: module (layer) imports module (layer)``."""
    found = []
    for module, targets in sorted(graph.edges.items()):
        mine = layer_of(module)
        for target, line in sorted(targets.items(), key=lambda item: item[1]):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(
                    f"{graph.where(module, line)}: {module} (layer {mine} {LAYERS[mine]}) imports "
                    f"{target} (layer {theirs} {LAYERS[theirs]})"
                )
    return found


def _components(edges: dict[str, dict[str, int]]) -> Iterable[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                yield sorted(component)


def _cycle_through(edges: dict[str, dict[str, int]], members: list[str]) -> list[str]:
    """One cycle inside a strongly connected component, from its first member back to it (breadth first)."""
    inside = set(members)
    start = members[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(edges.get(node, ())):
            if child == start:
                return [*paths[node], start]
            if child in inside and child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {members}")  # cannot happen in a component of two or more


def cycles(graph: Graph) -> list[str]:
    """Each circle of imports, as ``a (file:line) -> b (file:line) -> a``."""
    found = []
    for members in _components(graph.edges):
        if len(members) < 2:
            continue
        cycle = _cycle_through(graph.edges, members)
        steps = [f"{a} ({graph.where(a, graph.edges[a][b])})" for a, b in itertools.pairwise(cycle)]
        found.append(" -> ".join([*steps, cycle[-1]]) + f"  [{len(members)} modules in the circle: {members}]")
    return found


def problems(root: Path) -> list[str]:
    graph = build_graph(root)
    return [*back_edges(graph), *cycles(graph)]


# ---------------------------------------------------------------------------------------------- the package
@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph(ROOT)


def test_every_module_is_in_a_layer(graph: Graph) -> None:
    assert len(graph.modules) > 100  # the walk found the package
    outside = [f"{path.relative_to(ROOT)} ({name})" for name, path in graph.modules.items() if layer_of(name) is None]
    assert outside == [], "modules outside the layer map:\n" + "\n".join(outside)
    assert set(graph.modules) >= CLI_MODULES, "a CLI module named in the layer map is gone"


def test_imports_name_modules_that_exist(graph: Graph) -> None:
    assert graph.unknown == [], "\n".join(graph.unknown)


def test_no_module_imports_a_higher_layer(graph: Graph) -> None:
    found = back_edges(graph)
    assert found == [], "imports of a higher layer (docs/architecture.md):\n" + "\n".join(found)


def test_no_import_cycles(graph: Graph) -> None:
    found = cycles(graph)
    assert found == [], "import cycles:\n" + "\n".join(found)


def test_the_walk_parses_each_module_once(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    parse = ast.parse

    def counted(source: str, filename: str = "<unknown>", *args, **kwargs) -> ast.Module:
        parsed.append(filename)
        return parse(source, filename, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", counted)
    problems(ROOT)
    assert sorted(parsed) == sorted(str(path) for path in find_modules(ROOT).values())


# ---------------------------------------------------------------------------------------------- the checker
def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_planted_back_edge_is_reported_with_its_file_line_and_layers(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/spec.py": "X = 1\n",
            "core/registry.py": (
                "from typing import TYPE_CHECKING\n"
                "from model_support.core.spec import X\n"
                "if TYPE_CHECKING:\n"
                "    from model_support.validation.stage import Stage\n"
            ),
            "core/cli.py": "from model_support.validation import stage\n",  # the CLI may import anything
            "kernels/__init__.py": "",
            "validation/__init__.py": "",
            "validation/stage.py": "from model_support.core.spec import X\n",
            "plugins/__init__.py": "",
            "plugins/builtin.py": "def f():\n    from ..validation.stage import Stage\n",  # relative, in a function
            "plugins/model-support-x/src/x/__init__.py": "from model_support.validation import stage\n",  # excluded
            "plugins/template/{{cookiecutter.name}}/x.py": "from model_support.validation import stage\n",  # excluded
        },
    )
    found = problems(root)
    assert found == [
        "core/registry.py:4: model_support.core.registry (layer 1 core) imports "
        "model_support.validation.stage (layer 3 harness)",
        "plugins/builtin.py:2: model_support.plugins.builtin (layer 2 plugins) imports "
        "model_support.validation.stage (layer 3 harness)",
    ]


def test_a_planted_cycle_is_reported(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "kernels/__init__.py": "from model_support.kernels.gdn import f\n",
            "kernels/gdn.py": "def f():\n    from model_support.kernels import g\n",  # g: a name of the package
            "kernels/other.py": "from . import gdn\n",
            "core/__init__.py": "",
        },
    )
    found = problems(root)
    assert len(found) == 1
    assert found[0].startswith(
        "model_support.kernels (kernels/__init__.py:1) -> model_support.kernels.gdn (kernels/gdn.py:2) -> "
        "model_support.kernels"
    )
