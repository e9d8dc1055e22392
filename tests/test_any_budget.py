"""How many annotations name ``Any`` in runtime code: at most half of the 241 of issue 30.

Runtime code is every module of ``dsv3serve`` (but ``dsv3serve/bench``), ``router``,
``workers`` and ``kv_transfer``. An annotation counts once when it names ``Any`` anywhere
in it (``dict[str, Any]`` counts): a function's parameters (``*args`` and ``**kwargs``
too) and return, and every annotated assignment (module, class or function level).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dsv3serve", "router", "workers", "kv_transfer")
BUDGET = 241 // 2


def _names_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    return any(
        (isinstance(n, ast.Name) and n.id == "Any")
        or (isinstance(n, ast.Attribute) and n.attr == "Any")
        or (isinstance(n, ast.Constant) and isinstance(n.value, str) and "Any" in n.value)
        for n in ast.walk(annotation)
    )


def _annotations(tree: ast.Module) -> list[ast.expr | None]:
    found: list[ast.expr | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            found += [p.annotation for p in params] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
    return found


def any_annotations() -> dict[str, int]:
    """Annotations naming ``Any``, by runtime file (relative path), files with none left out."""
    counts: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("dsv3serve", "bench"):
                continue
            n = sum(map(_names_any, _annotations(ast.parse(path.read_text()))))
            if n:
                counts[rel.as_posix()] = n
    return counts


def test_the_counter_sees_each_kind_of_annotation() -> None:
    source = (
        "def f(a: Any, *b: int, **c: Any) -> dict[str, Any]:\n"
        "    x: list[Any] = []\n"
        "y: typing.Any\n"
        "z: 'Any | None'\n"
        "def g(a: int) -> str: ...\n"
    )
    assert sum(map(_names_any, _annotations(ast.parse(source)))) == 6


def test_runtime_code_names_any_at_most_half_as_often_as_in_issue_30() -> None:
    counts = any_annotations()
    worst = sorted(counts.items(), key=lambda kv: -kv[1])[:10]
    assert sum(counts.values()) <= BUDGET, (
        f"expected at most {BUDGET} annotations naming Any in runtime code, found "
        f"{sum(counts.values())}; most in: {worst}"
    )
