"""The two processes of ``python -m dsv3serve.bench.kv.check_gpu``: prefill side, decode side.

They talk over a Pipe in JSON strings only. The prefill side prefills prompts on its
engine and publishes the pages through the torch_dist connector; the decode side pulls
them into its own engine, decodes, and compares with a colocated engine on its device.
Then both build a synthetic DeepSeek-V3-sized pool and time a large transfer.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.kvcache.pool import MLAKVPool
from dsv3serve.sampling.sampling_params import SamplingParams
from kv_transfer import KVHandle, create_kv_connector
from kv_transfer.dist_sync import wait_work
from kv_transfer.dist_wire import (
    Address,
    connect_store,
    host_store,
    make_group,
    post_recv,
    post_send,
    teardown_group,
)
from kv_transfer.pages import digest_pages, gather_pages, scatter_pages

Args = dict[str, Any]
KVDType = Literal["auto", "fp8_e4m3"]  # EngineConfig.kv_cache_dtype
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def send(conn: Connection, **msg: Any) -> None:
    conn.send(json.dumps(msg))


def recv(conn: Connection, timeout_s: float) -> dict[str, Any]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the other side sent nothing for {timeout_s} s")
    msg = json.loads(conn.recv())
    if msg.get("kind") == "error":
        raise RuntimeError(f"the other side failed:\n{msg['error']}")
    return msg


def make_engine(device: str, kv_cache_dtype: KVDType) -> Engine:
    """The tiny model, as the engine tests build it (no activation quantisation)."""
    cfg = EngineConfig(
        model="tiny",
        device=device,
        num_kv_tokens=4096,
        page_size=16,
        kv_cache_dtype=kv_cache_dtype,
        fp8_act_quant=False,
    )
    return Engine(cfg)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 128000) for _ in range(rng.randint(20, 200))] for _ in range(n)]


def drain(engine: Engine, rid: str) -> list[int]:
    tokens: list[int] = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            return tokens
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.token_ids]
    raise RuntimeError("the engine did not finish")


def record_logits(engine: Engine) -> list[torch.Tensor]:
    """Make ``engine`` keep the logits of every step (float32, on the CPU)."""
    sink: list[torch.Tensor] = []
    run: Callable = engine.runner.run

    def recording(items: Any) -> Any:
        result = run(items)
        sink.append(result.logits.float().cpu())
        return result

    engine.runner.run = recording  # type: ignore[method-assign]
    return sink


def synthetic_pool(args: Args, device: str, seed: int) -> MLAKVPool:
    """DeepSeek-V3-sized pages (61 layers x 576 bf16) filled with random bytes."""
    num_pages = 2 * args["bw_tokens"] // args["bw_page_size"]
    pool = MLAKVPool(61, num_pages, args["bw_page_size"], 576, torch.bfloat16, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in range(pool.num_layers):
        raw = pool.kv_buffer(layer).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device, generator=gen))
    return pool


def bandwidth_pages(args: Args, seed: int) -> list[int]:
    """A scattered half of the synthetic pool's pages (pages are rarely contiguous)."""
    num_pages = args["bw_tokens"] // args["bw_page_size"]
    return random.Random(seed).sample(range(2 * num_pages), num_pages)


def guarded(side: Callable[[Connection, Args], Any], conn: Connection, args: Args) -> None:
    """Run ``side`` and write what it returns, or its traceback, to ``args["out"]`` (JSON).

    A failing side also tells the other one, which then fails at once instead of waiting
    for its timeout.
    """
    try:
        if args["device"].startswith("cuda"):
            torch.cuda.set_device(args["device"])
        report = {"ok": True, "result": side(conn, args)}
    except BaseException:
        report = {"ok": False, "error": traceback.format_exc()}
        send(conn, kind="error", error=report["error"])
    with open(args["out"], "w") as out:
        json.dump(report, out)


# ---- prefill side ----------------------------------------------------------------------
def _prefill_tokens(conn: Connection, args: Args, kv_cache_dtype: KVDType) -> None:
    engine = make_engine(args["prefill_device"], kv_cache_dtype)
    connector = create_kv_connector("torch_dist", engine.runner.pool, timeout_s=args["timeout"])
    for i, ids in enumerate(prompts(args["num_prompts"], seed=len(kv_cache_dtype))):
        rid = f"check-{kv_cache_dtype}-{i}"
        engine.add_request(Request(rid, GREEDY, prompt_ids=ids), prefill_only=True)
        drain(engine, rid)
        export = engine.export_kv(rid)
        handle = connector.publish(rid, export.pages, len(ids))
        digest = digest_pages(engine.runner.pool, export.pages)
        send(conn, kind="request", rid=rid, ids=ids, first=export.first_token,
             handle=handle.model_dump_json(), digest=digest)  # fmt: skip
        recv(conn, args["timeout"])  # "done": the decode side has the pages
        connector.release(rid)
        engine.release_export(rid)
    assert connector.staged() == 0, "staging leaked"
    connector.close()


