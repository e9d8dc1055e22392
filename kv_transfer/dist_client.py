"""Decode side of the torch_dist connector: one lazily built pair per prefill server.

A pull pushes a PULL record to the pair's queue on the prefill store, receives the int64
answer header, then the page bytes in chunks of whole layers; each chunk is scattered
into the destination pages while the next one is still on the wire (CUDA: on a side
stream, so a stalled peer never blocks the engine's stream). Transfers through one pair
run one at a time (NCCL point-to-point has no tags, so order is the only matching);
different prefill servers transfer concurrently. Any failure other than "not staged"
drops the pair; the next pull from that server builds a new one.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.dist_sync import SideStream, wait_work
from kv_transfer.dist_wire import (
    HEADER_MAGIC,
    HELLO_QUEUE,
    PEERS_KEY,
    SERVER_KEY,
    Address,
    Kind,
    Record,
    Status,
    connect_store,
    encode_record,
    make_group,
    post_recv,
    pull_queue,
    teardown_group,
)
from kv_transfer.handle import KVHandle, TransferError
from kv_transfer.pages import PageLayout, layer_chunks, page_index, scatter_pages

if TYPE_CHECKING:
    from kv_transfer.dist_wire import Group

__all__ = ["PullClient"]

_REFUSALS: dict[int, str] = {
    Status.NOT_FOUND: "is not staged there (released, lease expired, or never published)",
    Status.MISMATCH: "is staged there with a different page count or layout",
}


class _Refused(TransferError):
    """The prefill side answered but had nothing to send; the pair stays healthy."""


class _Pair:
    """The decode end of one pair: store client, 2-rank group, transfer counter."""

    def __init__(self, addr: Address, device: torch.device) -> None:
        self.addr, self.device = addr, device
        self.lock = threading.Lock()
        self.store: dist.TCPStore | None = None
        self.group: Group | None = None
        self.side = SideStream(device)
        self.peer = 0
        self.ordinal = 0


class PullClient:
    """Pulls staged pages from prefill servers into ``pool``."""

    def __init__(
        self,
        pool: MLAKVPool,
        backend: str,
        host: str,
        wire_device: torch.device,
        timeout_s: float,
        chunk_bytes: int,
    ) -> None:
        self.pool, self.layout, self.backend, self.host = pool, PageLayout.of(pool), backend, host
        self.wire_device, self.timeout_s, self.chunk_bytes = wire_device, timeout_s, chunk_bytes
        self._lock = threading.Lock()
        self._pairs: dict[Address, _Pair] = {}

    def pull(self, handle: KVHandle, dst_pages: list[int]) -> None:
        """Receive ``handle``'s pages into ``dst_pages``; TransferError on any failure.

        After a failure the destination pages hold undefined bytes.
        """
        addr = Address.parse(handle.source, handle.request_id)
        if addr.backend != self.backend:
            raise TransferError(
                f"receive {handle.request_id!r}: the prefill side uses {addr.backend}, "
                f"this connector uses {self.backend}"
            )
        pair = self._pair(addr)
        if not pair.lock.acquire(timeout=self.timeout_s):
            raise TransferError(
                f"receive {handle.request_id!r}: the pair with {addr.host}:{addr.port} "
                f"stayed busy for {self.timeout_s} s"
            )
        try:
            self._fetch(pair, handle, dst_pages)
        finally:
            pair.lock.release()

    def _pair(self, addr: Address) -> _Pair:
        with self._lock:
            if addr not in self._pairs:
                self._pairs[addr] = _Pair(addr, self.pool.device)
            return self._pairs[addr]

    def _fetch(self, pair: _Pair, handle: KVHandle, dst_pages: list[int]) -> None:
        """Connect if needed and pull; drop the pair on any failure but a refusal."""
        try:
            with pair.side.use():
                if pair.group is None:
                    self._connect(pair)
                self._request(pair, handle, dst_pages)
        except _Refused:
            raise
        except Exception as exc:
            self._drop(pair)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(
                f"receive {handle.request_id!r}: torch_dist pull from "
                f"{pair.addr.host}:{pair.addr.port} failed: {exc}"
            ) from exc

    def _connect(self, pair: _Pair) -> None:
        store = connect_store(pair.addr, self.timeout_s)
        server = store.get(SERVER_KEY).decode()
        if server != pair.addr.server:
            raise TransferError(
                f"the prefill connector at {pair.addr.host}:{pair.addr.port} is not the one "
                f"that made the handle (server id {server}, expected {pair.addr.server})"
            )
        peer = store.add(PEERS_KEY, 1)
        store.queue_push(HELLO_QUEUE, encode_record(Record(Kind.HELLO, peer=peer)))
        pair.store, pair.peer, pair.ordinal = store, peer, 0
        pair.group = make_group(store, peer, 1, self.backend, self.host, self.timeout_s)

    def _request(self, pair: _Pair, handle: KVHandle, dst_pages: list[int]) -> None:
        assert pair.store is not None and pair.group is not None
        ordinal, pair.ordinal = pair.ordinal, pair.ordinal + 1
        per_chunk = self.layout.layers_per_chunk(handle.num_pages, self.chunk_bytes)
        pull = Record.pull(pair.peer, ordinal, handle, per_chunk)
        pair.store.queue_push(pull_queue(pair.peer), encode_record(pull))
        self._read_header(pair.group, handle, ordinal)
        buf = torch.empty(handle.nbytes, dtype=torch.uint8, device=self.wire_device)
        landing = buf
        if self.wire_device != self.pool.device:  # gloo with a CUDA pool
            landing = torch.empty(handle.nbytes, dtype=torch.uint8, device=self.pool.device)
        posted = [
            (layers, [post_recv(pair.group, [p], 0) for p in self._pieces(buf, handle, layers)])
            for layers in layer_chunks(self.layout.num_layers, per_chunk)
        ]
        index = page_index(self.pool, dst_pages)
        for layers, works in posted:
            self._land(works, buf, landing, handle, layers)
            scatter_pages(self.pool, index, landing, layers)
        pair.side.drain(self.timeout_s)

    def _pieces(self, buf: torch.Tensor, handle: KVHandle, layers: range) -> list[torch.Tensor]:
        return self.layout.chunk_views(buf, handle.num_pages, layers)

    def _land(
        self,
        works: list[dist.Work],
        buf: torch.Tensor,
        landing: torch.Tensor,
        handle: KVHandle,
        layers: range,
    ) -> None:
        """Make one chunk's bytes usable on the pool's device, in stream order."""
        for work in works:
            if self.backend == "nccl":
                work.wait()  # the side stream waits for the recv; the CPU does not
            else:
                wait_work(work, self.backend, self.timeout_s)
        if landing is not buf:
            for dst, src in zip(
                self._pieces(landing, handle, layers),
                self._pieces(buf, handle, layers),
                strict=True,
            ):
                dst.copy_(src)

    def _read_header(self, group: Group, handle: KVHandle, ordinal: int) -> None:
        header = torch.empty(4, dtype=torch.int64, device=self.wire_device)
        wait_work(post_recv(group, [header], 0), self.backend, self.timeout_s)
        magic, answered, status, nbytes = header.tolist()
        if magic != HEADER_MAGIC or answered != ordinal:
            raise TransferError(
                f"receive {handle.request_id!r}: answer header {[magic, answered]} out of "
                f"step (expected [{HEADER_MAGIC}, {ordinal}])"
            )
        if status != Status.OK:
            reason = _REFUSALS.get(status, f"was refused (status {status})")
            raise _Refused(f"receive {handle.request_id!r}: the request {reason}")
        if nbytes != handle.nbytes:
            raise TransferError(
                f"receive {handle.request_id!r}: expected {handle.nbytes} bytes, "
                f"the prefill side announced {nbytes}"
            )

    def _drop(self, pair: _Pair) -> None:
        """Tell the serving thread goodbye (best effort) and close the pair's group."""
        if pair.store is not None and pair.group is not None:
            with contextlib.suppress(dist.DistError):
                pair.store.queue_push(pull_queue(pair.peer), encode_record(Record(Kind.BYE)))
        teardown_group(pair.group, self.backend)
        pair.store, pair.group = None, None
        pair.side = SideStream(pair.device)  # the old one may wait on an aborted recv

    def close(self) -> None:
        """Drop every pair; a pair mid-transfer is dropped when its transfer ends."""
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            if pair.lock.acquire(timeout=self.timeout_s):
                try:
                    self._drop(pair)
                finally:
                    pair.lock.release()
