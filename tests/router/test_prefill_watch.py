"""router/pd/prefill_watch.py: a prefill is given up when its replica stalls, not when it is
busy. The replica's progress answers are scripted (a fake replica); the work is a real
asyncio future that ends when the script says so. Then router/pd/backend.py's retry over a fake
replica handle: it gets its wait for the replica to come back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from dsv3serve.sampling.sampling_params import SamplingParams
from router.config import RouterSettings
from router.pd.backend import PDBackend
from router.pd.prefill_watch import PrefillStalled, until_stalled
from router.routing.policy import ReplicaSet
from workers.protocol import (
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    TokenChunk,
    WorkerLoad,
    WorkerProgress,
    encode,
)
from workers.protocol import decode as parse

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


# ---- the retry's wait (router/pd/backend.py's PDBackend._prefill over fake replica handles)
RETRY_WAIT_S = 5.0  # the bound on waiting for the replica to come back
FIRST_TRY_S = RETRY_WAIT_S + 1.0  # the first try outlives it: a long prompt, then a crash


class FakeRemote:
    """A Serve handle method: ``remote(*args)`` runs ``fn(*args)`` as a task (awaitable,
    cancellable, like Ray's response)."""

    def __init__(self, fn: Callable[..., Awaitable[bytes | None]]) -> None:
        self.fn = fn

    def remote(self, *args: object) -> asyncio.Task[bytes | None]:
        return asyncio.ensure_future(self.fn(*args))


class FakePrefillReplica:
    """A prefill replica whose first try runs FIRST_TRY_S, stepping all along, then dies
    with it (as ActorDiedError would); Serve restarted it at once, so it answers ``load``
    and the next try succeeds."""

    def __init__(self) -> None:
        self.tries = 0
        self.prefill = FakeRemote(self._prefill)
        self.progress = FakeRemote(self._progress)
        self.load = FakeRemote(self._load)
        self.release_kv = FakeRemote(self._release)

    async def _prefill(self, msg: bytes) -> bytes:
        self.tries += 1
        if self.tries == 1:
            await asyncio.sleep(FIRST_TRY_S)  # the replica's work, not a synchronisation
            raise RuntimeError("the replica died")
        rid = parse(PrefillRequest, msg).request.request_id
        first = TokenChunk(request_id=rid, token_ids=[7], finished=True, finish_reason="length")
        return encode(PrefillResult(first=first, kv=None))

    async def _progress(self) -> bytes:
        return encode(WorkerProgress(steps=self.tries, stepping=True))

    async def _load(self) -> bytes:
        return encode(WorkerLoad(role="prefill", running=0, waiting=0, free_pages=1, num_pages=1))

    async def _release(self, attempt_id: str) -> None:
        return None


def test_the_retry_gets_its_wait_after_a_long_first_try() -> None:
    """The wait for a replica to come back starts when a try finds none up, not with the
    first try: a first try longer than prefill_retry_wait_s left the retry no wait at all
    (503 'not back within prefill_retry_wait_s' although the replica was back)."""
    settings = RouterSettings(
        policy="least_outstanding", prefill_retry_wait_s=RETRY_WAIT_S, max_prefill_attempts=2
    )
    replica = FakePrefillReplica()

    async def run() -> str:
        prefill = ReplicaSet(["prefill-0"], [replica])
        decode = ReplicaSet(["decode-0"], [object()])
        backend = PDBackend(prefill, decode, settings, 4, None, overlap=False)  # type: ignore[arg-type]
        params = SamplingParams(temperature=0, max_new_tokens=1)
        req = GenerateRequest(request_id="long", prompt_ids=[1, 2, 3], params=params)
        prefilled = await backend._prefill(req)
        return prefilled.attempt_id

    assert asyncio.run(run()).startswith("long.p1.") and replica.tries == 2
