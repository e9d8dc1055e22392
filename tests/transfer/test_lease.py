"""The nixl connector's lease server (kv_transfer.lease): real sockets, no nixl needed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kv_transfer.handle import TransferError
from kv_transfer.lease import LeaseServer, Staging, check_host, pinned

TIMEOUT_S = 5.0


@pytest.fixture
def served() -> Iterator[tuple[Staging, LeaseServer]]:
    staging = Staging(TIMEOUT_S)
    server = LeaseServer(staging, "127.0.0.1", 0, TIMEOUT_S)
    yield staging, server
    server.close()


def _pin_once(host: str, port: int, rid: str, pages: list[int]) -> None:
    with pinned(host, port, rid, pages, TIMEOUT_S):
        pass


def _release_in_thread(staging: Staging, rid: str) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (staging.remove(rid), done.set()), daemon=True).start()
    return done


def test_release_waits_for_the_pin_in_flight_then_refuses(served) -> None:
    staging, server = served
    staging.add("r", [3, 1])
    with pinned(server.host, server.port, "r", [3, 1], TIMEOUT_S):
        released = _release_in_thread(staging, "r")
        assert not released.wait(0.5), "release returned while a READ was pinned"
        assert len(staging) == 0  # but new pins already fail
        with pytest.raises(TransferError, match="not staged"):
            _pin_once(server.host, server.port, "r", [3, 1])
    assert released.wait(TIMEOUT_S), "release did not return after the pin ended"


def test_refusals_raise_fast_and_leave_the_server_serving(served) -> None:
    staging, server = served
    staging.add("r", [2, 5])
    refusals = {
        "not staged": ("unknown", [2, 5]),
        r"asked for pages \[2\], staged \[2, 5\]": ("r", [2]),
    }
    for reason, (rid, pages) in refusals.items():
        start = time.monotonic()
        with pytest.raises(TransferError, match=reason):
            _pin_once(server.host, server.port, rid, pages)
        assert time.monotonic() - start < 1.0
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b'["not", "an object"]\n')
        assert b'"ok": false' in sock.recv(4096)
    _pin_once(server.host, server.port, "r", [2, 5])
    staging.remove("r")


def test_a_dropped_connection_ends_its_pin(served) -> None:
    staging, server = served
    staging.add("r", [0])
    sock = socket.create_connection((server.host, server.port), timeout=TIMEOUT_S)
    sock.sendall(b'{"rid": "r", "pages": [0]}\n')
    assert b'"ok": true' in sock.recv(4096)
    released = _release_in_thread(staging, "r")
    assert not released.wait(0.3)
    sock.close()  # the receiver died mid-READ
    assert released.wait(TIMEOUT_S)


def test_unreachable_server_and_wildcard_host() -> None:
    start = time.monotonic()
    with pytest.raises(TransferError, match="unreachable"):
        _pin_once("127.0.0.1", 1, "r", [0])
    assert time.monotonic() - start < 1.0
    with pytest.raises(ValueError, match="every interface"):
        check_host("0.0.0.0", "nixl")
    with pytest.raises(ValueError, match="IP address"):
        check_host("localhost", "nixl")


def test_a_read_that_outlives_its_pin_is_refused_at_the_end() -> None:
    """The server drops a pin after its lifetime (2 x timeout + 5 s) so a stuck reader cannot
    hold pages forever; that reader then gets no acknowledgement of the READ's end and must
    discard what it read, since ``release`` may have freed the pages meanwhile."""
    staging = Staging(0.05)
    server = LeaseServer(staging, "127.0.0.1", 0, 0.05)
    try:
        staging.add("slow", [2])
        with (
            pytest.raises(TransferError, match="expired"),
            pinned(server.host, server.port, "slow", [2], 1.0),
        ):
            time.sleep(5.4)  # past the 5.1 s lifetime
        released = _release_in_thread(staging, "slow")
        assert released.wait(2), "the expired pin still held the release"
    finally:
        server.close()
