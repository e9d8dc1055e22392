"""router/prefill_watch.py: a prefill is given up when its replica stalls, not when it is
busy. The replica's progress answers are scripted (a fake replica); the work is a real
asyncio future that ends when the script says so."""

from __future__ import annotations

import asyncio

import pytest

from router.prefill_watch import PrefillStalled, until_stalled
from workers.protocol import WorkerProgress

STALL_S = 0.01  # a window: the outcomes below do not depend on how long it is


class FakeReplica:
    """Answers progress checks from ``answers`` (None: never answers); the prefill's work
    ends after ``done_after`` checks."""

    def __init__(self, answers: list[WorkerProgress | None], done_after: int | None) -> None:
        self.answers, self.done_after, self.checks = answers, done_after, 0
        self.work: asyncio.Future[str] | None = None

    async def progress(self) -> WorkerProgress:
        answer = self.answers[min(self.checks, len(self.answers) - 1)]
        self.checks += 1
        if self.checks == self.done_after and self.work is not None:
            self.work.set_result("prefilled")
        if answer is None:
            await asyncio.Event().wait()
        assert answer is not None
        return answer

    async def watch(self, ceiling_s: float = 600.0) -> str:
        self.work = asyncio.get_running_loop().create_future()
        return await until_stalled(self.work, self.progress, STALL_S, ceiling_s)


def step(steps: int, stepping: bool = False) -> WorkerProgress:
    return WorkerProgress(steps=steps, stepping=stepping)


def test_a_replica_in_one_long_step_is_busy_not_stalled() -> None:
    replica = FakeReplica([step(3, stepping=True)], done_after=50)
    assert asyncio.run(replica.watch()) == "prefilled"


def test_a_replica_finishing_steps_is_busy_not_stalled() -> None:
    replica = FakeReplica([step(k) for k in range(60)], done_after=50)
    assert asyncio.run(replica.watch()) == "prefilled"


def test_an_idle_engine_over_a_whole_window_is_stalled() -> None:
    with pytest.raises(PrefillStalled, match="finished no step"):
        asyncio.run(FakeReplica([step(7)], done_after=None).watch())


def test_an_unanswered_progress_check_is_stalled() -> None:
    with pytest.raises(PrefillStalled, match="did not answer"):
        asyncio.run(FakeReplica([None], done_after=None).watch())


def test_the_ceiling_bounds_a_busy_replica() -> None:
    with pytest.raises(PrefillStalled, match="prefill_timeout_s"):
        asyncio.run(FakeReplica([step(1, stepping=True)], done_after=None).watch(0.05))
