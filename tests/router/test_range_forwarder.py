"""The router's range forwarder: ranges of a running prefill go to decode in order; after a
failed pull, that range and every later one are kept for the handoff (``missed``)."""

from __future__ import annotations

import asyncio

from kv_transfer.handle import KVHandle
from router.pd.range_forwarder import RangeForwarder
from workers.protocol import PullRequest, PullResult, decode, encode


def kv_range(k: int) -> KVHandle:
    return KVHandle(
        request_id=f"r.p0.x.r{k}", connector="shm", num_tokens=4, num_pages=1, page_size=4,
        num_layers=1, kv_dim=576, dtype="bfloat16", nbytes=0, first_page=k,
    )  # fmt: skip


class _Method:
    def __init__(self, fn: object) -> None:
        self.remote = fn


class PullFailingDecodeFake:
    """Stands in for a decode replica's Serve handle whose ``pull_kv`` fails its
    ``fail_at``-th call (a transfer error there); real pulls are tested host to host in
    ``test_kv_overlap_host.py``."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.seen = fail_at, []
        self.pull_kv = _Method(self._pull)

    async def _pull(self, data: bytes) -> bytes:
        msg = decode(PullRequest, data)
        self.seen.append(msg.kv.first_page)
        await asyncio.sleep(0.01)
        if len(self.seen) - 1 == self.fail_at:
            return encode(PullResult(ok=False, error="KV range transfer failed: peer gone"))
        return encode(PullResult(ok=True))


def test_ranges_after_a_failed_pull_are_missed_in_order() -> None:
    fake = PullFailingDecodeFake(fail_at=1)

    async def run() -> RangeForwarder:
        fwd = RangeForwarder(fake, "r", "r.p0.x")
        for k in range(3):
            fwd.feed(kv_range(k))
        await fwd.drain()
        fwd.feed(kv_range(3))  # after the failure: not sent, kept for the handoff
        await fwd.drain()
        return fwd

    fwd = asyncio.run(run())
    assert fake.seen == [0, 1]
    assert [kv.first_page for kv in fwd.missed] == [1, 2, 3]
    assert fwd.failure is not None and "peer gone" in fwd.failure


def test_nothing_is_missed_when_every_pull_lands() -> None:
    fake = PullFailingDecodeFake(fail_at=-1)

    async def run() -> RangeForwarder:
        fwd = RangeForwarder(fake, "r", "r.p0.x")
        for k in range(3):
            fwd.feed(kv_range(k))
        await fwd.drain()
        return fwd

    fwd = asyncio.run(run())
    assert fake.seen == [0, 1, 2] and fwd.missed == [] and fwd.failure is None
