"""Same-host KV transfer through POSIX shared memory (``/dev/shm``).

``publish`` copies the pages into a new segment (a 128-byte header, then the pages in
:class:`~kv_transfer.pages.PageLayout` order); the handle names the segment; ``receive``
maps it, checks the header against the handle and its own pool, copies into the
destination pages and unmaps; ``release`` unlinks it. Because ``publish`` copies, the
prefill engine may free the pages as soon as ``publish`` returns.

Segments belong to the publishing process: its ``multiprocessing`` resource tracker
unlinks them if the process dies before ``release``. The receiver maps a segment without
registering it with any resource tracker (see :func:`_map_segment`).
"""

from __future__ import annotations

import _posixshmem  # the shm_open that multiprocessing.shared_memory itself uses
import contextlib
import hashlib
import mmap
import os
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch

from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import KVConnector, parse_options
from kv_transfer.handle import KVHandle, TransferError, TransferStats
from kv_transfer.pages import (
    check_dst_pages,
    check_publish,
    gather_pages,
    make_handle,
    scatter_pages,
)

__all__ = ["ShmConnector", "ShmOptions", "segment_name"]

# magic, num_layers, num_pages, page_size, kv_dim, payload bytes, dtype name, request id hash
_HEADER = struct.Struct("<8s5q16s8s")
_HEADER_BYTES = 128  # the payload starts here (the header padded to an aligned offset)
_MAGIC = b"DSV3KV01"
_NAME = re.compile(r"[A-Za-z0-9_]{1,30}")  # macOS allows 31 bytes with the leading "/"


@dataclass(frozen=True)
class ShmOptions:
    """``prefix``: start of every segment name (1-8 letters or digits), to spot leaks."""

    prefix: str = "dsv3kv"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9]{1,8}", self.prefix):
            raise ValueError(f"shm prefix: expected 1-8 letters or digits, got {self.prefix!r}")


def segment_name(prefix: str, nonce: str, request_id: str) -> str:
    """A short shm-safe name: the prefix, a readable piece of the id, a hash (<= 30 chars)."""
    readable = re.sub(r"[^A-Za-z0-9]", "", request_id)[:6]
    digest = hashlib.blake2b(f"{nonce}/{request_id}".encode(), digest_size=6).hexdigest()
    return f"{prefix}_{readable}_{digest}"


def _pack_header(handle: KVHandle) -> bytes:
    sizes = (handle.num_layers, handle.num_pages, handle.page_size, handle.kv_dim)
    rid = hashlib.blake2b(handle.request_id.encode(), digest_size=8).digest()
    return _HEADER.pack(_MAGIC, *sizes, handle.nbytes, handle.dtype.encode(), rid)


class _Mapping:
    """A read-write map of an existing segment, unknown to every resource tracker.

    ``SharedMemory(name)`` on Python < 3.13 registers the segment with the resource
    tracker of the attaching process. Unregistering afterwards is wrong as often as it
    is right: a process spawned by the publisher shares the publisher's tracker, whose
    single registration the unregister would remove (the tracker then prints a KeyError
    when the publisher unlinks). Mapping the segment directly avoids the tracker.
    """

    def __init__(self, name: str) -> None:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


def _map_segment(source: JSONObject, request_id: str) -> _Mapping:
    name = source.get("segment")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TransferError(f"receive {request_id!r}: bad shm segment name {name!r}")
    try:
        return _Mapping(name)
    except FileNotFoundError:
        raise TransferError(
            f"receive {request_id!r}: shm segment {name!r} does not exist "
            "(released, lease expired, or published on another host)"
        ) from None
    except OSError as exc:
        raise TransferError(f"receive {request_id!r}: cannot map {name!r}: {exc}") from exc


