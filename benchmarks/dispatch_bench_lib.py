"""Helpers of ``bench_dispatch.py``: timing, the p2p ceiling, and the DeepEP rows.

DeepEP rows time dsv3serve's own :class:`DeepEPDispatcher` (normal: ``dispatch`` /
``combine``; low-latency: ``dispatch_masked`` / ``combine_masked``, which include the glue's
dequantisation of fp8 rows on arrival). Their ``bytes_off_rank`` is counted from the routing
on the host before timing, as for the all-to-all rows: the busiest rank's rows to other ranks
(dispatch) plus the rows it sends back (combine). Normal mode sends a token once per
destination rank; low-latency mode once per (token, expert) pair.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.distributed as dist

from dsv3serve.parallel.dispatch_deepep import DeepEPDispatcher, DeepEPShape

DEEPEP_MODES = {"deepep_normal": "normal", "deepep_ll": "low_latency"}
_BUFFERS: dict[str, object] = {}  # one deep_ep.Buffer per mode, shared by both payloads


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def timed(fn: Callable[[], object], args: argparse.Namespace, device: torch.device) -> float:
    """Seconds per call of ``fn`` on the slowest rank (after ``--warmup`` calls)."""
    for _ in range(args.warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        fn()
    sync(device)
    return max_over_ranks((time.perf_counter() - start) / args.iters, device)


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def p2p_seconds(nbytes: int, args: argparse.Namespace, device: torch.device) -> float:
    """Seconds per send of ``nbytes`` from rank 0 to rank 1 (the other ranks wait)."""
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    rank = dist.get_rank()

    def copy() -> None:
        if rank == 0:
            dist.send(buf, dst=1)
        elif rank == 1:
            dist.recv(buf, src=0)

    return timed(copy, args, device)


def with_ceiling(row: dict, bytes_per_s: float, p2p_s: float) -> dict:
    """``row`` plus GB/s, the p2p copy's time and GB/s, and the ratio of the two."""
    p2p_bytes_per_s = row["bytes_off_rank"] / p2p_s
    row["GBps"] = bytes_per_s / 1e9
    row["p2p_us"] = p2p_s * 1e6
    row["p2p_GBps"] = p2p_bytes_per_s / 1e9
    row["ratio_to_p2p"] = bytes_per_s / p2p_bytes_per_s if p2p_bytes_per_s else 0.0
    return row


def inputs(
    args: argparse.Namespace, tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, args.hidden, device=device).to(torch.bfloat16)
    ids = torch.rand(tokens, args.experts, device=device).topk(args.topk, dim=1).indices
    weights = torch.rand(tokens, args.topk, device=device)
    return x, ids, weights


# -- DeepEP ------------------------------------------------------------------------------


def load_deep_ep(name: str) -> tuple[ModuleType | None, str]:
    """The module (or a fake's ``make_module()``), or None and why it did not import."""
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # ImportError, or DeepEP's own init asserts
        return None, f"{name} does not import ({type(e).__name__}: {e})"
    if not hasattr(mod, "Buffer") and hasattr(mod, "make_module"):
        mod = mod.make_module()  # tests/support/fake_deep_ep.py
    return mod, ""


def ll_token_limit() -> tuple[int, str]:
    """The most tokens per rank DeepEP's low-latency mode takes under NVSHMEM_QP_DEPTH."""
    depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
    return depth // 2 - 1, f"NVSHMEM_QP_DEPTH {depth} < 2*(tokens+1)"


class _SharedBufferDispatcher(DeepEPDispatcher):
    """The glue unchanged, but the bf16 and fp8 dispatchers of one mode share a buffer
    (DeepEP's tests make one Buffer per process; NVSHMEM is initialised once)."""

    def _make_buffer(self) -> object:
        if self.mode not in _BUFFERS:
            _BUFFERS[self.mode] = super()._make_buffer()
        return _BUFFERS[self.mode]


