"""Point-to-point KV transfer through torch.distributed: gloo on CPU, NCCL between GPUs.

Each prefill connector hosts a TCPStore on ``host`` (an internal address; port 0 picks a
free port) and its handles carry that address. A decode connector, on its first receive
from an address, builds a standalone 2-rank process group with it (prefill rank 0,
decode rank 1) over a PrefixStore of that store; many prefill/decode pairs connect this
way without a global group. See :mod:`kv_transfer.dist_wire` for what goes on the wire.

Staging is a list of page ids, not a copy: when a pull arrives the pages are gathered
into one contiguous buffer on the pool's device, a chunk of whole layers at a time, and
each chunk is sent while the next is gathered; the receiver scatters each chunk while
the next is on the wire (CUDA: on side streams). The sender never releases on its own:
the staging serves pulls until the prefill side calls :meth:`release` (after the decode
side reported success, or when the router's lease expires), and the engine must keep
the pages until then. ``release`` waits for a gather in progress, so the pages are free
to reuse when it returns.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import parse_options
from kv_transfer.dist_client import PullClient
from kv_transfer.dist_server import PullServer, Staging
from kv_transfer.handle import KVHandle
from kv_transfer.pages import check_publish, make_handle
from kv_transfer.served import ServedConnector

__all__ = ["TorchDistConnector", "TorchDistOptions"]


@dataclass(frozen=True)
class TorchDistOptions:
    """Options of the torch_dist connector.

    - ``host``: the internal IP address this rank binds (the prefill store, gloo's
      sockets) and advertises in its handles; never a wildcard address.
    - ``port``: the prefill store's port; 0 picks a free one.
    - ``timeout_s``: bound on every blocking step (connect, rendezvous, each send/recv).
    - ``backend``: ``"gloo"`` or ``"nccl"``; None picks NCCL for CUDA pools, else gloo.
      gloo with a CUDA pool moves the bytes through host memory.
    - ``chunk_mib``: the receiver asks for the pages in chunks of whole layers of about
      this size, so that gathers, the wire and scatters overlap.
    """

    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 30.0
    backend: str | None = None
    chunk_mib: float = 64.0

    def __post_init__(self) -> None:
        try:
            address = ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(
                f"torch_dist host: expected an IP address, got {self.host!r}"
            ) from None
        if address.is_unspecified:
            raise ValueError(
                f"torch_dist host: {self.host!r} would expose the internal port on every "
                "interface; give this node's internal address"
            )
        if not 0 <= self.port < 65536 or not self.timeout_s > 0 or not self.chunk_mib > 0:
            raise ValueError(
                f"torch_dist: expected 0 <= port < 65536, timeout_s > 0 and chunk_mib > 0, "
                f"got port={self.port}, timeout_s={self.timeout_s}, chunk_mib={self.chunk_mib}"
            )
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(
                f"torch_dist backend: expected gloo, nccl or None, got {self.backend!r}"
            )


def _resolve_backend(requested: str | None, device: torch.device) -> str:
    backend = requested or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"torch_dist: nccl needs a CUDA pool, the pool is on {device}")
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not available:
        raise ValueError(f"torch_dist: this torch build has no {backend} backend")
    return backend


class TorchDistConnector(ServedConnector[Staging, PullServer]):
    """Pull-based KV transfer over per-pair torch.distributed process groups."""

    name = "torch_dist"

    def __init__(self, pool: MLAKVPool, **options: Any) -> None:
        super().__init__(pool, Staging(pool))
        self.options = parse_options(TorchDistOptions, options, self.name)
        self.backend = _resolve_backend(self.options.backend, pool.device)
        self._wire_device = pool.device if self.backend == "nccl" else torch.device("cpu")
        opts = self.options
        chunk_bytes = int(opts.chunk_mib * (1 << 20))
        self._client = PullClient(
            pool, self.backend, opts.host, self._wire_device, opts.timeout_s, chunk_bytes
        )

    def _start_server(self) -> PullServer:
        opts = self.options
        return PullServer(
            self._staging, opts.host, opts.port, self.backend, self._wire_device, opts.timeout_s
        )

    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        """Stage ``pages`` (by id, no copy) and return a handle naming this server."""
        check_publish(self.pool, pages, num_tokens)
        server = self._ensure_server()
        self._staging.add(request_id, pages, num_tokens)
        source = server.address.source()
        return make_handle(self.name, self.layout, request_id, len(pages), num_tokens, source)

    def _pull(self, handle: KVHandle, dst_pages: list[int]) -> None:
        """Pull from the handle's server over this pair's group."""
        self._client.pull(handle, dst_pages)

    def close(self) -> None:
        """Stop serving, drop every pair and every staging (idempotent)."""
        self._stop_serving()
        self._client.close()
