"""router/pd/room_signal.py: reservations waiting for decode KV room are woken one per
request the router ends, oldest first, and otherwise back off (real asyncio timers)."""

from __future__ import annotations

import asyncio

from router.pd.room_signal import RESERVE_RETRY_MAX_S, RESERVE_RETRY_S, RoomSignal, next_backoff

LONG_S = 30.0  # a wait that only a wake-up ends within the test


def test_one_freed_request_wakes_only_the_oldest_waiter() -> None:
    async def run() -> list[bool]:
        signal = RoomSignal()
        first = asyncio.create_task(signal.wait(LONG_S))
        await asyncio.sleep(0)
        second = asyncio.create_task(signal.wait(0.2))
        await asyncio.sleep(0)
        assert signal.waiting == 2
        signal.freed()
        return [await first, await second]

    assert asyncio.run(run()) == [True, False]


def test_a_waiter_that_gave_up_is_passed_over() -> None:
    async def run() -> tuple[bool, bool, int]:
        signal = RoomSignal()
        gone = await signal.wait(0.01)  # timed out: its future stays behind, done
        live = asyncio.create_task(signal.wait(LONG_S))
        await asyncio.sleep(0)
        signal.freed()
        return gone, await live, signal.waiting

    assert asyncio.run(run()) == (False, True, 0)


def test_freed_without_waiters_is_not_saved_for_later() -> None:
    async def run() -> bool:
        signal = RoomSignal()
        signal.freed()
        return await signal.wait(0.05)

    assert asyncio.run(run()) is False


def test_a_cancelled_waiter_leaves_nothing_waiting() -> None:
    async def run() -> int:
        signal = RoomSignal()
        task = asyncio.create_task(signal.wait(LONG_S))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return signal.waiting

    assert asyncio.run(run()) == 0


def test_the_back_off_doubles_up_to_its_cap() -> None:
    delays = [RESERVE_RETRY_S]
    for _ in range(8):
        delays.append(next_backoff(delays[-1]))
    assert delays[:3] == [RESERVE_RETRY_S, 2 * RESERVE_RETRY_S, 4 * RESERVE_RETRY_S]
    assert max(delays) == delays[-1] == RESERVE_RETRY_MAX_S
