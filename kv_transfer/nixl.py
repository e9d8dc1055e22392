"""KV transfer through NIXL (UCX: NVLink / RDMA / TCP), a one-sided READ by the decode side.

Tested on CPU only (DRAM over UCX with ``UCX_TLS=tcp``, nixl 1.5.1; see
docs/perf/kv_transfer.md); CUDA pools take the same code path with ``VRAM`` descriptors but
have not run.

Design: each connector registers its whole pool (every layer's KV buffer and fp8 scale
buffer) with its agent once. ``publish`` records the pages; the handle carries the agent's
metadata (base64), the base address of each layer's buffers and the address of the
connector's lease server (:mod:`kv_transfer.leased_pull`: staging, pin, release). Under
the pin the receiver builds one descriptor per (layer, page) and READs them straight into
its own pages. NIXL's
``get_serialized_descs`` pickles, so descriptors never cross the wire: only JSON does.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import secrets
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from dsv3serve.json_types import JSONObject, json_str
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import parse_options
from kv_transfer.handle import TransferError
from kv_transfer.lease import pool_regions
from kv_transfer.leased_pull import LeasedPullConnector, LeasedPullOptions, PullSource
from kv_transfer.pages import page_slices, pool_buffers

__all__ = ["NixlConnector", "NixlOptions"]


@dataclass(frozen=True)
class NixlOptions(LeasedPullOptions):
    """Options of the nixl connector: ``host``, ``port`` and ``timeout_s`` (which bounds
    the READ too) as :class:`~kv_transfer.leased_pull.LeasedPullOptions` has them, and

    - ``backends``: NIXL plugins to create (default UCX; pick UCX's transports with the
      usual ``UCX_TLS`` environment variable).
    """

    connector: ClassVar[str] = "nixl"
    backends: tuple[str, ...] = ("UCX",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.backends:
            raise ValueError("nixl: expected some backends, got none")


class NixlConnector(LeasedPullConnector):
    """One NIXL agent per pool; see the module docstring."""

    name = "nixl"

    def __init__(self, pool: MLAKVPool, **options: Any) -> None:
        self.options = parse_options(NixlOptions, options, self.name)
        super().__init__(pool, self.options)
        api = importlib.import_module("nixl._api")
        self._agent_name = f"dsv3kv-{secrets.token_hex(6)}"
        config = api.nixl_agent_config(
            backends=list(self.options.backends),
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # receives may overlap
        )
        self._agent = api.nixl_agent(self._agent_name, config)
        self._registered = self._agent.register_memory(pool_buffers(pool))
        self._mem_type = "cuda" if pool.device.type == "cuda" else "cpu"
        self._device_id = pool.device.index or 0
        self._remotes: set[str] = set()

    def _source_fields(self) -> JSONObject:
        """This agent's name, metadata (base64) and device."""
        return {
            "agent": self._agent_name,
            "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "device_id": self._device_id,
        }

    def _descs(
        self, kv_base: list[int], scale_base: list[int], pages: list[int], dev: int
    ) -> Any:  # nixl's transfer descriptor list (nixl ships no types)
        slices = page_slices(self.layout, kv_base, scale_base, pages)
        rows = [(address, length, dev) for address, length in slices]
        return self._agent.get_xfer_descs(rows, self._mem_type)

    def _remote(self, source: JSONObject) -> str:
        name = str(source["agent"])
        with self._lock:
            if name not in self._remotes:
                metadata = base64.b64decode(json_str(source["metadata"], "metadata"))
                added = self._agent.add_remote_agent(metadata)
                if isinstance(added, bytes):
                    added = added.decode(errors="replace")
                if added != name:
                    raise ValueError(f"handle names agent {name!r}, its metadata {added!r}")
                self._remotes.add(name)
        return name

    def _read(self, source: PullSource, dst_pages: list[int], request_id: str) -> None:
        """Describe both sides' (layer, page) rows and READ them; TransferError on failure."""
        try:
            remote = self._remote(source.fields)
            device = int(source.fields["device_id"])
            remote_descs = self._descs(source.kv_base, source.scale_base, source.pages, device)
            local_descs = self._descs(*pool_regions(self.pool), dst_pages, self._device_id)
            self._transfer(local_descs, remote_descs, remote, request_id)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"receive {request_id!r}: nixl READ failed: {exc}") from exc

    def _transfer(self, local: Any, remote: Any, remote_name: str, request_id: str) -> None:
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

    def _close_transport(self) -> None:
        """Drop the remote agents, deregister the pool."""
        with self._lock:
            remotes, self._remotes = list(self._remotes), set()
        for name in remotes:
            with contextlib.suppress(Exception):  # the remote agent may be gone already
                self._agent.remove_remote_agent(name)
        self._agent.deregister_memory(self._registered)
