"""KV transfer through NIXL (UCX: NVLink / RDMA / TCP), a one-sided READ by the decode side.

Tested on CPU only (DRAM over UCX with ``UCX_TLS=tcp``, nixl 1.5.1; see
docs/perf/kv_transfer.md); CUDA pools take the same code path with ``VRAM`` descriptors but
have not run.

Design: each connector registers its whole pool (every layer's KV buffer and fp8 scale
buffer) with its agent once. ``publish`` records the pages; the handle carries the agent's
metadata (base64), the base address of each layer's buffers and the address of the
connector's lease server (:mod:`kv_transfer.lease`). The receiver first pins the
request at that server, which refuses a released or unknown request (so a pull after
``release`` fails with TransferError instead of reading reused pages), then builds one
descriptor per (layer, page) and READs them straight into its own pages, then unpins.
``release`` waits for the pins in flight, so no READ runs after it returns. NIXL's
``get_serialized_descs`` pickles, so descriptors never cross the wire: only JSON does.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import secrets
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

__all__ = ["NixlConnector", "NixlOptions"]


@dataclass(frozen=True)
class NixlOptions:
    """Options of the nixl connector.

    - ``host``: the internal IP address the lease server binds and handles advertise
      (never a wildcard); ``port``: its port, 0 picks a free one.
    - ``backends``: NIXL plugins to create (default UCX; pick UCX's transports with the
      usual ``UCX_TLS`` environment variable).
    - ``timeout_s``: bound on a receive's lease exchange and its READ, and on how long
      ``release`` waits for a READ in flight.
    """

    host: str = "127.0.0.1"
    port: int = 0
    backends: tuple[str, ...] = ("UCX",)
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_host(self.host, "nixl")
        if not 0 <= self.port < 65536 or not self.timeout_s > 0 or not self.backends:
            raise ValueError(
                f"nixl: expected 0 <= port < 65536, timeout_s > 0 and some backends, got "
                f"port={self.port}, timeout_s={self.timeout_s}, backends={self.backends}"
            )


class NixlConnector(KVConnector):
    """One NIXL agent per pool; see the module docstring."""

    name = "nixl"
    # several stagings per request are not exercised here (no test runs this connector
    # against a live peer): prefill results stay whole, after the prefill
    incremental = False

    def __init__(self, pool: MLAKVPool, **options: Any) -> None:
        super().__init__(pool)
        self.options = parse_options(NixlOptions, options, self.name)
        api = importlib.import_module("nixl._api")
        self._agent_name = f"dsv3kv-{secrets.token_hex(6)}"
        config = api.nixl_agent_config(
            backends=list(self.options.backends),
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # receives may overlap
        )
        self._agent = api.nixl_agent(self._agent_name, config)
        tensors = [pool.kv_buffer(layer) for layer in range(pool.num_layers)]
        tensors += [s for s in map(pool.scale_buffer, range(pool.num_layers)) if s is not None]
        self._registered = self._agent.register_memory(tensors)
        self._mem_type = "cuda" if pool.device.type == "cuda" else "cpu"
        self._device_id = pool.device.index or 0
        self._staging = Staging(self.options.timeout_s)
        self._server: LeaseServer | None = None
        self._remotes: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _ensure_server(self) -> LeaseServer:
        with self._lock:
            if self._closed:
                raise RuntimeError("nixl connector is closed")
            if self._server is None:
                opts = self.options
                self._server = LeaseServer(self._staging, opts.host, opts.port, opts.timeout_s)
            return self._server

    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        """Stage ``pages`` (no copy); the handle carries this agent's metadata and addresses."""
        check_publish(self.pool, pages, num_tokens)
        server = self._ensure_server()
        self._staging.add(request_id, pages)
        kv_base, scale_base = pool_regions(self.pool)
        source = {
            "agent": self._agent_name,
            "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "device_id": self._device_id,
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

    def _descs(self, kv_base: list[int], scale_base: list[int], pages: list[int], dev: int):
        rows = [
            (b + p * self.layout.kv_page_bytes, self.layout.kv_page_bytes, dev)
            for b in kv_base
            for p in pages
        ]
        size = self.layout.scale_page_bytes
        rows += [(b + p * size, size, dev) for b in scale_base for p in pages]
        return self._agent.get_xfer_descs(rows, self._mem_type)

    def _remote(self, source: dict[str, Any]) -> str:
        name = str(source["agent"])
        with self._lock:
            if name not in self._remotes:
                added = self._agent.add_remote_agent(base64.b64decode(source["metadata"]))
                if isinstance(added, bytes):
                    added = added.decode(errors="replace")
                if added != name:
                    raise ValueError(f"handle names agent {name!r}, its metadata {added!r}")
                self._remotes.add(name)
        return name

    def receive(self, handle: KVHandle, dst_pages: list[int]) -> TransferStats:
        """Pin the handle's request at its lease server, READ its pages into ``dst_pages``."""
        start = time.perf_counter()
        check_dst_pages(handle, self.layout, dst_pages, self.pool.num_pages, self.name)
        rid = handle.request_id
        if self._closed:
            raise TransferError(f"receive {rid!r}: nixl connector is closed")
        try:
            src = handle.source
            src_pages = int_list(src["pages"])
            kv_base, scale_base = int_list(src["kv_base"]), int_list(src["scale_base"])
            host, port = str(src["lease"][0]), int(src["lease"][1])
            if len(src_pages) != handle.num_pages:
                raise ValueError("source pages != num_pages")
            if len(kv_base) != self.pool.num_layers or len(scale_base) != len(
                pool_regions(self.pool)[1]
            ):
                raise ValueError("source buffers do not match this pool's layers")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TransferError(f"receive {rid!r}: bad nixl source: {exc}") from exc
        with pinned(host, port, rid, src_pages, self.options.timeout_s):
            try:
                remote = self._remote(src)
                remote_descs = self._descs(kv_base, scale_base, src_pages, int(src["device_id"]))
                local_descs = self._descs(*pool_regions(self.pool), dst_pages, self._device_id)
                self._read(local_descs, remote_descs, remote, rid)
            except TransferError:
                raise
            except Exception as exc:
                raise TransferError(f"receive {rid!r}: nixl READ failed: {exc}") from exc
        seconds = time.perf_counter() - start
        return TransferStats(request_id=rid, nbytes=handle.nbytes, seconds=seconds)

    def _read(self, local: Any, remote: Any, remote_name: str, request_id: str) -> None:
        xfer = self._agent.initialize_xfer("READ", local, remote, remote_name, b"")
        try:
            state = self._agent.transfer(xfer)
            deadline = time.monotonic() + self.options.timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0002)
                state = self._agent.check_xfer_state(xfer)
            if state != "DONE":
                raise TransferError(f"receive {request_id!r}: nixl READ ended in state {state}")
        finally:
            self._agent.release_xfer_handle(xfer)

    def close(self) -> None:
        """Stop serving pins, wait for READs in flight, drop remotes; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, self._server = self._server, None
            remotes, self._remotes = list(self._remotes), set()
        if server is not None:
            server.close()
        self._staging.clear()
        for name in remotes:
            with contextlib.suppress(Exception):  # the remote agent may be gone already
                self._agent.remove_remote_agent(name)
        self._agent.deregister_memory(self._registered)