def _check_header(seg: _Mapping, handle: KVHandle) -> None:
    if seg.size < _HEADER_BYTES + handle.nbytes:
        raise TransferError(
            f"receive {handle.request_id!r}: segment holds {seg.size} bytes, "
            f"expected {_HEADER_BYTES + handle.nbytes}"
        )
    found = bytes(seg.buf[: _HEADER.size])
    if found != _pack_header(handle):
        raise TransferError(
            f"receive {handle.request_id!r}: segment header {_HEADER.unpack(found)} "
            f"does not match the handle {_HEADER.unpack(_pack_header(handle))}"
        )


def _payload(buf: memoryview, nbytes: int) -> torch.Tensor:
    # Aliases ``buf`` without pinning it: the tensor must be dropped before the unmap.
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=_HEADER_BYTES)


class ShmConnector(KVConnector):
    """Shared-memory connector for a prefill and a decode engine on one host."""

    name = "shm"

    def __init__(self, pool: MLAKVPool, **options: Any) -> None:
        super().__init__(pool)
        self.options = parse_options(ShmOptions, options, self.name)
        self._nonce = secrets.token_hex(8)
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._lock = threading.Lock()

    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        """Copy ``pages`` into a new segment; the handle's ``source`` names it."""
        check_publish(self.pool, pages, num_tokens)
        name = segment_name(self.options.prefix, self._nonce, request_id)
        handle = make_handle(
            self.name, self.layout, request_id, len(pages), num_tokens, {"segment": name}
        )
        seg = self._create(name, request_id, _HEADER_BYTES + handle.nbytes)
        try:
            self._fill(seg, handle, pages)
            with self._lock:
                if request_id in self._segments:
                    raise ValueError(f"publish: request {request_id!r} is already staged")
                self._segments[request_id] = seg
        except BaseException:
            _unlink(seg)
            raise
        return handle

    @staticmethod
    def _create(name: str, request_id: str, size: int) -> shared_memory.SharedMemory:
        try:
            return shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:
            raise ValueError(f"publish: request {request_id!r} is already staged") from None

    def _fill(self, seg: shared_memory.SharedMemory, handle: KVHandle, pages: list[int]) -> None:
        buf = seg.buf
        if buf is None:
            raise RuntimeError(f"publish: segment {seg.name} was closed before it was filled")
        payload = _payload(buf, handle.nbytes)
        if self.pool.device.type == "cpu":
            gather_pages(self.pool, pages, out=payload)
        else:
            payload.copy_(gather_pages(self.pool, pages))
        del payload
        buf[: _HEADER.size] = _pack_header(handle)

    def release(self, request_id: str) -> None:
        """Unlink the request's segment (idempotent); a receiver mid-copy keeps its map."""
        with self._lock:
            seg = self._segments.pop(request_id, None)
        if seg is not None:
            _unlink(seg)

    def staged(self) -> int:
        with self._lock:
            return len(self._segments)

    def receive(self, handle: KVHandle, dst_pages: list[int]) -> TransferStats:
        """Map the handle's segment, verify its header, copy into ``dst_pages``, unmap."""
        start = time.perf_counter()
        check_dst_pages(handle, self.layout, dst_pages, self.pool.num_pages, self.name)
        seg = _map_segment(handle.source, handle.request_id)
        try:
            _check_header(seg, handle)
            self._copy_out(seg, handle, dst_pages)
        finally:
            seg.close()
        seconds = time.perf_counter() - start
        return TransferStats(request_id=handle.request_id, nbytes=handle.nbytes, seconds=seconds)

    def _copy_out(self, seg: _Mapping, handle: KVHandle, dst_pages: list[int]) -> None:
        payload = _payload(seg.buf, handle.nbytes)
        if self.pool.device.type == "cpu":
            scatter_pages(self.pool, dst_pages, payload)
        else:
            scatter_pages(self.pool, dst_pages, payload.to(self.pool.device))
            torch.cuda.current_stream(self.pool.device).synchronize()
        del payload

    def close(self) -> None:
        """Unlink every segment still staged."""
        with self._lock:
            request_ids = list(self._segments)
        for request_id in request_ids:
            self.release(request_id)


def _unlink(seg: shared_memory.SharedMemory) -> None:
    seg.close()
    with contextlib.suppress(FileNotFoundError):
        seg.unlink()
