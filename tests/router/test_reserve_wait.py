"""How long a request waits for decode KV room (router/pd/room_signal.RoomDeadline, used by
PDBackend._reserve): it is refused only once no room has been freed for
``router.reserve_wait_s``, however long the decode side stays busy, and never later than
``router.reserve_max_wait_s``.

The decode replica is a scripted stand-in (``FakeDecodeReplica``): these cases need a
replica that is full for an exact number of asks while its streams end, which a real one
cannot be made to be. The real app's overload is tests/e2e/test_serving_faults.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from dsv3serve.sampling.sampling_params import SamplingParams
from router.config import RouterSettings
from router.pd.backend import PDBackend
from router.pd.room_signal import RoomDeadline
from router.routing.policy import ReplicaSet
from workers.backend import BackendOverloaded
from workers.protocol import GenerateRequest, ReserveRequest, ReserveResult, encode
from workers.protocol import decode as parse

IDLE_S = 0.4  # reserve_wait_s: shorter than the whole wait the busy replica makes


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr("router.pd.room_signal.time.monotonic", fake)
    return fake


def test_the_idle_time_out_restarts_with_each_sign_of_freed_room(clock: FakeClock) -> None:
    deadline = RoomDeadline(idle_s=5.0, max_s=60.0)
    deadline.saw(0, 10)  # the first refusal only sets the replica's baseline
    clock.now += 4.0
    assert deadline.left() == pytest.approx(1.0) and deadline.progressed == 0
    deadline.saw(0, 10)  # no stream ended there since
    assert deadline.left() == pytest.approx(1.0)
    deadline.saw(1, 3)  # another replica's baseline
    deadline.saw(0, 12)  # two streams ended: progress
    assert deadline.left() == pytest.approx(5.0) and deadline.progressed == 1
    clock.now += 4.0
    deadline.progress()  # a request ended at this router
    assert deadline.left() == pytest.approx(5.0) and deadline.progressed == 2
    clock.now += 5.0
    assert deadline.left() <= 0
    assert "reserve_wait_s" in deadline.refusal()


def test_progress_never_extends_past_the_hard_limit(clock: FakeClock) -> None:
    deadline = RoomDeadline(idle_s=5.0, max_s=12.0)
    for ended in range(1, 6):
        clock.now += 3.0
        deadline.saw(0, ended)
    assert clock.now == 115.0 and deadline.left() == pytest.approx(-3.0)
    assert "reserve_max_wait_s" in deadline.refusal()


class FakeRemote:
    """A Serve handle method: ``remote(*args)`` runs ``fn(*args)`` as a task."""

    def __init__(self, fn: Callable[..., Awaitable[bytes | None]]) -> None:
        self.fn = fn

    def remote(self, *args: object) -> asyncio.Task[bytes | None]:
        return asyncio.ensure_future(self.fn(*args))


class FakeDecodeReplica:
    """A decode replica full for its first ``full_asks`` reserve calls, then with room;
    each refusal reports a ``progress`` count growing by ``progress_per_ask`` per call
    (0: a stuck replica, which neither steps nor ends streams)."""

    def __init__(self, full_asks: int, progress_per_ask: int) -> None:
        self.full_asks, self.progress_per_ask = full_asks, progress_per_ask
        self.asks = 0
        self.reserve = FakeRemote(self._reserve)
        self.cancel_reservation = FakeRemote(self._cancel)

    async def _reserve(self, data: bytes) -> bytes:
        parse(ReserveRequest, data)
        self.asks += 1
        if self.asks <= self.full_asks:
            return encode(ReserveResult(ok=False, progress=self.asks * self.progress_per_ask))
        return encode(ReserveResult(ok=True, num_pages=1))

    async def _cancel(self, request_id: str) -> None:
        return None


def reserve(replica: FakeDecodeReplica, max_wait_s: float = 60.0) -> tuple[int, int, int]:
    settings = RouterSettings(
        policy="least_outstanding", reserve_wait_s=IDLE_S, reserve_max_wait_s=max_wait_s
    )

    async def run() -> tuple[int, int, int]:
        prefill = ReplicaSet(["prefill-0"], [object()])
        decode = ReplicaSet(["decode-0"], [replica])
        backend = PDBackend(prefill, decode, settings, 4, None, overlap=False)  # type: ignore[arg-type]
        params = SamplingParams(temperature=0, max_new_tokens=4)
        req = GenerateRequest(request_id="waits", prompt_ids=[1, 2, 3], params=params)
        return await backend._reserve(req)

    return asyncio.run(run())


def test_a_busy_decode_replica_keeps_its_waiters_past_reserve_wait_s() -> None:
    """Six refusals take 0.05 + 0.1 + 0.2 + 0.4 + 0.4 s of back-off, longer than
    reserve_wait_s; the replica steps and ends streams all along, so the request waits and gets
    its room (before: 429 after reserve_wait_s from the first ask)."""
    replica = FakeDecodeReplica(full_asks=6, progress_per_ask=2)
    assert reserve(replica) == (0, 0, 0)
    assert replica.asks == 7


def test_a_stuck_decode_replica_refuses_after_reserve_wait_s() -> None:
    replica = FakeDecodeReplica(full_asks=1000, progress_per_ask=0)
    with pytest.raises(BackendOverloaded, match="none made progress"):
        reserve(replica)
    assert 2 <= replica.asks < 1000


def test_the_hard_limit_refuses_a_waiter_while_room_is_still_being_freed() -> None:
    replica = FakeDecodeReplica(full_asks=1000, progress_per_ask=1)
    with pytest.raises(BackendOverloaded, match="reserve_max_wait_s"):
        reserve(replica, max_wait_s=0.6)
