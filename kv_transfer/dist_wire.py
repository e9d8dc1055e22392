"""What the torch_dist connector puts on the wire, and its torch.distributed plumbing.

Nothing is pickled. Control records travel through TCPStore queues as fixed-layout
``struct`` bytes followed by the UTF-8 request id; the answer to a pull is an int64
header tensor ``[MAGIC, ordinal, status, nbytes]`` and, if the status is OK, the page
bytes as one send per piece of each chunk (:meth:`PageLayout.chunk_views`: the kv bytes
of the chunk's layers, then their fp8 scales), all point-to-point over a 2-rank process
group (prefill rank 0, decode rank 1). The receiver picks the chunk size (in its PULL).

Store keys (all under the prefill side's TCPStore):

- ``kv/server``: the prefill connector's random id (a restarted server is detected);
- ``kv/peers``: counter that hands each connecting decode pair a peer id;
- ``kv/hello`` (queue): ``HELLO(peer)`` records, popped by the prefill acceptor thread;
- ``kv/pull/<peer>`` (queue): ``PULL`` / ``BYE`` records for one pair's serving thread;
- ``kv/pg/<peer>/...``: the pair's process-group rendezvous (a PrefixStore).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dsv3serve.json_types import JSONObject, json_int, json_str
from kv_transfer.handle import KVHandle, TransferError

if TYPE_CHECKING:
    from typing import TypeAlias

    Group: TypeAlias = "dist.ProcessGroupGloo | dist.ProcessGroupNCCL"

__all__ = [
    "HEADER_MAGIC",
    "HELLO_QUEUE",
    "PEERS_KEY",
    "SERVER_KEY",
    "Address",
    "Kind",
    "Record",
    "Status",
    "connect_store",
    "decode_record",
    "encode_record",
    "host_store",
    "make_group",
    "post_recv",
    "post_send",
    "pull_queue",
    "response_header",
    "teardown_group",
]

HEADER_MAGIC = 0x4B5650554C4C3031  # "KVPULL01"
SERVER_KEY, PEERS_KEY, HELLO_QUEUE = "kv/server", "kv/peers", "kv/hello"
_RECORD = struct.Struct("<8sB8q16s")
_RECORD_MAGIC = b"KVPULREQ"
_MAX_ID_BYTES = 1024


def pull_queue(peer: int) -> str:
    """The queue of ``PULL`` / ``BYE`` records of pair ``peer``."""
    return f"kv/pull/{peer}"


class Kind(IntEnum):
    PULL = 1
    HELLO = 2
    STOP = 3  # sent by the prefill side to its own threads on close
    BYE = 4  # sent by the decode side when it drops a pair


class Status(IntEnum):
    OK = 0
    NOT_FOUND = 1
    MISMATCH = 2


@dataclass(frozen=True)
class Record:
    """One control record; a PULL names the request and the layout the receiver expects."""

    kind: Kind
    peer: int = 0
    ordinal: int = 0
    num_pages: int = 0
    nbytes: int = 0
    num_layers: int = 0
    page_size: int = 0
    kv_dim: int = 0
    layers_per_chunk: int = 0
    dtype: str = ""
    request_id: str = ""

    @classmethod
    def pull(cls, peer: int, ordinal: int, handle: KVHandle, layers_per_chunk: int) -> Record:
        """The PULL of ``handle``'s pages, the ``ordinal``-th transfer of pair ``peer``.

        The sender sends the pages in chunks of ``layers_per_chunk`` layers (see
        :meth:`~kv_transfer.pages.PageLayout.chunk_views`), so both ends can overlap
        their copies with the transfer.
        """
        return cls(
            Kind.PULL,
            peer,
            ordinal,
            handle.num_pages,
            handle.nbytes,
            handle.num_layers,
            handle.page_size,
            handle.kv_dim,
            layers_per_chunk,
            handle.dtype,
            handle.request_id,
        )


def encode_record(rec: Record) -> bytes:
    """``Record`` -> bytes: a fixed 89-byte struct, then the UTF-8 request id."""
    rid = rec.request_id.encode()
    if len(rid) > _MAX_ID_BYTES or len(rec.dtype) > 16:
        raise ValueError(f"request id or dtype too long: {rec.request_id[:64]!r} {rec.dtype!r}")
    sizes = (rec.peer, rec.ordinal, rec.num_pages, rec.nbytes)
    layout = (rec.num_layers, rec.page_size, rec.kv_dim, rec.layers_per_chunk)
    return _RECORD.pack(_RECORD_MAGIC, rec.kind, *sizes, *layout, rec.dtype.encode()) + rid


def decode_record(data: bytes) -> Record:
    """Inverse of :func:`encode_record`; ValueError for anything malformed."""
    if len(data) < _RECORD.size or len(data) > _RECORD.size + _MAX_ID_BYTES:
        raise ValueError(f"control record of {len(data)} bytes")
    magic, kind, *ints, dtype = _RECORD.unpack(data[: _RECORD.size])
    if magic != _RECORD_MAGIC:
        raise ValueError(f"control record magic {magic!r}")
    peer, ordinal, num_pages, nbytes, num_layers, page_size, kv_dim, per_chunk = ints
    return Record(
        Kind(kind),
        peer,
        ordinal,
        num_pages,
        nbytes,
        num_layers,
        page_size,
        kv_dim,
        per_chunk,
        dtype.rstrip(b"\0").decode(),
        data[_RECORD.size :].decode(),
    )


@dataclass(frozen=True)
class Address:
    """Where a prefill connector serves pulls: the ``source`` of its handles."""

    host: str
    port: int
    backend: str
    server: str

    def source(self) -> JSONObject:
        return {
            "host": self.host,
            "port": self.port,
            "backend": self.backend,
            "server": self.server,
        }

    @classmethod
    def parse(cls, source: JSONObject, request_id: str) -> Address:
        """Validate a handle's ``source`` (it crossed the wire); TransferError if bad."""
        try:
            addr = cls(
                str(source["host"]),
                json_int(source["port"], "port"),
                json_str(source["backend"], "backend"),
                json_str(source["server"], "server"),
            )
            ipaddress.ip_address(addr.host)
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"receive {request_id!r}: bad torch_dist source {source}") from exc
        if addr.backend not in ("gloo", "nccl") or not 0 < addr.port < 65536:
            raise TransferError(f"receive {request_id!r}: bad torch_dist source {source}")
        return addr