def make_deepep(
    deep_ep: ModuleType, backend: str, payload_dtype: torch.dtype | None, args: argparse.Namespace
) -> DeepEPDispatcher:
    """One dispatcher per (backend, payload); LL sized for the largest LL token count."""
    limit, _ = ll_token_limit()
    ll_tokens = [t for t in args.tokens if t <= limit] or [1]
    shape = DeepEPShape(args.experts, args.hidden, max(ll_tokens))
    return _SharedBufferDispatcher(deep_ep, shape, DEEPEP_MODES[backend], None, payload_dtype)


def _copies_per_rank(ids: torch.Tensor, local: int, world: int, per_token: bool) -> list[int]:
    """Rows this rank sends to each rank: per (token, expert), or per token and rank."""
    dest = (ids.cpu() // local).long()
    if per_token:
        hit = torch.zeros(ids.shape[0], world, dtype=torch.bool)
        hit.scatter_(1, dest, True)
        return hit.sum(0).tolist()
    return torch.bincount(dest.flatten(), minlength=world).tolist()


def deepep_bytes(d: DeepEPDispatcher, ids: torch.Tensor, device: torch.device) -> tuple[int, int]:
    """(busiest rank's off-rank bytes, its most rows sent) for this routing."""
    per_token = d.mode == "normal"
    sent = _copies_per_rank(ids, d.num_local_experts, d.world, per_token)
    matrix = torch.zeros(d.world, d.world, dtype=torch.float64, device=device)
    matrix[d.rank] = torch.tensor(sent, dtype=torch.float64, device=device)
    dist.all_reduce(matrix)  # row r: rank r's rows to each rank
    m = matrix.cpu()
    out = sum(int(m[d.rank, r]) for r in range(d.world) if r != d.rank)
    back = sum(int(m[r, d.rank]) for r in range(d.world) if r != d.rank)
    mine = out * d._row_bytes() + back * 2 * d.shape.hidden
    return int(max_over_ranks(mine, device)), int(max_over_ranks(sum(sent), device))


def _round_trip(
    d: DeepEPDispatcher,
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    expert_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch then combine with identity experts. ``expert_out``: the bf16 rows the
    experts return under FP8 dispatch (made once, outside the timing: a real MoE writes
    bf16 rows from the e4m3 ones, so dequantising the buffer is no part of DeepEP's cost)."""
    if d.mode == "normal":
        got = d.dispatch(x, ids, w)
        return d.combine(got.x, got)
    got = d.dispatch_masked(x, ids, w)
    return d.combine_masked(got.x if expert_out is None else expert_out, got)


def measure_deepep(
    d: DeepEPDispatcher, args: argparse.Namespace, tokens: int, device: torch.device
) -> dict:
    """One DeepEP row: dispatch, combine and round-trip times, bytes, max rows sent (the
    p2p ceiling is added by the caller). Low-latency combine is not timed alone (it would
    repeat on one handle): it is ``total - dispatch``, flagged ``combine_derived``."""
    x, ids, w = inputs(args, tokens, device)
    nbytes, copies = deepep_bytes(d, ids, device)
    normal = d.mode == "normal"
    disp = d.dispatch if normal else d.dispatch_masked
    got = disp(x, ids, w)
    times = {"dispatch": timed(lambda: disp(x, ids, w), args, device)}
    if normal:
        times["combine"] = timed(lambda: d.combine(got.x, got), args, device)
    expert_out = None if normal or got.x_scale is None else got.rows()
    times["total"] = timed(lambda: _round_trip(d, x, ids, w, expert_out), args, device)
    if not normal:
        times["combine"] = max(times["total"] - times["dispatch"], 0.0)
    row = {"max_copies_sent": copies, "bytes_off_rank": nbytes, "combine_derived": not normal}
    row.update({f"{k}_us": times[k] * 1e6 for k in ("dispatch", "combine", "total")})
    return row
