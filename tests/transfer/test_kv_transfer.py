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
import multiprocessing as mp
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
import torch
from test_engine import GREEDY, drain, make_engine, prompts, run_alone

from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer import (
    CONNECTORS,
    KVConnector,
    KVHandle,
    TransferError,
    create_kv_connector,
)
from kv_transfer.factory import OPTIONAL, installed
from kv_transfer.pages import gather_pages

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float32": torch.float32,
}
ONE_SIDED = ("nixl", "mooncake")  # optional packages; a lease server guards their READs


def _optional(name: str, *values: Any) -> Any:
    """A parametrization of optional connector ``name`` that skips where it is not installed."""
    reason = f"{name} is not installed (optional: pip install {OPTIONAL[name][1]}); CI skips it"
    return pytest.param(name, *values, marks=pytest.mark.skipif(not installed(name), reason=reason))


NAMES = ["shm", "torch_dist", *(_optional(name) for name in ONE_SIDED)]
LAYERS, PAGES, PAGE_SIZE = 3, 24, 4
POISON = 0xFF  # NaN in bf16, fp8 e4m3fn and float32 alike
FAST_S = 5.0  # an error must surface well before any timeout_s used here


def _options(name: str, chunk_mib: float = 0.001) -> dict[str, Any]:
    """torch_dist: a bounded wait, and (by default) one chunk per layer on the wire."""
    if name in ONE_SIDED:
        return {"timeout_s": 10.0}
    return {"timeout_s": 10.0, "chunk_mib": chunk_mib} if name == "torch_dist" else {}


