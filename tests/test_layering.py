"""The import layers: no upward import, no import cycle, a router without torch.

The order is written once, in ``LAYERS`` (bottom first). A module may import its own
group and any group of a lower layer; groups that share a layer are peers and import
neither each other nor anything above. Every import counts: module level, inside a
function, and under ``if TYPE_CHECKING:``, for the layer order and for cycles alike (a
subcommand that loads its runner inside a function still depends on it, so the runner
must not import the subcommand back).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from import_graph import Import, cycles, import_graph, parents, project_modules

LAYERS: tuple[tuple[str, ...], ...] = (
    ("dsv3serve.json_types",),  # the JSON type aliases and their checked readers
    ("dsv3serve", "dsv3serve.settings", "dsv3serve.config", "dsv3serve.metrics"),
    ("dsv3serve.tokenizer",),
    ("dsv3serve.parsers",),
    ("dsv3serve.sampling",),  # the request vocabulary: SamplingParams, Constraint, stop rules
    ("dsv3serve.kernels", "dsv3serve.kvcache"),
    ("dsv3serve.eplb",),  # expert placement, the logical -> physical id map, load counts
    ("dsv3serve.parallel",),  # layouts, the shard rule, collectives, dispatch / combine
    ("dsv3serve.page_table", "dsv3serve.layers"),
    ("dsv3serve.forward_batch",),
    ("dsv3serve.attention", "dsv3serve.moe"),
    ("dsv3serve.model",),
    ("dsv3serve.plan",),  # the memory planner (the checkpoint's shapes through the rule)
    ("dsv3serve.engine",),
    ("kv_transfer",),
    ("workers",),
    ("router",),
    ("dsv3serve.bench",),  # tooling drives every layer below it
    ("dsv3serve.cli",),  # the `dsv3serve` command: `serve` starts the router
)

TORCH_FREE = ("router",)  # packages whose import must not load torch


def _group(module: str) -> str | None:
    """The longest ``LAYERS`` group that ``module`` is or is inside of."""
    names = [name for layer in LAYERS for name in layer]
    inside = [n for n in names if module == n or module.startswith(n + ".")]
    return max(inside, key=len) if inside else None


def _layer(group: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def _allowed(imp: Import) -> bool:
    source, target = _group(imp.source), _group(imp.target)
    if target is None or source == target:  # third-party, or within its own group
        return True
    return _layer(target) < _layer(source)


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    return import_graph()


def test_every_module_has_a_layer() -> None:
    missing = [m for m in project_modules() if _group(m) is None]
    assert not missing, f"expected every module in a LAYERS group, found none for {missing}"


def test_no_upward_or_sideways_import(graph: dict[str, list[Import]]) -> None:
    wrong = [str(imp) for imps in graph.values() for imp in imps if not _allowed(imp)]
    assert not wrong, "expected imports of lower layers only, found:\n" + "\n".join(wrong)


def _edges(graph: dict[str, list[Import]]) -> dict[str, set[str]]:
    """The project imports of every module: module level, function-local, ``TYPE_CHECKING``."""
    return {module: {i.target for i in imps if i.target in graph} for module, imps in graph.items()}


def test_no_import_cycle(graph: dict[str, list[Import]]) -> None:
    found = cycles(_edges(graph))
    shown = "\n".join(" <-> ".join(c) for c in found)
    assert not found, f"expected no import cycle, found:\n{shown}"


def _loaded_by(start: str, graph: dict[str, list[Import]]) -> dict[str, Import]:
    """Every name importing ``start`` loads (module level), with the import that did."""
    reached: dict[str, Import] = {}
    todo = [start, *parents(start)]
    while todo:
        module = todo.pop()
        for imp in graph.get(module, []):
            if imp.where == "module" and imp.target not in reached:
                reached[imp.target] = imp
                todo += [imp.target, *parents(imp.target)]
    return reached


def _chain(target: str, reached: dict[str, Import]) -> str:
    """How ``target`` was reached, as a path of import lines."""
    steps = [reached[target]]
    while steps[-1].source in reached and len(steps) < 50:
        steps.append(reached[steps[-1].source])
    return " <- ".join(str(step) for step in steps)


@pytest.mark.parametrize("package", TORCH_FREE)
def test_package_does_not_load_torch(package: str, graph: dict[str, list[Import]]) -> None:
    heavy = []
    for module in (m for m in graph if m == package or m.startswith(package + ".")):
        reached = _loaded_by(module, graph)
        if "torch" in reached:
            heavy.append(_chain("torch", reached))
    assert not heavy, f"expected {package} to import without torch, found:\n" + "\n".join(heavy)


def test_protocol_and_router_stay_torch_free() -> None:
    """The same at run time, third-party imports included (a fresh interpreter)."""
    code = (
        "import sys, workers.protocol, router.pd.backend, router.app;"
        " sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_scheduler_room_imports_no_other_engine_module(graph: dict[str, list[Import]]) -> None:
    """``engine/scheduler/`` is pure bookkeeping over the KV cache: of the engine it
    imports only itself (the engine imports it, never the other way)."""
    room = "dsv3serve.engine.scheduler"
    wrong = [
        str(imp)
        for module, imps in graph.items()
        if _inside(module, room)
        for imp in imps
        if _inside(imp.target, "dsv3serve.engine") and not _inside(imp.target, room)
    ]
    shown = "\n".join(wrong)
    assert not wrong, f"expected {room} to import no other engine module, found:\n{shown}"


def _documented_layers() -> tuple[tuple[str, ...], ...]:
    """The layer block of docs/architecture.md ("## Layers"), one tuple of groups a line."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    layers = []
    for line in block.strip().splitlines():
        names = line.split("  ", 1)[0].replace("(package)", "")  # drop the comment column
        layers.append(tuple(name.strip() for name in names.split(",")))
    return tuple(layers)


def test_architecture_page_lists_the_same_layers() -> None:
    """docs/architecture.md's layer order is the one this test enforces."""
    assert _documented_layers() == LAYERS
