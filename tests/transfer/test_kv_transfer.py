"""KV transfer connectors on CPU: shm, torch_dist (gloo), nixl, mooncake; across processes.

nixl and mooncake run only where their packages import (they are not in the test extra,
so CI skips them): nixl's UCX backend then moves host memory over TCP (``UCX_TLS=tcp``,
set for this module), mooncake uses its ``tcp`` protocol.

The prefill side of the cross-process tests is one spawned process (``_prefill_peer``)
driven by JSON strings over a Pipe; handles cross back as JSON, as they do through the
router. Pools hold random raw bytes (every bit pattern, NaN payloads included) and are
compared as bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from kv_transfer_util import (
    DTYPES,
    FAST_S,
    LAYERS,
    NAMES,
    ONE_SIDED,
    PAGE_SIZE,
    PAGES,
    assert_moved,
    assert_poisoned,
    options_for,
    poisoned_pool,
    random_pool,
)

from dsv3serve.engine.group.rank_start import rank_context
from kv_transfer import (
    KVConnector,
    KVHandle,
    TransferError,
    create_kv_connector,
)


@pytest.fixture(scope="module", autouse=True)
def _ucx_over_tcp() -> Iterator[None]:
    """nixl's UCX backend on TCP here (set before the prefill peer is spawned)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp"))
        yield


# ---- the prefill peer: a spawned process that publishes on request ---------------------
def _serve(connectors: dict[tuple[str, str, int], KVConnector], msg: dict) -> dict:
    key = (msg["connector"], msg["dtype"], msg["seed"])
    if key not in connectors:
        pool = random_pool(msg["dtype"], seed=msg["seed"])
        connectors[key] = create_kv_connector(key[0], pool, **options_for(key[0]))
    connector = connectors[key]
    if msg["op"] == "publish":
        handle = connector.publish(msg["rid"], msg["pages"], msg["num_tokens"])
        return {"handle": handle.model_dump_json()}
    if msg["op"] == "release":
        connector.release(msg["rid"])
    return {"staged": connector.staged()}


def _prefill_peer(conn: Connection) -> None:
    connectors: dict[tuple[str, str, int], KVConnector] = {}
    try:
        while conn.poll(120):
            msg = json.loads(conn.recv())
            if msg["op"] == "exit":
                break
            try:
                conn.send(json.dumps(_serve(connectors, msg)))
            except Exception as exc:
                conn.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    finally:
        for connector in connectors.values():
            connector.close()


