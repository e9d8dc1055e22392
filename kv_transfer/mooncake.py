"""KV transfer through the Mooncake Transfer Engine (SGLang's default), a one-sided READ.

Tested on CPU only (host memory over Mooncake's ``tcp`` transport,
``mooncake-transfer-engine-non-cuda`` 0.3.13.post1; see docs/perf/kv_transfer.md); the
``rdma`` protocol and CUDA pools take the same code path but have not run.

Design (as :mod:`kv_transfer.nixl`): each connector starts one engine with the
peer-to-peer handshake (no metadata server) and registers its whole pool (every layer's
KV buffer and fp8 scale buffer) once. ``publish`` records the pages; the handle carries the
engine's session (``host:rpc_port``), the base address of each layer's buffers and the
address of the connector's lease server (:mod:`kv_transfer.lease`). The receiver pins the
request there (a released or unknown request is refused: TransferError), then READs one
slice per (layer, page) with ``batch_transfer_sync_read`` straight into its own pages, then
unpins. ``release`` waits for the pins in flight. Only JSON crosses the wire.

The engine's synchronous read has no deadline of its own; it fails fast (returns an error)
when the peer is unreachable or refuses the addresses, and the lease has proved the peer
alive just before, but a peer that stops answering mid-READ is bounded only by TCP.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import KVConnector, parse_options
from kv_transfer.handle import KVHandle, TransferError, TransferStats
from kv_transfer.lease import (
    LeaseServer,
    Staging,
    check_host,
    int_list,
    pinned,
    pool_regions,
)
from kv_transfer.pages import check_dst_pages, check_publish, make_handle

__all__ = ["MooncakeConnector", "MooncakeOptions"]


@dataclass(frozen=True)
class MooncakeOptions:
    """Options of the mooncake connector.

    - ``host``: the internal IP address the engine and the lease server bind and handles
      advertise (never a wildcard); ``port``: the lease server's port, 0 picks a free one.
    - ``protocol``: Mooncake transport (``tcp``; ``rdma`` where the NICs have it);
      ``device_name``: RDMA devices to use (comma-separated; empty: discover).
    - ``timeout_s``: bound on a receive's lease exchange and on how long ``release`` waits
      for a READ in flight.
    """

    host: str = "127.0.0.1"
    port: int = 0
    protocol: str = "tcp"
    device_name: str = ""
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_host(self.host, "mooncake")
        if not 0 <= self.port < 65536 or not self.timeout_s > 0:
            raise ValueError(
                f"mooncake: expected 0 <= port < 65536 and timeout_s > 0, "
                f"got port={self.port}, timeout_s={self.timeout_s}"
            )


def _buffers(pool: MLAKVPool) -> tuple[list[int], list[int]]:
    """(address, nbytes) of every KV and scale buffer of ``pool``."""
    tensors = [pool.kv_buffer(layer) for layer in range(pool.num_layers)]
    tensors += [s for s in map(pool.scale_buffer, range(pool.num_layers)) if s is not None]
    return [t.data_ptr() for t in tensors], [t.numel() * t.element_size() for t in tensors]


class MooncakeConnector(KVConnector):
    """One Mooncake Transfer Engine per pool; see the module docstring."""

    name = "mooncake"
    # several stagings per request are not exercised here (no test runs this connector
    # against a live peer): prefill results stay whole, after the prefill
    incremental = False

    def __init__(self, pool: MLAKVPool, **options: Any) -> None:
        super().__init__(pool)
        self.options = parse_options(MooncakeOptions, options, self.name)
        engine_cls = importlib.import_module("mooncake.engine").TransferEngine
        self._engine = engine_cls()
        opts = self.options
        rc = self._engine.initialize(opts.host, "P2PHANDSHAKE", opts.protocol, opts.device_name)
        if rc != 0:
            raise RuntimeError(f"mooncake: engine initialize({opts.host!r}) returned {rc}")
        self._session = f"{opts.host}:{self._engine.get_rpc_port()}"
        self._addresses, sizes = _buffers(pool)
        rc = self._engine.batch_register_memory(self._addresses, sizes)
        if rc != 0:
            raise RuntimeError(f"mooncake: registering the pool returned {rc}")
        self._staging = Staging(opts.timeout_s)
        self._server: LeaseServer | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _ensure_server(self) -> LeaseServer:
        with self._lock:
            if self._closed:
                raise RuntimeError("mooncake connector is closed")
            if self._server is None:
                opts = self.options
                self._server = LeaseServer(self._staging, opts.host, opts.port, opts.timeout_s)
            return self._server

    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        """Stage ``pages`` (no copy); the handle carries this engine's session and addresses."""
        check_publish(self.pool, pages, num_tokens)
        server = self._ensure_server()
        self._staging.add(request_id, pages)
        kv_base, scale_base = pool_regions(self.pool)
        source = {
            "session": self._session,
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

    def _slices(
        self, kv_base: list[int], scale_base: list[int], pages: list[int]
    ) -> tuple[list[int], list[int]]:
        """(address, length) of every (layer, page) slice, kv bytes then fp8 scales."""
        kv_size, scale_size = self.layout.kv_page_bytes, self.layout.scale_page_bytes
        addrs = [b + p * kv_size for b in kv_base for p in pages]
        lengths = [kv_size] * len(addrs)
        addrs += [b + p * scale_size for b in scale_base for p in pages]
        lengths += [scale_size] * (len(addrs) - len(lengths))
        return addrs, lengths

    def receive(self, handle: KVHandle, dst_pages: list[int]) -> TransferStats:
        """Pin the handle's request at its lease server, READ its pages into ``dst_pages``."""
        start = time.perf_counter()
        check_dst_pages(handle, self.layout, dst_pages, self.pool.num_pages, self.name)
        rid = handle.request_id
        if self._closed:
            raise TransferError(f"receive {rid!r}: mooncake connector is closed")
        local_kv, local_scale = pool_regions(self.pool)
        try:
            src = handle.source
            session = str(src["session"])
            src_pages = int_list(src["pages"])
            kv_base, scale_base = int_list(src["kv_base"]), int_list(src["scale_base"])
            host, port = str(src["lease"][0]), int(src["lease"][1])
            if len(src_pages) != handle.num_pages:
                raise ValueError("source pages != num_pages")
            if len(kv_base) != len(local_kv) or len(scale_base) != len(local_scale):
                raise ValueError("source buffers do not match this pool's layers")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TransferError(f"receive {rid!r}: bad mooncake source: {exc}") from exc
        remote, lengths = self._slices(kv_base, scale_base, src_pages)
        local, _ = self._slices(local_kv, local_scale, dst_pages)
        with pinned(host, port, rid, src_pages, self.options.timeout_s):
            rc = self._engine.batch_transfer_sync_read(session, local, remote, lengths)
        if rc != 0:
            raise TransferError(f"receive {rid!r}: mooncake READ from {session} returned {rc}")
        seconds = time.perf_counter() - start
        return TransferStats(request_id=rid, nbytes=handle.nbytes, seconds=seconds)

    def close(self) -> None:
        """Stop serving pins, wait for READs in flight, unregister the pool; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            server.close()
        self._staging.clear()
        self._engine.batch_unregister_memory(self._addresses)