def _listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on ``host`` only (``port`` 0: a free port), and its port.

    TCPStore binds every interface when it opens its own socket, so the socket is bound
    here and handed over (``master_listen_fd``; the store then owns and closes it).
    """
    sock = _listener(host, port)
    bound_port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(
            host,
            bound_port,
            None,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store, bound_port


def connect_store(addr: Address, timeout_s: float) -> dist.TCPStore:
    """A client of the prefill side's store (connect retries end after ``timeout_s``)."""
    return dist.TCPStore(
        addr.host, addr.port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False
    )


def make_group(
    store: dist.Store, peer: int, rank: int, backend: str, host: str, timeout_s: float
) -> Group:
    """The standalone 2-rank group of pair ``peer`` (not the default group).

    gloo listens on ``host`` only; NCCL picks its interfaces itself (``NCCL_SOCKET_IFNAME``).
    Blocks until both ranks joined (at most ``timeout_s`` for gloo; NCCL connects lazily on
    the first send/recv).
    """
    prefixed = dist.PrefixStore(f"kv/pg/{peer}/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    opts = dist.ProcessGroupNCCL.Options()
    # Our own deadlines (kv_transfer.dist_sync) fire first and abort the pair; NCCL's
    # watchdog, which would take the whole process down, only backs them up.
    opts._timeout = 2 * timeout + timedelta(seconds=30)
    return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)


def post_send(group: Group, tensors: list[torch.Tensor], dst: int) -> dist.Work:
    """``group.send(tensors, dst, 0)``; the Work to wait on (torch's stubs omit a backend's
    send and recv, so the two typing gaps sit here)."""
    return group.send(tensors, dst, 0)  # type: ignore[union-attr]


def post_recv(group: Group, tensors: list[torch.Tensor], src: int) -> dist.Work:
    """``group.recv(tensors, src, 0)``; the Work to wait on."""
    return group.recv(tensors, src, 0)  # type: ignore[union-attr]


def teardown_group(group: Group | None, backend: str) -> None:
    """Close a pair's group; never raises (the peer may be gone already)."""
    if group is None:
        return
    try:
        if backend == "nccl":
            group.abort()  # does not wait for a peer that may never answer
        else:
            group.shutdown()  # closes gloo's sockets, so the peer fails fast
    except RuntimeError:
        pass


def response_header(
    ordinal: int, status: Status, nbytes: int, device: torch.device
) -> torch.Tensor:
    """The int64 ``[MAGIC, ordinal, status, nbytes]`` answer to a PULL."""
    values = [HEADER_MAGIC, ordinal, int(status), nbytes]
    return torch.tensor(values, dtype=torch.int64, device=device)
