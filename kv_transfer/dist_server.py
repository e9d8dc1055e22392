"""Prefill side of the torch_dist connector: the staged pages and the threads that serve pulls.

The server hosts a TCPStore bound to the configured host. An acceptor thread pops HELLO
records and starts one serving thread per decode peer; that thread joins the pair's
2-rank group as rank 0 and answers the peer's PULL records in order. Idle threads block
in a store queue pop (no collective is ever left pending, so NCCL's watchdog never sees
an idle pair); ``close`` wakes them with STOP records.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.dist_sync import SideStream, wait_work
from kv_transfer.dist_wire import (
    HELLO_QUEUE,
    SERVER_KEY,
    Address,
    Kind,
    Record,
    Status,
    decode_record,
    encode_record,
    host_store,
    make_group,
    post_send,
    pull_queue,
    response_header,
    teardown_group,
)
from kv_transfer.pages import PageLayout, gather_pages, layer_chunks, page_index

if TYPE_CHECKING:
    from kv_transfer.dist_wire import Group

__all__ = ["PullServer", "Staging"]

log = logging.getLogger(__name__)
_IDLE_S = 3600.0  # a control thread's queue pop times out (and loops) after this long


@dataclass(frozen=True)
class _Staged:
    pages: tuple[int, ...]
    num_tokens: int
    ready: torch.cuda.Event | None  # CUDA pools: the publisher's stream reached publish()


class Staging:
    """Page lists staged for pulls, by request id.

    A pull reads the pages inside :meth:`reading`, which holds the lock until the copies
    out of the pages have finished, so once :meth:`remove` returns no pull reads the
    pages again and the engine may free them.
    """

    def __init__(self, pool: MLAKVPool) -> None:
        self.pool = pool
        self.layout = PageLayout.of(pool)
        self._lock = threading.Lock()
        self._staged: dict[str, _Staged] = {}

    def add(self, request_id: str, pages: list[int], num_tokens: int) -> None:
        ready = None
        if self.pool.device.type == "cuda":  # pulls copy on a side stream: order them after
            ready = torch.cuda.Event()  # the writes the publisher queued before publish()
            ready.record(torch.cuda.current_stream(self.pool.device))
        with self._lock:
            if request_id in self._staged:
                raise ValueError(f"publish: request {request_id!r} is already staged")
            self._staged[request_id] = _Staged(tuple(pages), num_tokens, ready)

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._staged.pop(request_id, None)

    def clear(self) -> None:
        with self._lock:
            self._staged.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._staged)

    @contextlib.contextmanager
    def reading(self, rec: Record) -> Iterator[tuple[Status, _Staged | None]]:
        """The staging ``rec`` asks for (or why there is none), locked for the block."""
        with self._lock:
            staged = self._staged.get(rec.request_id)
            if staged is None:
                yield Status.NOT_FOUND, None
            elif not self._matches(rec, len(staged.pages)):
                yield Status.MISMATCH, None
            else:
                yield Status.OK, staged

    def _matches(self, rec: Record, num_pages: int) -> bool:
        ours = self.layout
        fields = (ours.num_layers, ours.page_size, ours.kv_dim, ours.dtype)
        theirs = (rec.num_layers, rec.page_size, rec.kv_dim, rec.dtype)
        sizes_match = rec.num_pages == num_pages and rec.nbytes == ours.nbytes(num_pages)
        return sizes_match and fields == theirs and rec.layers_per_chunk >= 1


class PullServer:
    """Serves pulls of ``staging``'s pages to any number of decode peers."""

    def __init__(
        self,
        staging: Staging,
        host: str,
        port: int,
        backend: str,
        wire_device: torch.device,
        timeout_s: float,
    ) -> None:
        self._staging, self._host, self._backend = staging, host, backend
        self._wire_device, self._timeout_s = wire_device, timeout_s
        self._store, bound_port = host_store(host, port, timeout_s)
        self.address = Address(host, bound_port, backend, secrets.token_hex(8))
        self._store.set(SERVER_KEY, self.address.server)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
        self._acceptor.start()

    def _control_client(self) -> dist.Store:
        client = self._store.clone()  # type: ignore[attr-defined]  # not in torch's stubs
        client.set_timeout(timedelta(seconds=_IDLE_S))
        return client

    def _pop(self, client: dist.Store, queue: str) -> Record | None:
        """The next record of ``queue``; None after an idle timeout or a malformed record."""
        try:
            return decode_record(client.queue_pop(queue))
        except dist.DistStoreError:  # idle timeout
            return None
        except ValueError as exc:
            log.warning("kv_transfer: dropped a malformed control record on %s: %s", queue, exc)
            return None

    def _accept_loop(self) -> None:
        client = self._control_client()
        while not self._closed.is_set():
            rec = self._pop(client, HELLO_QUEUE)
            if rec is not None and rec.kind == Kind.HELLO:
                self._start_peer(rec.peer)

    def _start_peer(self, peer: int) -> None:
        thread = threading.Thread(
            target=self._serve_peer, args=(peer,), name=f"kv-serve-{peer}", daemon=True
        )
        with self._lock:
            if self._closed.is_set():
                return
            # Threads stay listed until they are dead, so close() joins every one of them.
            self._threads = {p: t for p, t in self._threads.items() if t.is_alive()}
            self._threads[peer] = thread
        thread.start()

    def _serve_peer(self, peer: int) -> None:
        group = None
        try:
            if self._wire_device.type == "cuda":
                torch.cuda.set_device(self._wire_device)
            group = make_group(
                self._store.clone(),  # type: ignore[attr-defined]  # not in torch's stubs
                peer,
                0,
                self._backend,
                self._host,
                self._timeout_s,
            )
            self._serve_pulls(group, peer, SideStream(self._staging.pool.device))
        except Exception as exc:  # the pair is dead; the decode side reconnects
            if not self._closed.is_set():
                log.warning("kv_transfer: pull pair %d closed: %s", peer, exc)
        finally:
            teardown_group(group, self._backend)
            del group  # destroyed here, while close() may still be joining this thread

    def _serve_pulls(self, group: Group, peer: int, side: SideStream) -> None:
        client = self._control_client()
        while not self._closed.is_set():
            rec = self._pop(client, pull_queue(peer))
            if rec is None:
                continue
            if rec.kind != Kind.PULL:  # BYE from the peer, or STOP from close()
                return
            self._answer(group, rec, side)

    def _answer(self, group: Group, rec: Record, side: SideStream) -> None:
        """Send the header, then the pages chunk by chunk: each chunk's send starts as
        soon as its gather is done, while the next chunk is gathered."""
        works: list[dist.Work] = []
        in_flight: list[torch.Tensor] = []  # referenced until their sends have finished
        with self._staging.reading(rec) as (status, staged), side.use():
            nbytes = 0 if staged is None else rec.nbytes
            in_flight.append(response_header(rec.ordinal, status, nbytes, self._wire_device))
            works.append(post_send(group, [in_flight[-1]], 1))
            if staged is not None:
                side.wait_for(staged.ready)
                self._send_chunks(group, rec, list(staged.pages), works, in_flight)
                side.drain(self._timeout_s)  # pages read: release() may now free them
        for work in works:
            wait_work(work, self._backend, self._timeout_s)

    def _send_chunks(
        self,
        group: Group,
        rec: Record,
        pages: list[int],
        works: list[dist.Work],
        in_flight: list[torch.Tensor],
    ) -> None:
        pool, layout = self._staging.pool, self._staging.layout
        buf = torch.empty(rec.nbytes, dtype=torch.uint8, device=pool.device)
        in_flight.append(buf)
        index = page_index(pool, pages)
        for layers in layer_chunks(layout.num_layers, rec.layers_per_chunk):
            gather_pages(pool, index, out=buf, layers=layers)
            for piece in layout.chunk_views(buf, len(pages), layers):
                in_flight.append(piece.to(self._wire_device))  # gloo: through the host
                works.append(post_send(group, [in_flight[-1]], 1))

    def close(self) -> None:
        """Stop accepting, wake and join every thread, shut the store down (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            threads = dict(self._threads)
        stop = encode_record(Record(Kind.STOP))
        alive = [peer for peer, thread in threads.items() if thread.is_alive()]
        for queue in [HELLO_QUEUE, *map(pull_queue, alive)]:
            self._store.queue_push(queue, stop)
        for thread in [self._acceptor, *threads.values()]:
            thread.join(timeout=self._timeout_s + 1.0)
        self._store = None  # type: ignore[assignment]  # the server stops with its last ref