def _prefill_bandwidth(conn: Connection, args: Args) -> dict[str, Any]:
    device = args["prefill_device"]
    pool = synthetic_pool(args, device, seed=1)
    connector = create_kv_connector("torch_dist", pool, timeout_s=args["timeout"])  # sender
    pages = bandwidth_pages(args, seed=2)
    handle = connector.publish("bandwidth", pages, len(pages) * pool.page_size)
    send(conn, kind="bandwidth", handle=handle.model_dump_json(), digest=digest_pages(pool, pages))
    recv(conn, args["timeout"] * (args["bw_iters"] + 3))
    connector.release("bandwidth")
    connector.close()
    _p2p_sender(conn, args, handle.nbytes)
    gather_s = _timed(lambda: gather_pages(pool, pages), args["bw_iters"], (device,))
    return {"gather_seconds_median": gather_s, "gather_gbps": handle.nbytes / gather_s / 1e9}


def _p2p_sender(conn: Connection, args: Args, nbytes: int) -> None:
    """Rank 0 of a bare pair group: sends ``nbytes`` once per timed receive (+1 warm-up)."""
    store, port = host_store("127.0.0.1", 0, args["timeout"])
    send(conn, kind="p2p", port=port)
    group = make_group(store, 0, 0, _backend(args), "127.0.0.1", args["timeout"])
    buf = torch.empty(nbytes, dtype=torch.uint8, device=args["prefill_device"])
    for _ in range(args["bw_iters"] + 1):
        wait_work(post_send(group, [buf], 1), _backend(args), args["timeout"])
    recv(conn, args["timeout"])
    teardown_group(group, _backend(args))


def _backend(args: Args) -> str:
    return "nccl" if args["prefill_device"].startswith("cuda") else "gloo"


def prefill_side(conn: Connection, args: Args) -> None:
    """The prefill process (spawn target)."""
    guarded(_prefill, conn, args)


def _prefill(conn: Connection, args: Args) -> dict[str, Any]:
    for kv_cache_dtype in args["kv_cache_dtypes"]:
        _prefill_tokens(conn, args, kv_cache_dtype)
    return _prefill_bandwidth(conn, args)


