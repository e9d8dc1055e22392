"""KV transfer through NIXL (UCX: NVLink / RDMA), a one-sided READ by the decode side.

UNTESTED: this module is written against NIXL's documented Python API (``nixl_agent``,
``register_memory``, ``get_xfer_descs``, ``initialize_xfer``, ``transfer``,
``check_xfer_state``) and has never run here: nixl is not installed in CI and no test
covers it. Treat it as a starting point, not a working backend.

Design: each connector registers its whole pool (every layer's KV buffer and fp8 scale
buffer) with its agent once. ``publish`` only records the pages; the handle carries the
agent's metadata (base64) and the base address of each layer's buffers, so the receiver
builds one descriptor per (layer, page) and READs them straight into its own pages.
NIXL's ``get_serialized_descs`` pickles, so descriptors never cross the wire: only
JSON integers do.

Known gap: a one-sided READ cannot see the prefill side's staging, so a receive after
``release`` (or after the pages were reused) is NOT detected; it reads whatever the pages
hold. Use it only where the router guarantees release happens after the pull.
"""

from __future__ import annotations

import base64
import importlib
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import KVConnector, parse_options
from kv_transfer.handle import KVHandle, TransferError, TransferStats
from kv_transfer.pages import check_dst_pages, check_publish, make_handle

__all__ = ["NixlConnector", "NixlOptions"]


@dataclass(frozen=True)
class NixlOptions:
    """``backends``: NIXL plugins to create (default UCX); ``timeout_s``: per receive."""

    backends: tuple[str, ...] = ("UCX",)
    timeout_s: float = 30.0


def _regions(pool: MLAKVPool) -> tuple[list[int], list[int]]:
    """Base addresses of each layer's KV buffer and (fp8) scale buffer."""
    kv = [pool.kv_buffer(layer).data_ptr() for layer in range(pool.num_layers)]
    scales = [pool.scale_buffer(layer) for layer in range(pool.num_layers)]
    return kv, [s.data_ptr() for s in scales if s is not None]


class NixlConnector(KVConnector):
    """One NIXL agent per pool; see the module docstring (untested)."""

    name = "nixl"

    def __init__(self, pool: MLAKVPool, **options: Any) -> None:
        super().__init__(pool)
        self.options = parse_options(NixlOptions, options, self.name)
        api = importlib.import_module("nixl._api")
        self._agent_name = f"dsv3kv-{secrets.token_hex(6)}"
        config = api.nixl_agent_config(backends=list(self.options.backends))
        self._agent = api.nixl_agent(self._agent_name, config)
        tensors = [pool.kv_buffer(layer) for layer in range(pool.num_layers)]
        tensors += [s for s in map(pool.scale_buffer, range(pool.num_layers)) if s is not None]
        self._registered = self._agent.register_memory(tensors)
        self._mem_type = "cuda" if pool.device.type == "cuda" else "cpu"
        self._device_id = pool.device.index or 0
        self._staged: dict[str, list[int]] = {}
        self._remotes: set[str] = set()
        self._lock = threading.Lock()

    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        """Record ``pages``; the handle carries this agent's metadata and buffer addresses."""
        check_publish(self.pool, pages, num_tokens)
        with self._lock:
            if request_id in self._staged:
                raise ValueError(f"publish: request {request_id!r} is already staged")
            self._staged[request_id] = list(pages)
        kv_base, scale_base = _regions(self.pool)
        source = {
            "agent": self._agent_name,
            "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "device_id": self._device_id,
            "kv_base": kv_base,
            "scale_base": scale_base,
            "pages": list(pages),
        }
        return make_handle(self.name, self.layout, request_id, len(pages), num_tokens, source)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._staged.pop(request_id, None)

    def staged(self) -> int:
        with self._lock:
            return len(self._staged)

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
                self._agent.add_remote_agent(base64.b64decode(source["metadata"]))
                self._remotes.add(name)
        return name

    def receive(self, handle: KVHandle, dst_pages: list[int]) -> TransferStats:
        """READ the handle's pages from the remote agent into ``dst_pages``."""
        start = time.perf_counter()
        check_dst_pages(handle, self.layout, dst_pages, self.pool.num_pages, self.name)
        try:
            src = handle.source
            if len(src["pages"]) != handle.num_pages:
                raise TransferError(f"receive {handle.request_id!r}: source pages != num_pages")
            remote = self._remote(src)
            remote_descs = self._descs(
                list(src["kv_base"]),
                list(src["scale_base"]),
                list(src["pages"]),
                int(src["device_id"]),
            )
            local_descs = self._descs(*_regions(self.pool), dst_pages, self._device_id)
            self._read(local_descs, remote_descs, remote, handle.request_id)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"receive {handle.request_id!r}: nixl READ failed: {exc}") from exc
        seconds = time.perf_counter() - start
        return TransferStats(request_id=handle.request_id, nbytes=handle.nbytes, seconds=seconds)

    def _read(self, local: Any, remote: Any, remote_name: str, request_id: str) -> None:
        xfer = self._agent.initialize_xfer("READ", local, remote, remote_name, b"")
        try:
            state = self._agent.transfer(xfer)
            deadline = time.monotonic() + self.options.timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)
                state = self._agent.check_xfer_state(xfer)
            if state != "DONE":
                raise TransferError(f"receive {request_id!r}: nixl READ ended in state {state}")
        finally:
            self._agent.release_xfer_handle(xfer)

    def close(self) -> None:
        with self._lock:
            self._staged.clear()
            remotes, self._remotes = list(self._remotes), set()
        for name in remotes:
            self._agent.remove_remote_agent(name)
        self._agent.deregister_memory(self._registered)
