"""The project's import graph, read from the source (AST) without importing anything.

Every ``import`` / ``from ... import`` statement of every module counts, with where it
sits: at module level (runs on import), inside a function (runs on call) or under
``if TYPE_CHECKING:`` (never runs). Relative imports are resolved.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dsv3serve", "kv_transfer", "workers", "router")
Where = Literal["module", "function", "type_checking"]


@dataclass(frozen=True)
class Import:
    """One imported name: ``target`` is a project module or a third-party top name."""

    source: str
    target: str
    line: int
    where: Where

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target} ({self.where})"


def project_modules() -> dict[str, Path]:
    """Module name -> file, for every .py file under the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, where: Where) -> Iterator[tuple[ast.Import | ast.ImportFrom, Where]]:
    """Every import statement under ``node`` with where it runs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, where
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, "function" if where == "module" else where)
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "type_checking")
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), where)
        else:
            yield from _walk(child, where)


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest project module that ``name`` starts with, else the top-level name."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return parts[0]


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names a statement imports (``from a import b``: ``a.b`` and ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{alias.name}" for alias in node.names]


def imports_of(module: str, modules: dict[str, Path]) -> list[Import]:
    """Every import in ``module``, resolved to project modules where they are ones."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node, where in _walk(ast.parse(path.read_text(), str(path)), "module"):
        for name in _targets(node, package):
            target = _resolve(name, modules)
            if target != module:
                found.append(Import(module, target, node.lineno, where))
    return found


def import_graph() -> dict[str, list[Import]]:
    """Module -> its imports, for every project module."""
    modules = project_modules()
    return {module: imports_of(module, modules) for module in modules}


def parents(module: str) -> list[str]:
    """The packages whose ``__init__`` runs before ``module`` (``a.b.c``: ``a``, ``a.b``)."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)