@pytest.fixture(scope="module", autouse=True)
def _ucx_over_tcp() -> Iterator[None]:
    """nixl's UCX backend on TCP here (set before the prefill peer is spawned)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp"))
        yield


def _fill(pool: MLAKVPool, make: Any) -> None:
    for layer in range(pool.num_layers):
        tensors = [pool.kv_buffer(layer), pool.scale_buffer(layer)]
        for raw in (t.view(torch.uint8) for t in tensors if t is not None):
            raw.copy_(make(raw.shape))


def random_pool(dtype: str, seed: int) -> MLAKVPool:
    """A pool of random raw bytes, the same for the same (dtype, seed) in any process."""
    pool = MLAKVPool(LAYERS, PAGES, PAGE_SIZE, dtype=DTYPES[dtype])
    gen = torch.Generator().manual_seed(seed)
    _fill(pool, lambda shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen))
    return pool


def poisoned_pool(dtype: str) -> MLAKVPool:
    pool = MLAKVPool(LAYERS, PAGES, PAGE_SIZE, dtype=DTYPES[dtype])
    _fill(pool, lambda shape: torch.full(shape, POISON, dtype=torch.uint8))
    return pool


def assert_moved(src: MLAKVPool, src_pages: list[int], dst: MLAKVPool, dst_pages: list[int]):
    assert torch.equal(gather_pages(src, src_pages), gather_pages(dst, dst_pages))


def assert_poisoned(pool: MLAKVPool, except_pages: list[int]) -> None:
    others = [p for p in range(pool.num_pages) if p not in except_pages]
    assert bool((gather_pages(pool, others) == POISON).all()), "a page not named was written"


# ---- the prefill peer: a spawned process that publishes on request ---------------------
def _serve(connectors: dict[tuple[str, str, int], KVConnector], msg: dict) -> dict:
    key = (msg["connector"], msg["dtype"], msg["seed"])
    if key not in connectors:
        pool = random_pool(msg["dtype"], seed=msg["seed"])
        connectors[key] = create_kv_connector(key[0], pool, **_options(key[0]))
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
    ctx = mp.get_context("spawn")
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
        made[name, dtype] = create_kv_connector(name, poisoned_pool(dtype), **_options(name))
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


# ---- in one process --------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_publish_validation_release_and_close(name: str) -> None:
    connector = create_kv_connector(name, random_pool("float32", 15), **_options(name))
    for pages, tokens in (([], 1), ([PAGES], 1), ([1, 1], 5), ([1, 2], 9), ([1], 0)):
        with pytest.raises(ValueError, match="publish"):
            connector.publish("bad", pages, tokens)
    connector.publish("a", [1, 2], 5)
    connector.publish("b", [3], 4)
    with pytest.raises(ValueError, match="already staged"):
        connector.publish("a", [5], 1)
    assert connector.staged() == 2
    connector.release("a")
    connector.release("a")
    connector.release("never")
    assert connector.staged() == 1
    connector.close()
    assert connector.staged() == 0
    connector.close()


def test_torch_dist_peer_gone_raises_and_store_binds_only_the_given_host() -> None:
    prefill = create_kv_connector("torch_dist", random_pool("bfloat16", 16), timeout_s=3.0)
    decode = create_kv_connector("torch_dist", poisoned_pool("bfloat16"), timeout_s=3.0)
    handle = prefill.publish("r", [1, 2], 5)
    port = handle.source["port"]
    listening = _listen_addresses(port)
    assert listening and all(addr == "0100007F" for addr in listening), listening  # 127.0.0.1
    decode.receive(handle, [5, 6])
    prefill.close()
    start = time.monotonic()
    with pytest.raises(TransferError):
        decode.receive(handle, [5, 6])
    assert time.monotonic() - start < FAST_S
    decode.close()


def _listen_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    found = []
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if not table.exists():
            pytest.skip("needs Linux /proc/net/tcp")
        for row in (line.split() for line in table.read_text().splitlines()[1:]):
            address, hex_port = row[1].split(":")
            if row[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_factory_rejects_unknown_names_and_options() -> None:
    pool = random_pool("bfloat16", 17)
    with pytest.raises(ValueError, match="shm, torch_dist, nixl, mooncake"):
        create_kv_connector("rdma", pool)
    with pytest.raises(ValueError, match="unknown options"):
        create_kv_connector("shm", pool, timeout_s=3)
    with pytest.raises(ValueError, match="expose"):
        create_kv_connector("torch_dist", pool, host="0.0.0.0")
    assert CONNECTORS == ("shm", "torch_dist", "nixl", "mooncake")


@pytest.mark.parametrize("name", ONE_SIDED)
def test_optional_connector_without_its_package_says_so(name: str) -> None:
    if installed(name):
        pytest.skip(f"{name} is installed")
    with pytest.raises(ImportError, match=r"not installed.*shm, torch_dist$"):
        create_kv_connector(name, random_pool("bfloat16", 18))


# ---- end to end with real engines ------------------------------------------------------
@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    """Tiny engines with fp8 KV (scales travel too): prefill, decode, colocated."""
    return {role: make_engine(kv_cache_dtype="fp8_e4m3") for role in ("p", "d", "c")}


@pytest.mark.parametrize(
    ("name", "seed"),
    [
        ("shm", 41),
        ("torch_dist", 42),
        _optional("nixl", 43),
        _optional("mooncake", 44),
    ],
)
def test_engine_disaggregated_equals_colocated(engines: dict[str, Engine], name, seed) -> None:
    prefill, decode = engines["p"], engines["d"]
    sender = create_kv_connector(name, prefill.runner.pool, **_options(name))
    receiver_ = create_kv_connector(name, decode.runner.pool, **_options(name, chunk_mib=32))
    for i, ids in enumerate(prompts(2, seed=seed, lo=5, hi=30)):
        rid = f"{name}-{i}"
        prefill.add_request(Request(rid, GREEDY, prompt_ids=ids), prefill_only=True)
        first = drain(prefill)[rid]
        export = prefill.export_kv(rid)
        handle = KVHandle.model_validate_json(
            sender.publish(rid, export.pages, len(ids)).model_dump_json()
        )
        pages = decode.reserve_kv(len(ids))
        assert pages is not None and len(pages) >= handle.num_pages
        receiver_.receive(handle, pages[: handle.num_pages])
        assert_moved(
            prefill.runner.pool, export.pages, decode.runner.pool, pages[: len(export.pages)]
        )
        sender.release(rid)
        prefill.release_export(rid)
        decode.import_kv(Request(rid, GREEDY, prompt_ids=ids), export.first_token, pages)
        streamed = drain(decode)[rid]  # the decode stream re-emits the first token
        assert streamed[:1] == first and streamed == run_alone(engines["c"], ids)
    assert sender.staged() == 0
    sender.close()
    receiver_.close()
    for engine in (prefill, decode):
        engine.scheduler.kv.evict_all()
        assert engine.scheduler.kv.free_pages == engine.scheduler.kv.num_pages
