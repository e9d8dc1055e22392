"""Time expert-parallel dispatch + combine: torch.distributed all-to-all vs DeepEP.

Not a test: prints a table and writes JSON (``--out``). Spawns ``--ranks`` processes itself
(no torchrun): NCCL on one GPU each (``--device cuda``), or gloo on CPU (``--device cpu``,
for a smoke run at small sizes). Each rank routes its tokens to top-k of E experts at random
(uniform), so every rank sends and receives about the same; the experts are the identity,
so only the movement (and, for fp8, the quantisation) is timed.

Backends (``--backend``, default all): ``a2a`` (:class:`AllToAllDispatcher`),
``deepep_normal`` and ``deepep_ll`` (dsv3serve's :class:`DeepEPDispatcher` in normal and
low-latency mode; see ``dispatch_bench_lib.py``). A DeepEP backend whose ``deep_ep`` does
not import gives rows marked skipped, with the reason. Low-latency rows above
``NVSHMEM_QP_DEPTH / 2 - 1`` tokens (511 at DeepEP's default depth 1024) are skipped too:
DeepEP asserts the depth covers ``2 * (tokens + 1)`` (set the variable to go higher).

Ceiling: a plain point-to-point send of the same bytes from rank 0 to rank 1. ``bytes`` is
the busiest rank's traffic to other ranks (dispatch rows out + combine rows back, excluding
its copies to itself); ``ratio`` is the backend's bandwidth over that ceiling's.

    python benchmarks/bench_dispatch.py --device cuda --ranks 8 --out docs/perf/dispatch.json
    python benchmarks/bench_dispatch.py --device cpu --ranks 2 --tokens 1 8 --hidden 256 \\
        --out /tmp/dispatch_cpu.json

CPU smoke of the DeepEP rows over the fake (``tests/support`` on ``PYTHONPATH``): add
``--deep-ep-module fake_deep_ep``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.parallel.dispatch_a2a import A2AState, AllToAllDispatcher
from dsv3serve.parallel.dispatch_pack import WireFormat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dispatch_bench_lib import (  # noqa: E402  (a sibling script module, not a package)
    DEEPEP_MODES,
    inputs,
    ll_token_limit,
    load_deep_ep,
    make_deepep,
    max_over_ranks,
    measure_deepep,
    p2p_seconds,
    timed,
    with_ceiling,
)

PAYLOADS = {"bf16": None, "fp8": FP8_DTYPE}
BACKENDS = ["a2a", *DEEPEP_MODES]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--ranks", type=int, default=None, help="default: all GPUs, or 2 on CPU")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 4096])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--payload", nargs="+", choices=list(PAYLOADS), default=list(PAYLOADS))
    p.add_argument("--backend", nargs="+", choices=BACKENDS, default=BACKENDS)
    p.add_argument("--deep-ep-module", default="deep_ep", help=argparse.SUPPRESS)
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


def _off_rank_bytes(state: A2AState, row_bytes: int, hidden_bytes: int, rank: int) -> int:
    """This rank's bytes to other ranks: dispatch rows out plus combine rows back."""
    sent = sum(n for r, n in enumerate(state.send_counts) if r != rank)
    returned = sum(n for r, n in enumerate(state.recv_counts) if r != rank)
    return sent * row_bytes + returned * hidden_bytes


def measure(args: argparse.Namespace, payload: str, tokens: int, device: torch.device) -> dict:
    """One row of the table: dispatch, combine and round-trip times, bytes, the p2p ceiling."""
    d = AllToAllDispatcher(args.experts, payload_dtype=PAYLOADS[payload])
    x, ids, weights = inputs(args, tokens, device)
    got = d.dispatch(x, ids, weights)  # combine is timed on this one (it reads only splits)
    times = {
        "dispatch": timed(lambda: d.dispatch(x, ids, weights), args, device),
        "combine": timed(lambda: d.combine(got.x, got), args, device),
        "total": timed(lambda: d.combine(got.x, d.dispatch(x, ids, weights)), args, device),
    }
    wire = WireFormat(args.hidden, args.topk, x.dtype, d.payload_dtype)
    mine = _off_rank_bytes(got.state, wire.row_bytes, args.hidden * 2, d.rank)
    nbytes = int(max_over_ranks(mine, device))
    row = {"backend": "a2a", "payload": payload, "tokens_per_rank": tokens}
    row["max_copies_sent"] = int(max_over_ranks(len(got.state.src_token), device))
    row["bytes_off_rank"] = nbytes
    row.update({f"{k}_us": seconds * 1e6 for k, seconds in times.items()})
    return with_ceiling(row, nbytes / times["total"], p2p_seconds(nbytes, args, device))


