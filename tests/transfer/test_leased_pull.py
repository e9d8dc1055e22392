"""The base that nixl and mooncake share (kv_transfer.leased_pull, kv_transfer.served) on
a fake transport: both pools live in this process and the READ is a memmove of the slices
the base hands out. Publish, the lease's pin, release and close run for real, over real
sockets, where neither optional package is installed."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import ClassVar

import pytest
from kv_transfer_util import assert_moved, assert_poisoned, poisoned_pool, random_pool

from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.handle import TransferError
from kv_transfer.lease import pool_regions
from kv_transfer.leased_pull import LeasedPullConnector, LeasedPullOptions, PullSource
from kv_transfer.pages import page_slices


@dataclass(frozen=True)
class FakeMemcpyOptions(LeasedPullOptions):
    connector: ClassVar[str] = "fake_memcpy"


class FakeMemcpyConnector(LeasedPullConnector):
    """A fake one-sided transport: the READ copies from the other pool in this process."""

    name = "fake_memcpy"

    def __init__(self, pool: MLAKVPool) -> None:
        super().__init__(pool, FakeMemcpyOptions(timeout_s=5.0))
        self.transport_closed = 0

    def _source_fields(self) -> JSONObject:
        return {"fake": True}

    def _read(self, source: PullSource, dst_pages: list[int], request_id: str) -> None:
        remote = page_slices(self.layout, source.kv_base, source.scale_base, source.pages)
        local = page_slices(self.layout, *pool_regions(self.pool), dst_pages)
        for (src, length), (dst, _) in zip(remote, local, strict=True):
            ctypes.memmove(dst, src, length)

    def _close_transport(self) -> None:
        self.transport_closed += 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_pull_under_the_lease_is_bit_exact_and_release_refuses_the_next(dtype: str) -> None:
    prefill = FakeMemcpyConnector(random_pool(dtype, 21))
    decode = FakeMemcpyConnector(poisoned_pool(dtype))
    handle = prefill.publish("r1", [5, 1, 12], 9)
    assert handle.source["fake"] is True and prefill.staged() == 1
    stats = decode.receive(handle, [2, 23, 9])
    assert stats.request_id == "r1" and stats.nbytes == handle.nbytes > 0
    assert_moved(prefill.pool, [5, 1, 12], decode.pool, [2, 23, 9])
    assert_poisoned(decode.pool, [2, 23, 9])
    prefill.release("r1")
    prefill.release("r1")  # idempotent
    assert prefill.staged() == 0
    with pytest.raises(TransferError, match="r1"):
        decode.receive(handle, [3, 4, 6])
    assert_poisoned(decode.pool, [2, 23, 9])
    for connector in (prefill, decode):
        connector.close()
        connector.close()  # idempotent: the transport is let go once
        assert connector.transport_closed == 1
    with pytest.raises(TransferError, match="closed"):
        decode.receive(handle, [3, 4, 6])
    with pytest.raises(RuntimeError, match="fake_memcpy connector is closed"):
        prefill.publish("r2", [1], 1)


def test_a_malformed_source_is_refused_naming_the_connector() -> None:
    prefill = FakeMemcpyConnector(random_pool("bfloat16", 22))
    decode = FakeMemcpyConnector(poisoned_pool("bfloat16"))
    handle = prefill.publish("r", [0, 7], 5)
    bad = handle.model_copy(update={"source": handle.source | {"kv_base": [1]}})
    with pytest.raises(TransferError, match="bad fake_memcpy source"):
        decode.receive(bad, [3, 4])
    assert_poisoned(decode.pool, [])
    prefill.close()
    decode.close()
