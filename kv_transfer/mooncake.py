"""KV transfer through the Mooncake Transfer Engine (SGLang's default), a one-sided READ.

Tested on CPU only (host memory over Mooncake's ``tcp`` transport,
``mooncake-transfer-engine-non-cuda`` 0.3.13.post1; see docs/perf/kv_transfer.md); the
``rdma`` protocol and CUDA pools take the same code path but have not run.

Design (as :mod:`kv_transfer.nixl`): each connector starts one engine with the
peer-to-peer handshake (no metadata server) and registers its whole pool (every layer's
KV buffer and fp8 scale buffer) once. ``publish`` records the pages; the handle carries the
engine's session (``host:rpc_port``), the base address of each layer's buffers and the
address of the connector's lease server (:mod:`kv_transfer.leased_pull`). The receiver pins the
request there (a released or unknown request is refused: TransferError), then READs one
slice per (layer, page) with ``batch_transfer_sync_read`` straight into its own pages, then
unpins. ``release`` waits for the pins in flight. Only JSON crosses the wire.

The engine's synchronous read has no deadline of its own; it fails fast (returns an error)
when the peer is unreachable or refuses the addresses, and the lease has proved the peer
alive just before, but a peer that stops answering mid-READ is bounded only by TCP.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import parse_options
from kv_transfer.handle import TransferError
from kv_transfer.lease import pool_regions
from kv_transfer.leased_pull import LeasedPullConnector, LeasedPullOptions, PullSource
from kv_transfer.pages import page_slices, pool_buffers

__all__ = ["MooncakeConnector", "MooncakeOptions"]


@dataclass(frozen=True)
class MooncakeOptions(LeasedPullOptions):
    """Options of the mooncake connector: ``host`` (the engine binds it too), ``port`` and
    ``timeout_s`` as :class:`~kv_transfer.leased_pull.LeasedPullOptions` has them, and

    - ``protocol``: Mooncake transport (``tcp``; ``rdma`` where the NICs have it);
      ``device_name``: RDMA devices to use (comma-separated; empty: discover).
    """

    connector: ClassVar[str] = "mooncake"
    protocol: str = "tcp"
    device_name: str = ""


class MooncakeConnector(LeasedPullConnector):
    """One Mooncake Transfer Engine per pool; see the module docstring."""

    name = "mooncake"

    def __init__(self, pool: MLAKVPool, **options: Any) -> None:
        self.options = parse_options(MooncakeOptions, options, self.name)
        opts = self.options
        super().__init__(pool, opts)
        engine_cls = importlib.import_module("mooncake.engine").TransferEngine
        self._engine = engine_cls()
        rc = self._engine.initialize(opts.host, "P2PHANDSHAKE", opts.protocol, opts.device_name)
        if rc != 0:
            raise RuntimeError(f"mooncake: engine initialize({opts.host!r}) returned {rc}")
        self._session = f"{opts.host}:{self._engine.get_rpc_port()}"
        buffers = pool_buffers(pool)
        self._addresses = [t.data_ptr() for t in buffers]
        sizes = [t.numel() * t.element_size() for t in buffers]
        rc = self._engine.batch_register_memory(self._addresses, sizes)
        if rc != 0:
            raise RuntimeError(f"mooncake: registering the pool returned {rc}")

    def _source_fields(self) -> JSONObject:
        """This engine's session (``host:rpc_port``)."""
        return {"session": self._session}

    def _check_source(self, fields: JSONObject) -> None:
        str(fields["session"])

    def _read(self, source: PullSource, dst_pages: list[int], request_id: str) -> None:
        """One synchronous batch READ of every slice; TransferError on a non-zero return."""
        session = str(source.fields["session"])
        remote = page_slices(self.layout, source.kv_base, source.scale_base, source.pages)
        local = page_slices(self.layout, *pool_regions(self.pool), dst_pages)
        lengths = [length for _, length in remote]
        rc = self._engine.batch_transfer_sync_read(
            session, [a for a, _ in local], [a for a, _ in remote], lengths
        )
        if rc != 0:
            raise TransferError(
                f"receive {request_id!r}: mooncake READ from {session} returned {rc}"
            )

    def _close_transport(self) -> None:
        """Unregister the pool."""
        self._engine.batch_unregister_memory(self._addresses)
