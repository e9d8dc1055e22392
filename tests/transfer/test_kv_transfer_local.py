"""KV transfer connectors on CPU, in one process: publish validation, release and close;
torch_dist's bind address and a vanished peer; the factory; and end to end with real
engines (disaggregated equals colocated). Cross-process tests are in test_kv_transfer.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_util import GREEDY, drain, make_engine, prompts, run_alone
from kv_transfer_util import (
    FAST_S,
    NAMES,
    ONE_SIDED,
    PAGES,
    assert_moved,
    optional_connector,
    options_for,
    poisoned_pool,
    random_pool,
)

from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from kv_transfer import (
    CONNECTORS,
    KVHandle,
    TransferError,
    create_kv_connector,
)
from kv_transfer.factory import installed


@pytest.fixture(scope="module", autouse=True)
def _ucx_over_tcp() -> Iterator[None]:
    """nixl's UCX backend on TCP here (set before the prefill peer is spawned)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp"))
        yield


# ---- in one process --------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_publish_validation_release_and_close(name: str) -> None:
    connector = create_kv_connector(name, random_pool("float32", 15), **options_for(name))
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
        optional_connector("nixl", 43),
        optional_connector("mooncake", 44),
    ],
)
def test_engine_disaggregated_equals_colocated(engines: dict[str, Engine], name, seed) -> None:
    prefill, decode = engines["p"], engines["d"]
    sender = create_kv_connector(name, prefill.runner.pool, **options_for(name))
    receiver_ = create_kv_connector(name, decode.runner.pool, **options_for(name, chunk_mib=32))
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
