"""The one-sided connectors' control plane: a pin held by the receiver for its whole READ.

A NIXL or Mooncake READ is one-sided: the prefill side is not asked, so by itself it cannot
refuse a pull of a released request, nor know when the pages it staged are no longer read.
This module closes that gap with one small TCP exchange per pull, JSON lines, nothing
pickled:

1. the receiver connects to the prefill side's :class:`LeaseServer` and sends
   ``{"rid": ..., "pages": [...]}``;
2. the server answers ``{"ok": true}`` only if ``rid`` is staged with exactly those pages,
   and counts a pin on that staging; otherwise ``{"ok": false, "error": ...}``;
3. the receiver READs, then sends ``{"done": true}`` (or the connection drops); either
   ends the pin.

:meth:`Staging.remove` (the connector's ``release``) first makes new pins fail, then waits
for the pins in flight to end (at most ``timeout_s``), so that after ``release`` returns no
READ of the request is running.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.handle import TransferError

__all__ = ["LeaseServer", "Staging", "check_host", "int_list", "pinned", "pool_regions"]

_MAX_LINE = 1 << 20  # a request line: a request id and its page list
_ACCEPT_POLL_S = 0.2


def check_host(host: str, connector: str) -> None:
    """``host`` must be one IP address, never a wildcard (ValueError otherwise)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{connector} host: expected an IP address, got {host!r}") from None
    if address.is_unspecified:
        raise ValueError(
            f"{connector} host: {host!r} would expose the control port on every interface; "
            "give this node's internal address"
        )


def pool_regions(pool: MLAKVPool) -> tuple[list[int], list[int]]:
    """Base addresses of each layer's KV buffer and (fp8 pools only) scale buffer."""
    kv = [pool.kv_buffer(layer).data_ptr() for layer in range(pool.num_layers)]
    scales = [pool.scale_buffer(layer) for layer in range(pool.num_layers)]
    return kv, [s.data_ptr() for s in scales if s is not None]


def int_list(value: Any) -> list[int]:
    """``value`` if it is a list of ints (a handle field that crossed the wire), else ValueError."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise ValueError(f"expected a list of integers, got {value!r}")
    return value


def pin_lifetime_s(timeout_s: float) -> float:
    """How long the server holds a pin at most (then drops it): twice the READ bound."""
    return 2 * timeout_s + 5


@dataclass
class _Staged:
    pages: list[int]
    pins: int = 0


class Staging:
    """The prefill side's staged requests and their pins; thread-safe."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._staged: dict[str, _Staged] = {}
        self._cond = threading.Condition()

    def add(self, request_id: str, pages: list[int]) -> None:
        with self._cond:
            if request_id in self._staged:
                raise ValueError(f"publish: request {request_id!r} is already staged")
            self._staged[request_id] = _Staged(list(pages))

    def remove(self, request_id: str) -> None:
        """Unstage ``request_id`` (idempotent); returns once no READ of it is pinned. The
        wait outlasts the server's pin lifetime, so every pin has ended (done, or dropped
        by the server, whose reader then gets no acknowledgement and discards its READ)."""
        with self._cond:
            entry = self._staged.pop(request_id, None)
            if entry is not None:
                bound = pin_lifetime_s(self._timeout_s) + 1
                self._cond.wait_for(lambda: entry.pins == 0, timeout=bound)

    def clear(self) -> None:
        with self._cond:
            entries, self._staged = list(self._staged.values()), {}
            bound = pin_lifetime_s(self._timeout_s) + 1
            self._cond.wait_for(lambda: all(e.pins == 0 for e in entries), bound)

    def __len__(self) -> int:
        with self._cond:
            return len(self._staged)

    def pin(self, request_id: str, pages: list[int]) -> _Staged:
        """Pin a staged request; TransferError (with the reason) if it cannot be read."""
        with self._cond:
            entry = self._staged.get(request_id)
            if entry is None:
                raise TransferError(f"request {request_id!r} is not staged (released or unknown)")
            if entry.pages != pages:
                raise TransferError(
                    f"request {request_id!r}: asked for pages {pages}, staged {entry.pages}"
                )
            entry.pins += 1
            return entry

    def unpin(self, entry: _Staged) -> None:
        with self._cond:
            entry.pins -= 1
            self._cond.notify_all()


