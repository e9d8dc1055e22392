"""Shared fixtures: tiny checkpoints written once per session, and model helpers; on a
machine without a GPU, Triton's interpreter for the kernel tests.

The tests mirror the packages (``tests/engine/`` with its rooms ``scheduler/``,
``speculative/`` and ``group/``, ``tests/router/``, ``tests/workers/``, ...); live
end-to-end tests that start an app are in ``tests/e2e/``. Helpers and fakes
live in ``tests/support/``. Test modules import helpers (and a few other test modules'
helpers) by module name, so ``support/`` and every test folder go on ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # no GPU: our Triton kernels run on CPU tensors through Triton's interpreter, which reads
    # this when triton is first imported (the *_interp.py tests skip without it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv3serve.model.tiny import make_tiny_checkpoint

_TESTS = Path(__file__).resolve().parent
_FOLDERS = (p for p in _TESTS.rglob("*") if p.is_dir() and p.name.isidentifier())
for _folder in sorted(_FOLDERS):  # rooms inside a folder too (tests/engine/speculative/)
    if str(_folder) not in sys.path and not {"data", "__pycache__"} & set(_folder.parts):
        sys.path.insert(0, str(_folder))

from fresh_seed import draw_session_seed  # noqa: E402  (tests/support is on the path now)

draw_session_seed()  # in xdist's controller before it starts its workers: they inherit it


# Tests that start a Ray cluster (in this process or a child): under pytest-xdist they are
# one unit of work, run one after another on one worker (``ray_group_scheduling``).
RAY_MODULES = ("tests/e2e/", "tests/bench/test_chaos_connect.py", "tests/router/test_launch.py")
RAY_TESTS = ("test_deploy_configs.py::test_serve_command_starts_the_default_pd_app_and_answers",)


def starts_ray(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (relative to the repository root) starts a Ray cluster."""
    return nodeid.startswith(RAY_MODULES) or nodeid.split("[")[0].endswith(RAY_TESTS)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``-n N``: the Ray tests as one unit of work, the rest a module at a time."""
    if config.getoption("dist") not in ("load", "loadscope", "loadgroup"):
        return None
    from ray_group_scheduling import ray_scheduler

    return ray_scheduler(starts_ray)(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip cleanly where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_bf16"), fp8=False)


@pytest.fixture(scope="session")
def tiny_fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_fp8"), fp8=True)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny ops run faster on one thread than on two OpenMP threads sharing a busy 2-core
    box; use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def scenario_reference(tiny_bf16_dir: Path) -> dict[str, list[int]]:
    """The one-rank engine's greedy tokens on the group scenario (``group_scenario``), run
    once for every module that compares a layout with it; the scenario must preempt and
    hit the prefix cache, or it would not test what it is for."""
    from group_scenario import SCENARIO_ENGINE, assert_no_leaks, run_scenario

    from dsv3serve.engine.config import EngineConfig
    from dsv3serve.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_bf16_dir), **SCENARIO_ENGINE))
    assert engine.runner.graphs is None
    tokens = run_scenario(engine)
    assert_no_leaks(engine)
    assert engine.scheduler.num_preemptions > 0, "the scenario must preempt"
    assert engine.scheduler.prefix_hit_tokens > 0, "the scenario must hit the prefix cache"
    return tokens
