"""The engine's seams (``engine/protocols.py``) are met by what passes through them.

``EngineCore`` and ``Engine`` are typed with :class:`StepScheduler` and
:class:`StepRunner`; the classes handed to them must have every member the Protocol
names, taking the same parameters (more only with defaults). A structural check: no
type checker runs in CI.
"""

from __future__ import annotations

import inspect

import pytest
from engine_util import make_engine

from dsv3serve.engine.group.dp import DPGroupLeader
from dsv3serve.engine.group.tp import GroupLeader
from dsv3serve.engine.protocols import StepRunner, StepScheduler
from dsv3serve.engine.scheduler.dp import DPScheduler
from dsv3serve.engine.scheduler.scheduler import Scheduler
from dsv3serve.engine.scheduler.sequence import SchedulerConfig


def _members(protocol: type) -> dict[str, object]:
    """The Protocol's own methods, properties and annotated attributes."""
    own = {n: v for n, v in vars(protocol).items() if not n.startswith("_")}
    return {**dict.fromkeys(protocol.__annotations__), **own}


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def _accepts(member: object, found: object) -> bool:
    """``found`` takes ``member``'s parameters in order; any more have defaults."""
    want, got = _params(member), inspect.signature(found).parameters  # type: ignore[arg-type]
    extra = list(got.values())[len(want) :]
    return list(got)[: len(want)] == want and all(p.default is not p.empty for p in extra)


def _mismatches(protocol: type, impl: object) -> list[str]:
    """Members of ``protocol`` that ``impl`` lacks, or whose parameters differ."""
    wrong = []
    for name, member in _members(protocol).items():
        if not hasattr(impl, name):
            wrong.append(f"{name}: missing")
            continue
        found = inspect.getattr_static(impl, name)
        if inspect.isfunction(member) and not _accepts(member, found):
            wrong.append(f"{name}: expected {_params(member)}, got {_params(found)}")
    return wrong


@pytest.mark.parametrize(
    "scheduler",
    [
        Scheduler(SchedulerConfig(page_size=4, num_pages=16)),
        DPScheduler(SchedulerConfig(page_size=4, num_pages=16), dp_size=2),
    ],
    ids=["Scheduler", "DPScheduler"],
)
def test_both_schedulers_meet_the_step_scheduler_seam(scheduler: object) -> None:
    assert not _mismatches(StepScheduler, scheduler)


@pytest.mark.parametrize("leader", [GroupLeader, DPGroupLeader])
def test_group_leaders_meet_the_step_runner_seam(leader: type) -> None:
    assert not _mismatches(StepRunner, leader)


def test_model_runner_meets_the_step_runner_seam() -> None:
    assert not _mismatches(StepRunner, make_engine().runner)


def test_the_check_finds_a_missing_member() -> None:
    class Partial:
        def schedule(self) -> None: ...

    assert "add: missing" in _mismatches(StepScheduler, Partial())
