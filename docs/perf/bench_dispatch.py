"""Time expert-parallel dispatch + combine of the torch.distributed all-to-all backend.

Not a test: prints a table and writes JSON (``--out``). Spawns ``--ranks`` processes itself
(no torchrun): NCCL on one GPU each (``--device cuda``), or gloo on CPU (``--device cpu``,
for a smoke run at small sizes). Each rank routes its tokens to top-k of E experts at random
(uniform), so every rank sends and receives about the same; the experts are the identity,
so only the movement (and, for fp8, the quantisation) is timed.

Ceiling: a plain point-to-point send of the same bytes from rank 0 to rank 1. ``bytes`` is
the busiest rank's traffic to other ranks (dispatch rows out + combine rows back, excluding
its copies to itself); ``ratio`` is the all-to-all's bandwidth over that ceiling's.

    python docs/perf/bench_dispatch.py --device cuda --ranks 8 --out docs/perf/dispatch.json
    python docs/perf/bench_dispatch.py --device cpu --ranks 2 --tokens 1 8 --hidden 256 \\
        --out /tmp/dispatch_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.parallel.dispatch_a2a import A2AState, AllToAllDispatcher
from dsv3serve.parallel.dispatch_pack import WireFormat

PAYLOADS = {"bf16": None, "fp8": FP8_DTYPE}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--ranks", type=int, default=None, help="default: all GPUs, or 2 on CPU")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 4096])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--payload", nargs="+", choices=list(PAYLOADS), default=list(PAYLOADS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args(argv)
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.ranks < 2:
        p.error(
            f"--ranks: expected at least 2 (the ceiling is a copy between two), got {args.ranks}"
        )
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _timed(fn: Callable[[], object], args: argparse.Namespace, device: torch.device) -> float:
    """Seconds per call of ``fn`` on the slowest rank (after ``--warmup`` calls)."""
    for _ in range(args.warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        fn()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64)
    elapsed = elapsed.to(device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _inputs(
    args: argparse.Namespace, tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, args.hidden, device=device).to(torch.bfloat16)
    ids = torch.rand(tokens, args.experts, device=device).topk(args.topk, dim=1).indices
    weights = torch.rand(tokens, args.topk, device=device)
    return x, ids, weights


def _off_rank_bytes(state: A2AState, row_bytes: int, hidden_bytes: int, rank: int) -> int:
    """This rank's bytes to other ranks: dispatch rows out plus combine rows back."""
    sent = sum(n for r, n in enumerate(state.send_counts) if r != rank)
    returned = sum(n for r, n in enumerate(state.recv_counts) if r != rank)
    return sent * row_bytes + returned * hidden_bytes


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _p2p_seconds(nbytes: int, args: argparse.Namespace, device: torch.device) -> float:
    """Seconds per send of ``nbytes`` from rank 0 to rank 1 (the other ranks wait)."""
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    rank = dist.get_rank()

    def copy() -> None:
        if rank == 0:
            dist.send(buf, dst=1)
        elif rank == 1:
            dist.recv(buf, src=0)

    return _timed(copy, args, device)


def measure(args: argparse.Namespace, payload: str, tokens: int, device: torch.device) -> dict:
    """One row of the table: dispatch, combine and round-trip times, bytes, the p2p ceiling."""
    d = AllToAllDispatcher(args.experts, payload_dtype=PAYLOADS[payload])
    x, ids, weights = _inputs(args, tokens, device)
    got = d.dispatch(x, ids, weights)  # combine is timed on this one (it reads only splits)
    times = {
        "dispatch": _timed(lambda: d.dispatch(x, ids, weights), args, device),
        "combine": _timed(lambda: d.combine(got.x, got), args, device),
        "total": _timed(lambda: d.combine(got.x, d.dispatch(x, ids, weights)), args, device),
    }
    wire = WireFormat(args.hidden, args.topk, x.dtype, d.payload_dtype)
    mine = _off_rank_bytes(got.state, wire.row_bytes, args.hidden * 2, d.rank)
    nbytes = int(_max_over_ranks(mine, device))
    row = {"payload": payload, "tokens_per_rank": tokens}
    row["max_copies_sent"] = int(_max_over_ranks(len(got.state.src_token), device))
    row["bytes_off_rank"] = nbytes
    row.update({f"{k}_us": seconds * 1e6 for k, seconds in times.items()})
    return _with_ceiling(row, nbytes / times["total"], _p2p_seconds(nbytes, args, device))


def _with_ceiling(row: dict, bytes_per_s: float, p2p_s: float) -> dict:
    p2p_bytes_per_s = row["bytes_off_rank"] / p2p_s
    row["GBps"] = bytes_per_s / 1e9
    row["p2p_us"] = p2p_s * 1e6
    row["p2p_GBps"] = p2p_bytes_per_s / 1e9
    row["ratio_to_p2p"] = bytes_per_s / p2p_bytes_per_s if p2p_bytes_per_s else 0.0
    return row


def _meta(args: argparse.Namespace, device: torch.device) -> dict:
    meta = {
        "backend": "torch all_to_all_single",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "ranks": args.ranks,
        "hidden": args.hidden,
        "experts": args.experts,
        "topk": args.topk,
        "iters": args.iters,
        "warmup": args.warmup,
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return meta


def print_table(rows: list[dict]) -> None:
    """The rows as a fixed-width table (bytes in kB, times in microseconds)."""
    print("payload tokens copies        kB  disp_us  comb_us total_us      GB/s  p2p GB/s  ratio")
    for r in rows:
        print(
            f"{r['payload']:>7} {r['tokens_per_rank']:>6} {r['max_copies_sent']:>6} "
            f"{r['bytes_off_rank'] / 1e3:>9.1f} {r['dispatch_us']:>8.1f} {r['combine_us']:>8.1f} "
            f"{r['total_us']:>8.1f} {r['GBps']:>9.4g} {r['p2p_GBps']:>9.4g} "
            f"{r['ratio_to_p2p']:>6.3f}"
        )


def _rank_main(rank: int, args: argparse.Namespace, store: str) -> None:
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=args.ranks
    )
    try:
        torch.manual_seed(1234 + rank)
        rows = [measure(args, p, t, device) for p in args.payload for t in args.tokens]
        if rank == 0:
            print_table(rows)
            args.out.write_text(json.dumps({"meta": _meta(args, device), "rows": rows}, indent=1))
            print(f"wrote {args.out}")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(args, f"{tmp}/pg"), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
