"""The half that torch_dist and the one-sided connectors (nixl, mooncake) share: the
prefill side stages page ids (no copy) and serves them from a server it starts on the
first publish; the decode side checks the destination pages, then pulls.

A subclass brings its staging and its server (:meth:`_start_server`), and the pull itself
(:meth:`_pull`); ``release``, ``staged``, the checks and timing around a receive, and the
shutdown of server and staging are here.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from typing import Generic, Protocol, TypeVar

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import KVConnector
from kv_transfer.handle import KVHandle, TransferError, TransferStats
from kv_transfer.pages import check_dst_pages

__all__ = ["ServedConnector"]


class _Stagings(Protocol):
    """What the connector asks of its staging (``lease.Staging``, ``dist_server.Staging``)."""

    def remove(self, request_id: str) -> None: ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...


class _Server(Protocol):
    def close(self) -> None: ...


StagingT = TypeVar("StagingT", bound=_Stagings)
ServerT = TypeVar("ServerT", bound=_Server)


class ServedConnector(KVConnector, Generic[StagingT, ServerT]):
    """A connector whose stagings a server of its own serves to the pulling side."""

    def __init__(self, pool: MLAKVPool, staging: StagingT) -> None:
        super().__init__(pool)
        self._staging = staging
        self._server: ServerT | None = None
        self._lock = threading.Lock()
        self._closed = False

    @abstractmethod
    def _start_server(self) -> ServerT:
        """Start serving ``self._staging`` (called once, under the lock)."""

    @abstractmethod
    def _pull(self, handle: KVHandle, dst_pages: list[int]) -> None:
        """Write ``handle``'s pages into ``dst_pages`` (already checked); TransferError."""

    def _ensure_server(self) -> ServerT:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} connector is closed")
            if self._server is None:
                self._server = self._start_server()
            return self._server

    def release(self, request_id: str) -> None:
        """Unstage ``request_id`` (idempotent); returns once no read of its pages is in
        progress (at most the connector's timeout)."""
        self._staging.remove(request_id)

    def staged(self) -> int:
        return len(self._staging)

    def receive(self, handle: KVHandle, dst_pages: list[int]) -> TransferStats:
        """Check ``dst_pages`` against the handle, pull into them, and time it."""
        start = time.perf_counter()
        check_dst_pages(handle, self.layout, dst_pages, self.pool.num_pages, self.name)
        if self._closed:
            raise TransferError(f"receive {handle.request_id!r}: {self.name} connector is closed")
        self._pull(handle, dst_pages)
        seconds = time.perf_counter() - start
        return TransferStats(request_id=handle.request_id, nbytes=handle.nbytes, seconds=seconds)

    def _stop_serving(self) -> bool:
        """Stop the server and drop every staging; False if it was stopped before."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            server.close()
        self._staging.clear()
        return True
