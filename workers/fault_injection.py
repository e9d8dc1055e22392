"""Fault injection for tests: a KV connector whose pulls take longer than they need to.

A decode replica with ``test_receive_delay_s`` holds every transfer open that long before
it copies, so a test can act (hang up, kill) while a request is known to be mid-transfer.
Never set in a real deployment.
"""

from __future__ import annotations

import time

from kv_transfer.base import KVConnector
from kv_transfer.handle import KVHandle, TransferStats


class SlowReceiveConnector(KVConnector):
    """``inner`` with every :meth:`receive` started ``delay_s`` late; all else is ``inner``'s."""

    def __init__(self, inner: KVConnector, delay_s: float) -> None:
        super().__init__(inner.pool)
        self.inner, self.delay_s = inner, delay_s
        self.name = inner.name
        self.incremental = inner.incremental

    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        return self.inner.publish(request_id, pages, num_tokens)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def staged(self) -> int:
        return self.inner.staged()

    def receive(self, handle: KVHandle, dst_pages: list[int]) -> TransferStats:
        """Sleep ``delay_s`` (on the caller's transfer thread), then pull as ``inner`` does."""
        time.sleep(self.delay_s)
        return self.inner.receive(handle, dst_pages)

    def close(self) -> None:
        self.inner.close()


def with_receive_delay(connector: KVConnector | None, delay_s: float) -> KVConnector | None:
    """``connector``, slowed by ``delay_s`` per pull when that is positive."""
    if connector is None or delay_s <= 0:
        return connector
    return SlowReceiveConnector(connector, delay_s)