# ---- decode side -----------------------------------------------------------------------
def _decode_one(ctx: dict[str, Any], msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
    engine, colocated, connector = ctx["engine"], ctx["colocated"], ctx["connector"]
    handle = KVHandle.model_validate_json(msg["handle"])
    pages = engine.reserve_kv(len(msg["ids"]))
    assert pages is not None, "decode pool full"
    stats = connector.receive(handle, pages[: handle.num_pages])
    exact = digest_pages(engine.runner.pool, pages[: handle.num_pages]) == msg["digest"]
    send(conn, kind="done")
    ctx["pd_logits"].clear()
    request = Request(msg["rid"], GREEDY, prompt_ids=msg["ids"])
    engine.import_kv(request, msg["first"], pages)
    pd_tokens = _with_first(msg["first"], drain(engine, msg["rid"]))
    ctx["co_logits"].clear()
    colocated.add_request(Request(msg["rid"], GREEDY, prompt_ids=msg["ids"]))
    co_tokens = drain(colocated, msg["rid"])
    diff = (ctx["pd_logits"][0] - ctx["co_logits"][1]).abs().max().item()
    return {
        "kv_cache_dtype": ctx["kv_cache_dtype"],
        "request_id": msg["rid"],
        "prompt_tokens": len(msg["ids"]),
        "pages": handle.num_pages,
        "pages_bit_exact": exact,
        "tokens_equal": pd_tokens == co_tokens,
        "pd_tokens": pd_tokens,
        "colocated_tokens": co_tokens,
        "first_decode_logits_max_abs_diff": diff,
        "first_decode_logits_bit_equal": diff == 0.0,
        "transfer_seconds": stats.seconds,
    }


def _with_first(first: int, streamed: list[int]) -> list[int]:
    """The whole output: the decode stream re-emits the prefill side's first token (and
    carries ``GREEDY.max_new_tokens`` tokens); an engine that does not gets it prepended."""
    return streamed if len(streamed) == GREEDY.max_new_tokens else [first, *streamed]


def _decode_tokens(conn: Connection, args: Args, kv_cache_dtype: KVDType) -> list[dict[str, Any]]:
    engine = make_engine(args["decode_device"], kv_cache_dtype)
    colocated = make_engine(args["decode_device"], kv_cache_dtype)
    connector = create_kv_connector("torch_dist", engine.runner.pool, timeout_s=args["timeout"])
    ctx = {"engine": engine, "colocated": colocated, "connector": connector}
    ctx |= {"pd_logits": record_logits(engine), "co_logits": record_logits(colocated)}
    ctx["kv_cache_dtype"] = kv_cache_dtype
    rows = []
    for _ in range(args["num_prompts"]):
        msg = recv(conn, args["timeout"])
        rows.append(_decode_one(ctx, msg, conn))
    connector.close()
    return rows


def _sync(*devices: str) -> None:
    for device in devices:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], iters: int, devices: tuple[str, ...]) -> float:
    """Median wall seconds of ``fn`` (after one warm-up), synchronising ``devices``."""
    fn()
    _sync(*devices)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(*devices)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _decode_bandwidth(conn: Connection, args: Args) -> dict[str, Any]:
    msg = recv(conn, args["timeout"] * 3)
    handle = KVHandle.model_validate_json(msg["handle"])
    dst_device, src_device = args["decode_device"], args["prefill_device"]
    pool = synthetic_pool(args, dst_device, seed=3)
    options = {"timeout_s": args["timeout"], "chunk_mib": args["chunk_mib"]}
    connector = create_kv_connector("torch_dist", pool, **options)
    dst_pages = bandwidth_pages(args, seed=4)
    connector.receive(handle, dst_pages)  # warm-up: builds the pair and the NCCL comm
    exact = digest_pages(pool, dst_pages) == msg["digest"]
    seconds = [connector.receive(handle, dst_pages).seconds for _ in range(args["bw_iters"])]
    send(conn, kind="done")
    connector.close()
    nbytes, iters = handle.nbytes, args["bw_iters"]
    p2p_s = _p2p_receiver(conn, args, nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    copy_s = _timed(lambda: dst.copy_(src), iters, (src_device, dst_device))
    scatter_s = _timed(lambda: scatter_pages(pool, dst_pages, dst), iters, (dst_device,))
    medians = {"receive": statistics.median(seconds), "p2p": p2p_s, "copy": copy_s}
    medians["scatter"] = scatter_s
    return {
        "layers": 61, "kv_dim": 576, "dtype": "bfloat16", "tokens": args["bw_tokens"],
        "page_size": args["bw_page_size"], "pages": handle.num_pages, "nbytes": nbytes,
        "pages_bit_exact": exact, "iters": iters,
    } | {f"{k}_seconds_median": v for k, v in medians.items()} | {
        f"{k}_gbps": nbytes / v / 1e9 for k, v in medians.items()
    }  # fmt: skip


def _p2p_receiver(conn: Connection, args: Args, nbytes: int) -> float:
    """Median seconds of one bare receive of ``nbytes`` from the prefill process."""
    port = recv(conn, args["timeout"])["port"]
    store = connect_store(Address("127.0.0.1", port, _backend(args), ""), args["timeout"])
    group = make_group(store, 0, 1, _backend(args), "127.0.0.1", args["timeout"])
    buf = torch.empty(nbytes, dtype=torch.uint8, device=args["decode_device"])
    once = lambda: wait_work(post_recv(group, [buf], 0), _backend(args), args["timeout"])  # noqa: E731
    seconds = _timed(once, args["bw_iters"], (args["decode_device"],))
    send(conn, kind="done")
    teardown_group(group, _backend(args))
    return seconds


def decode_side(conn: Connection, args: Args) -> None:
    """The decode process (spawn target)."""
    guarded(_decode, conn, args)


def _decode(conn: Connection, args: Args) -> dict[str, Any]:
    rows = []
    for kv_cache_dtype in args["kv_cache_dtypes"]:
        rows += _decode_tokens(conn, args, kv_cache_dtype)
    return {"tokens": rows, "bandwidth": _decode_bandwidth(conn, args)}