class Peer:
    """The test's end of the prefill peer's pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def call(self, **msg: Any) -> dict:
        self.conn.send(json.dumps(msg))
        assert self.conn.poll(30), f"prefill peer did not answer {msg}"
        reply = json.loads(self.conn.recv())
        assert "error" not in reply, reply["error"]
        return reply

    def publish(self, name: str, dtype: str, rid: str, pages: list[int], seed: int) -> KVHandle:
        reply = self.call(
            op="publish", connector=name, dtype=dtype, seed=seed, rid=rid, pages=pages,
            num_tokens=len(pages) * PAGE_SIZE - 1,
        )  # fmt: skip
        return KVHandle.model_validate_json(reply["handle"])

    def release(self, name: str, dtype: str, rid: str, seed: int) -> int:
        return self.call(op="release", connector=name, dtype=dtype, seed=seed, rid=rid)["staged"]


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    ctx = rank_context()  # the peer process starts as a group rank does
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_prefill_peer, args=(theirs,), daemon=True)
    proc.start()
    yield Peer(ours)
    ours.send(json.dumps({"op": "exit"}))
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0


@pytest.fixture
def receivers() -> Iterator[dict[tuple[str, str], KVConnector]]:
    """Decode-side connectors by (name, dtype), closed after the test."""
    made: dict[tuple[str, str], KVConnector] = {}
    yield made
    for connector in made.values():
        connector.close()


def receiver(made: dict, name: str, dtype: str) -> KVConnector:
    if (name, dtype) not in made:
        made[name, dtype] = create_kv_connector(name, poisoned_pool(dtype), **options_for(name))
    return made[name, dtype]


# ---- cross-process ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_cross_process_bit_exact_then_released(peer: Peer, receivers, name, dtype) -> None:
    seed, src_pages, dst_pages = 11, [5, 1, 12], [2, 23, 9]
    handle = peer.publish(name, dtype, "req/x 1", src_pages, seed)
    decode = receiver(receivers, name, dtype)
    stats = decode.receive(handle, dst_pages)
    reference = random_pool(dtype, seed)
    assert_moved(reference, src_pages, decode.pool, dst_pages)
    assert_poisoned(decode.pool, dst_pages)
    assert stats.nbytes == handle.nbytes > 0 and stats.request_id == "req/x 1"
    assert peer.release(name, dtype, "req/x 1", seed) == 0
    assert peer.release(name, dtype, "req/x 1", seed) == 0  # idempotent
    start = time.monotonic()
    with pytest.raises(TransferError, match="req/x 1"):
        decode.receive(handle, [3, 4, 6])
    assert time.monotonic() - start < FAST_S
    assert_poisoned(decode.pool, dst_pages)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_request_and_mismatches_raise(peer: Peer, receivers, name) -> None:
    seed, pages = 12, [0, 7]
    handle = peer.publish(name, "bfloat16", "known", pages, seed)
    decode = receiver(receivers, name, "bfloat16")
    fields = handle.model_dump()
    forged = {
        "unknown id": fields | {"request_id": "unknown"},
        "fewer pages than staged": fields | {"num_pages": 1, "nbytes": handle.nbytes // 2},
    }
    if name == "shm":
        forged["missing segment"] = fields | {"source": {"segment": "dsv3kv_nope_000000000000"}}
    if name in ONE_SIDED:
        forged["no lease server"] = fields | {"source": handle.source | {"lease": ["127.0.0.1", 1]}}
        forged["other pages"] = fields | {"source": handle.source | {"pages": [0, 8]}}
    for what, bad in forged.items():
        start = time.monotonic()
        with pytest.raises(TransferError):
            decode.receive(KVHandle(**bad), [3, 4][: bad["num_pages"]])
        assert time.monotonic() - start < FAST_S, what
    with pytest.raises(TransferError, match="expected 2 destination pages"):
        decode.receive(handle, [3])
    with pytest.raises(TransferError, match="dtype"):
        receiver(receivers, name, "float32").receive(handle, [3, 4])
    assert_poisoned(decode.pool, [])
    decode.receive(handle, [3, 4])  # the failures above left the connection usable
    assert_moved(random_pool("bfloat16", seed), pages, decode.pool, [3, 4])
    assert peer.release(name, "bfloat16", "known", seed) == 0


def test_concurrent_pulls_through_one_pair(peer: Peer, receivers) -> None:
    seed, dtype = 13, "float8_e4m3fn"
    src = {f"c{i}": [i, (i + 8) % PAGES, (i + 16) % PAGES] for i in range(8)}
    dst = {rid: [3 * i, 3 * i + 1, 3 * i + 2] for i, rid in enumerate(src)}
    handles = {
        rid: peer.publish("torch_dist", dtype, rid, pages, seed) for rid, pages in src.items()
    }
    decode = receiver(receivers, "torch_dist", dtype)
    errors: list[BaseException] = []

    def pull(rids: list[str]) -> None:
        try:
            for rid in rids:
                decode.receive(handles[rid], dst[rid])
        except BaseException as exc:  # reported below
            errors.append(exc)

    rids = list(src)
    threads = [threading.Thread(target=pull, args=(rids[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    reference = random_pool(dtype, seed)
    for rid in rids:
        assert_moved(reference, src[rid], decode.pool, dst[rid])
        peer.release("torch_dist", dtype, rid, seed)
    assert peer.call(op="staged", connector="torch_dist", dtype=dtype, seed=seed)["staged"] == 0


_SHM_RECEIVER = """
import sys, torch
from kv_transfer import KVHandle, create_kv_connector
from kv_transfer.pages import digest_pages
from dsv3serve.kvcache.pool import MLAKVPool
pool = MLAKVPool({layers}, {pages}, {page_size}, dtype=torch.bfloat16)
handle = KVHandle.model_validate_json(sys.stdin.read())
create_kv_connector("shm", pool).receive(handle, [0, 1])
print(digest_pages(pool, [0, 1]))
"""


def test_shm_receiver_in_unrelated_process_leaves_segment_to_publisher() -> None:
    """A receiver with its own resource tracker must neither unlink nor report the segment."""
    publisher = create_kv_connector("shm", random_pool("bfloat16", 14))
    handle = publisher.publish("solo", [4, 9], 8)
    script = _SHM_RECEIVER.format(layers=LAYERS, pages=PAGES, page_size=PAGE_SIZE)
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", script], input=handle.model_dump_json(), env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    from kv_transfer.pages import digest_pages

    assert out.stdout.strip() == digest_pages(publisher.pool, [4, 9])
    assert "leaked" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert Path("/dev/shm", handle.source["segment"]).exists()
    publisher.release("solo")
    assert not Path("/dev/shm", handle.source["segment"]).exists()
    publisher.close()
