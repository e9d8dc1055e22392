"""The shared half of the one-sided READ connectors (nixl, mooncake): stage, lease, pin.

The prefill side registers its pool with a transport once; ``publish`` stages the pages
(no copy) and hands out the pool's per-layer base addresses plus the address of its lease
server (:mod:`kv_transfer.lease`). The decode side checks the handle's source, pins the
request at that server (a released or unknown request is refused: TransferError), lets
the transport READ the pages straight into its own, then unpins. ``release`` waits for
the pins in flight, so no READ runs after it returns. Serving, release and the receive's
checks come from :class:`~kv_transfer.served.ServedConnector`. A subclass adds only its
transport: its options (a :class:`LeasedPullOptions`), the fields it advertises
(:meth:`_source_fields`), the READ (:meth:`_read`, over :func:`~kv_transfer.pages.page_slices`) and
the teardown (:meth:`_close_transport`). Only JSON crosses the wire.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.handle import KVHandle, TransferError
from kv_transfer.lease import LeaseServer, Staging, check_host, int_list, pinned, pool_regions
from kv_transfer.pages import check_publish, make_handle
from kv_transfer.served import ServedConnector

__all__ = ["LeasedPullConnector", "LeasedPullOptions", "PullSource"]


@dataclass(frozen=True)
class LeasedPullOptions:
    """The options every one-sided connector has (a subclass adds its transport's).

    - ``host``: the internal IP address the lease server binds and handles advertise
      (never a wildcard); ``port``: the lease server's port, 0 picks a free one.
    - ``timeout_s``: bound on a receive's lease exchange, and on how long ``release``
      waits for a READ in flight.
    """

    connector: ClassVar[str]
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_host(self.host, self.connector)
        if not 0 <= self.port < 65536 or not self.timeout_s > 0:
            raise ValueError(
                f"{self.connector}: expected 0 <= port < 65536 and timeout_s > 0, "
                f"got port={self.port}, timeout_s={self.timeout_s}"
            )


@dataclass(frozen=True)
class PullSource:
    """A handle's source, checked against the receiving pool: where to READ from."""

    fields: dict[str, Any]  # the handle's source as it crossed the wire
    pages: list[int]
    kv_base: list[int]
    scale_base: list[int]


class LeasedPullConnector(ServedConnector[Staging, LeaseServer]):
    """A connector whose decode side READs the staged pages under a lease server's pin."""

    # several stagings per request are not exercised here (no test runs these connectors
    # against a live peer): prefill results stay whole, after the prefill
    incremental = False

    def __init__(self, pool: MLAKVPool, options: LeasedPullOptions) -> None:
        super().__init__(pool, Staging(options.timeout_s))
        self._lease_host, self._lease_port = options.host, options.port
        self._timeout_s = options.timeout_s

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
    def _start_server(self) -> LeaseServer:
        return LeaseServer(self._staging, self._lease_host, self._lease_port, self._timeout_s)

    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        """Stage ``pages`` (no copy); the handle carries the transport's fields and addresses."""
        check_publish(self.pool, pages, num_tokens)
        server = self._ensure_server()
        self._staging.add(request_id, pages)
        kv_base, scale_base = pool_regions(self.pool)
        source: JSONObject = {
            **self._source_fields(),
            "kv_base": list(kv_base),
            "scale_base": list(scale_base),
            "pages": list(pages),
            "lease": [server.host, server.port],
        }
        return make_handle(self.name, self.layout, request_id, len(pages), num_tokens, source)

    # ---- decode side -----------------------------------------------------------------
    def _pull(self, handle: KVHandle, dst_pages: list[int]) -> None:
        """Pin the handle's request at its lease server, READ its pages into ``dst_pages``."""
        rid = handle.request_id
        try:
            source, host, port = self._parse_source(handle)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TransferError(f"receive {rid!r}: bad {self.name} source: {exc}") from exc
        with pinned(host, port, rid, source.pages, self._timeout_s):
            self._read(source, dst_pages, rid)

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
        if self._stop_serving():
            self._close_transport()