def _send(sock: socket.socket, message: JSONObject) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _recv(reader: Any) -> JSONObject | None:
    """One JSON object line, or None at EOF; ValueError for anything else."""
    line = reader.readline(_MAX_LINE + 1)
    if not line:
        return None
    if len(line) > _MAX_LINE or not line.endswith(b"\n"):
        raise ValueError("control line too long or cut")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("control message is not an object")
    return message


def _parse_pin(message: JSONObject | None) -> tuple[str, list[int]]:
    if message is None:
        raise ValueError("connection closed before the pin request")
    rid, pages = message.get("rid"), message.get("pages")
    if not isinstance(rid, str) or not isinstance(pages, list):
        raise ValueError("pin request needs a string rid and a page list")
    if not all(type(p) is int for p in pages):
        raise ValueError("pages must be integers")
    return rid, pages


class LeaseServer:
    """Answers pin requests for one :class:`Staging` on ``host:port`` (0: a free port)."""

    def __init__(self, staging: Staging, host: str, port: int, timeout_s: float) -> None:
        self._staging = staging
        self._timeout_s = timeout_s
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(128)
            self._sock.settimeout(_ACCEPT_POLL_S)
        except OSError:
            self._sock.close()
            raise
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-lease", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        # The pin lasts while the READ may run: until "done", EOF, or its lifetime. Only a
        # "done" within the lifetime is acknowledged: the reader's proof that its READ ran
        # while the pages were still staged.
        conn.settimeout(pin_lifetime_s(self._timeout_s))
        with conn, conn.makefile("rb") as reader:
            try:
                rid, pages = _parse_pin(_recv(reader))
                entry = self._staging.pin(rid, pages)
            except (TransferError, ValueError, OSError) as exc:
                _try_send(conn, {"ok": False, "error": str(exc)})
                return
            try:
                _send(conn, {"ok": True})
                if _recv(reader) is not None:
                    _send(conn, {"ok": True})  # done while pinned: the READ is good
            except (ValueError, OSError):
                pass
            finally:
                self._staging.unpin(entry)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2 * _ACCEPT_POLL_S + 1)


def _try_send(conn: socket.socket, message: JSONObject) -> None:
    with suppress(OSError):
        _send(conn, message)


@contextmanager
def pinned(
    host: str, port: int, request_id: str, pages: list[int], timeout_s: float
) -> Iterator[None]:
    """Hold a pin on ``request_id`` at the lease server ``host:port`` for the block.

    Raises TransferError if the server is unreachable or refuses (released, unknown,
    other pages), or, after the block, if the server did not acknowledge the end of the
    READ (its pin expired first: the pages may have been freed and reused, so what was
    read must be discarded).
    """
    what = f"receive {request_id!r}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise TransferError(f"{what}: nixl lease server {host}:{port} unreachable: {exc}") from exc
    with sock, sock.makefile("rb") as reader:
        try:
            _send(sock, {"rid": request_id, "pages": pages})
            answer = _recv(reader)
        except (OSError, ValueError) as exc:
            raise TransferError(f"{what}: nixl lease exchange failed: {exc}") from exc
        if answer is None or answer.get("ok") is not True:
            reason = "connection closed" if answer is None else answer.get("error")
            raise TransferError(f"{what}: refused by the prefill side: {reason}")
        try:
            yield
        except BaseException:
            _try_send(sock, {"done": True})
            raise
        _end_read(sock, reader, what)


def _end_read(sock: socket.socket, reader: Any, what: str) -> None:
    """Tell the server the READ is over; TransferError unless it acknowledges in time."""
    try:
        _send(sock, {"done": True})
        answer = _recv(reader)
    except (OSError, ValueError) as exc:
        raise TransferError(f"{what}: no acknowledgement of the READ's end: {exc}") from exc
    if answer is None or answer.get("ok") is not True:
        raise TransferError(f"{what}: the pin expired during the READ; its data is discarded")
