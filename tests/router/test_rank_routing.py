"""router.routing.rank_routing: the per-rank board a router polls and orders targets by.

The replicas here are fakes (``FakeHandle``: no engine, a scripted ``load`` answer); the
live app is tests/e2e/test_serving_dp_routing.py.
"""

from __future__ import annotations

import asyncio

from dsv3serve.kvcache.prefix_hash import page_prefix_hashes
from router.routing.policy import ReplicaSet
from router.routing.rank_policy import RoutingWeights
from router.routing.rank_routing import RankBoard
from workers.protocol import RankLoad, WorkerLoad

PAGE = 4
PROMPT = list(range(1, 19))  # 4 full pages of the first 17 tokens


class FakeHandle:
    """A replica stand-in whose ``load`` answer is set by the test (None: it is dead;
    ``slow``: it does not answer in time)."""

    def __init__(self, ranks: list[RankLoad] | None, slow: bool = False) -> None:
        self.ranks, self.slow = ranks, slow


def load_of(rank: int, running: int = 0, hashes: list[int] | None = None) -> RankLoad:
    return RankLoad(
        dp_rank=rank, running=running, waiting=0, free_pages=64, num_pages=64,
        prefix_hashes=hashes or [],
    )  # fmt: skip


async def fake_fetch(handle: FakeHandle) -> WorkerLoad:
    if handle.slow:
        raise TimeoutError("load did not answer within LOAD_TIMEOUT_S")
    if handle.ranks is None:
        raise ConnectionError("replica gone")
    return WorkerLoad(
        role="decode", running=0, waiting=0, free_pages=0, num_pages=1, ranks=handle.ranks
    )


def board(handles: list[FakeHandle], per_request: float = 8.0) -> RankBoard:
    replicas = ReplicaSet([f"decode-{i}" for i in range(len(handles))], handles)
    return RankBoard(replicas, PAGE, RoutingWeights(per_request, 0.0), 10.0, fake_fetch)


def test_reported_ranks_are_scored_and_unreported_replicas_come_last() -> None:
    hit = page_prefix_hashes(PROMPT, PAGE)[:2]  # 2 pages cached on replica 0 rank 1
    handles = [FakeHandle([load_of(0, running=1), load_of(1, hashes=hit)]), FakeHandle(None)]
    b = board(handles)
    asyncio.run(b.refresh())
    assert sorted(b.reports) == [0]
    order = asyncio.run(_order(b, PROMPT))
    assert order == [(0, 1), (0, 0), (1, None)]


def test_requests_this_router_sent_count_until_a_report_shows_them() -> None:
    """Between polls, two requests sent to rank 0 make rank 1 the less loaded one."""
    b = board([FakeHandle([load_of(0), load_of(1)])])
    asyncio.run(b.refresh())
    assert asyncio.run(_order(b, [7, 8, 9]))[0] == (0, 0)
    b.acquire(0, 0)
    assert asyncio.run(_order(b, [7, 8, 9]))[0] == (0, 1)
    b.release(0, 0)
    assert asyncio.run(_order(b, [7, 8, 9]))[0] == (0, 0) and not b.inflight


def test_a_request_that_ended_since_the_poll_no_longer_weighs_on_its_rank() -> None:
    """Rank 1's report still counts this router's request that has just ended there; a
    burst sent now must not all go to rank 0 (the report is stale until the next poll)."""
    handles = [FakeHandle([load_of(0), load_of(1)])]
    b = board(handles)
    asyncio.run(b.refresh())
    b.acquire(0, 1)  # a request runs on rank 1 ...
    handles[0].ranks = [load_of(0), load_of(1, running=1)]
    asyncio.run(b.refresh())  # ... and is reported
    b.release(0, 1)  # it ended; no poll since
    b.acquire(0, 0)  # the first of a burst went to rank 0
    assert asyncio.run(_order(b, [7, 8, 9]))[0] == (0, 1)
    b.release(0, 0, ended=False)  # only asked, never ran: no correction
    handles[0].ranks = [load_of(0), load_of(1)]
    asyncio.run(b.refresh())  # the next report no longer counts it: nothing to correct
    assert not b.ended and not b.inflight
    assert asyncio.run(_order(b, [7, 8, 9])) == [(0, 0), (0, 1)]


def test_a_slow_replica_keeps_its_last_reports_and_a_failed_one_drops_out() -> None:
    handles = [FakeHandle([load_of(0, running=3), load_of(1)]), FakeHandle([load_of(0)])]
    b = board(handles)
    asyncio.run(b.refresh())
    handles[0].slow = True  # a long step holds its engine: the poll times out
    handles[1].ranks = None  # its call fails: gone
    asyncio.run(b.refresh())
    assert sorted(b.reports) == [0] and [r.running for r in b.reports[0]] == [3, 0]
    assert asyncio.run(_order(b, [7, 8, 9])) == [(0, 1), (0, 0), (1, None)]


def test_a_down_replica_is_tried_after_every_reported_one() -> None:
    b = board([FakeHandle([load_of(0)]), FakeHandle([load_of(0, running=5)])])
    asyncio.run(b.refresh())
    b.replicas.down.add(0)
    assert asyncio.run(_order(b, PROMPT)) == [(1, 0), (0, None)]


async def _order(b: RankBoard, prompt: list[int]) -> list[tuple[int, int | None]]:
    order = b.order(prompt)  # starts the background poll: stop it again
    assert b._task is not None
    b._task.cancel()
    return order


def test_a_replica_out_of_the_set_is_neither_polled_nor_chosen() -> None:
    """A deployment scaled to zero must get no ``load`` poll: a call would make Serve
    start it again. Its reports go; when it joins again it is polled and scored."""
    handles = [FakeHandle([load_of(0)]), FakeHandle([load_of(0, running=5)])]
    b = board(handles)
    asyncio.run(b.refresh())
    b.replicas.set_members({"decode-0": 0})
    handles[0].ranks = None  # polled now, it would fail: it must not be polled
    asyncio.run(b.refresh())
    assert sorted(b.reports) == [1]
    assert asyncio.run(_order(b, PROMPT)) == [(1, 0)]
    handles[0].ranks = [load_of(0)]
    b.replicas.set_members({"decode-0": 1})
    asyncio.run(b.refresh())
    assert asyncio.run(_order(b, PROMPT)) == [(0, 0), (1, 0)]