def _meta(args: argparse.Namespace, device: torch.device) -> dict:
    meta = {
        "backends": {
            "a2a": "torch all_to_all_single (AllToAllDispatcher)",
            "deepep_normal": "DeepEPDispatcher normal: dispatch / combine",
            "deepep_ll": "DeepEPDispatcher low_latency: dispatch_masked / combine_masked",
        },
        "deep_ep_module": args.deep_ep_module,
        "ll_max_tokens_per_rank": ll_token_limit()[0],
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
    """The rows as a fixed-width table (bytes in kB, times in microseconds); skipped rows
    say why. ``*`` after combine: derived as total - dispatch."""
    print(
        "backend       payload tokens copies        kB  disp_us  comb_us total_us"
        "      GB/s  p2p GB/s  ratio"
    )
    for r in rows:
        head = f"{r['backend']:<13} {r['payload']:>7} {r['tokens_per_rank']:>6}"
        if "skipped" in r:
            print(f"{head} skipped: {r['skipped']}")
            continue
        star = "*" if r.get("combine_derived") else " "
        print(
            f"{head} {r['max_copies_sent']:>6} "
            f"{r['bytes_off_rank'] / 1e3:>9.1f} {r['dispatch_us']:>8.1f} {r['combine_us']:>7.1f}"
            f"{star}{r['total_us']:>8.1f} {r['GBps']:>9.4g} {r['p2p_GBps']:>9.4g} "
            f"{r['ratio_to_p2p']:>6.3f}"
        )


def _skip(backend: str, payload: str, tokens: int, why: str) -> dict:
    return {"backend": backend, "payload": payload, "tokens_per_rank": tokens, "skipped": why}


def _deepep_rows(
    args: argparse.Namespace, backend: str, payload: str, device: torch.device
) -> list[dict]:
    """One dispatcher for (backend, payload), reused over the token counts."""
    deep_ep, why = load_deep_ep(args.deep_ep_module)
    if deep_ep is None:
        return [_skip(backend, payload, t, why) for t in args.tokens]
    try:
        d, why = make_deepep(deep_ep, backend, PAYLOADS[payload], args), ""
    except Exception as e:  # e.g. the QP-depth refusal, NVSHMEM start-up; the run goes on
        d, why = None, f"buffer not built ({type(e).__name__}: {str(e)[:300]})"
    if max_over_ranks(float(d is None), device):  # every rank skips if one could not build
        return [
            _skip(backend, payload, t, why or "buffer not built on another rank")
            for t in args.tokens
        ]
    limit, limit_why = ll_token_limit()
    rows = []
    for t in args.tokens:
        if backend == "deepep_ll" and t > limit:
            rows.append(_skip(backend, payload, t, limit_why))
            continue
        row = {"backend": backend, "payload": payload, "tokens_per_rank": t}
        row.update(measure_deepep(d, args, t, device))
        nbytes = row["bytes_off_rank"]
        p2p = p2p_seconds(nbytes, args, device)
        rows.append(with_ceiling(row, nbytes / (row["total_us"] / 1e6), p2p))
    return rows


def _write(args: argparse.Namespace, device: torch.device, rows: list[dict]) -> None:
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps({"meta": _meta(args, device), "rows": rows}, indent=1))


def all_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Every (backend, payload, tokens) row, backends in the order given; ``--out`` is
    rewritten after each (backend, payload), so a later hang keeps the earlier rows."""
    rows: list[dict] = []
    for backend in args.backend:
        for p in args.payload:
            if backend == "a2a":
                rows += [measure(args, p, t, device) for t in args.tokens]
            else:
                rows += _deepep_rows(args, backend, p, device)
            _write(args, device, rows)
    return rows


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
        rows = all_rows(args, device)
        if rank == 0:
            print_table(rows)
            print(f"wrote {args.out}")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(args, f"{tmp}/pg"), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
