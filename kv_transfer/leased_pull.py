"""The shared half of the one-sided READ connectors (nixl, mooncake): stage, lease, pin.

The prefill side registers its pool with a transport once; ``publish`` stages the pages
(no copy) and hands out the pool's per-layer base addresses plus the address of its lease
server (:mod:`kv_transfer.lease`). The decode side checks the handle's source, pins the
request at that server (a released or unknown request is refused: TransferError), lets
the transport READ the pages straight into its own, then unpins. ``release`` waits for
the pins in flight, so no READ runs after it returns. A subclass adds only its transport:
the fields it advertises (:meth:`_source_fields`), the READ (:meth:`_read`) and the
teardown (:meth:`_close_transport`). Only JSON crosses the wire.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import KVConnector
from kv_transfer.handle import KVHandle, TransferError, TransferStats
from kv_transfer.lease import LeaseServer, Staging, int_list, pinned, pool_regions
from kv_transfer.pages import check_dst_pages, check_publish, make_handle

__all__ = ["LeasedPullConnector", "PullSource"]


@dataclass(frozen=True)
class PullSource:
    """A handle's source, checked against the receiving pool: where to READ from."""

    fields: dict[str, Any]  # the handle's source as it crossed the wire
    pages: list[int]
    kv_base: list[int]
    scale_base: list[int]


class LeasedPullConnector(KVConnector):
    """A connector whose decode side READs the staged pages under a lease server's pin."""

    # several stagings per request are not exercised here (no test runs these connectors
    # against a live peer): prefill results stay whole, after the prefill
    incremental: ClassVar[bool] = False

    def __init__(self, pool: MLAKVPool, host: str, port: int, timeout_s: float) -> None:
        super().__init__(pool)
        self._lease_host, self._lease_port, self._timeout_s = host, port, timeout_s
        self._staging = Staging(timeout_s)
        self._server: LeaseServer | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ---- the transport ---------------------------------------------------------------
    @abstractmethod
    def _source_fields(self) -> JSONObject:
        """What the handle carries besides addresses, pages and lease (JSON-safe)."""

    @abstractmethod
    def _read(self, source: PullSource, dst_pages: list[int], request_id: str) -> None:
        """READ ``source``'s pages into ``dst_pages`` (the pin is held); TransferError."""

    @abstractmethod
    def _close_transport(self) -> None:
        """Let go of the transport's registrations (after the lease server stopped)."""

    # ---- prefill side ----------------------------------------------------------------
    def _ensure_server(self) -> LeaseServer:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} connector is closed")
            if self._server is None:
                self._server = LeaseServer(
                    self._staging, self._lease_host, self._lease_port, self._timeout_s
                )
            return self._server

    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        """Stage ``pages`` (no copy); the handle carries the transport's fields and addresses."""
        check_publish(self.pool, pages, num_tokens)
        server = self._ensure_server()
        self._staging.add(request_id, pages)
        kv_base, scale_base = pool_regions(self.pool)
        source = {
            **self._source_fields(),
            "kv_base": kv_base,
            "scale_base": scale_base,
            "pages": list(pages),
            "lease": [server.host, server.port],
        }
        return make_handle(self.name, self.layout, request_id, len(pages), num_tokens, source)

    def release(self, request_id: str) -> None:
        """Unstage ``request_id``; returns once no READ of it is in flight (or timeout_s)."""
        self._staging.remove(request_id)

    def staged(self) -> int:
        return len(self._staging)

    # ---- decode side -----------------------------------------------------------------
    def receive(self, handle: KVHandle, dst_pages: list[int]) -> TransferStats:
        """Pin the handle's request at its lease server, READ its pages into ``dst_pages``."""
        start = time.perf_counter()
        check_dst_pages(handle, self.layout, dst_pages, self.pool.num_pages, self.name)
        rid = handle.request_id
        if self._closed:
            raise TransferError(f"receive {rid!r}: {self.name} connector is closed")
        try:
            source, host, port = self._parse_source(handle)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TransferError(f"receive {rid!r}: bad {self.name} source: {exc}") from exc
        with pinned(host, port, rid, source.pages, self._timeout_s):
            self._read(source, dst_pages, rid)
        seconds = time.perf_counter() - start
        return TransferStats(request_id=rid, nbytes=handle.nbytes, seconds=seconds)

    def _parse_source(self, handle: KVHandle) -> tuple[PullSource, str, int]:
        """The handle's source and lease address; ValueError (and kin) where malformed."""
        src = handle.source
        source = PullSource(
            fields=src,
            pages=int_list(src["pages"]),
            kv_base=int_list(src["kv_base"]),
            scale_base=int_list(src["scale_base"]),
        )
        host, port = str(src["lease"][0]), int(src["lease"][1])
        if len(source.pages) != handle.num_pages:
            raise ValueError("source pages != num_pages")
        local_kv, local_scale = pool_regions(self.pool)
        if len(source.kv_base) != len(local_kv) or len(source.scale_base) != len(local_scale):
            raise ValueError("source buffers do not match this pool's layers")
        self._check_source(src)
        return source, host, port

    def _check_source(self, fields: JSONObject) -> None:
        """Check the transport's own fields (KeyError / ValueError); none by default."""

    def close(self) -> None:
        """Stop serving pins, wait for READs in flight, release the transport; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            server.close()
        self._staging.clear()
        self._close_transport()
