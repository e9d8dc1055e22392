"""DeepGEMM's grouped GEMMs against our Triton MoE kernels, one MoE layer of DeepSeek-V3
(H=7168, I=2048, top-8 of 256, FP8 block-scaled), for ``bench kernels --only deepgemm``:

* contiguous (prefill, ``--deepgemm-tokens``, all 256 experts on one rank):
  :func:`~dsv3serve.moe.deepgemm_moe.deepgemm_moe_contiguous` vs the fused Triton MoE
  (:func:`~dsv3serve.moe.triton_moe.fused_moe`), both from bf16 tokens and router output to
  the weighted sum; reference :class:`~dsv3serve.moe.ref.TorchRefMoE`;
* masked (DeepEP low-latency layout, one rank of EP ``--deepgemm-masked-ep``: 256 / EP
  local experts, ``[E, 128 * EP, H]`` e4m3 rows with scales as DeepEP's FP8 dispatch
  delivers them, counts from routing ``tokens * EP`` tokens over all 256 experts):
  :func:`~dsv3serve.moe.deepgemm_moe.deepgemm_moe_masked` vs
  :func:`~dsv3serve.moe.masked_moe.masked_moe_triton`; reference
  :func:`~dsv3serve.moe.masked_moe.masked_moe_ref` on the valid rows.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from dsv3serve.bench.kernels.deepgemm import cell, rel_err, speedup, time_call
from dsv3serve.bench.kernels.moe import MOE_SHAPE, routing
from dsv3serve.kernels.fp8_quant import quant_per_token_group_fp8
from dsv3serve.moe.deepgemm_moe import deepgemm_moe_contiguous, deepgemm_moe_masked
from dsv3serve.moe.experts import FusedExperts, random_experts
from dsv3serve.moe.masked_moe import MaskedRoute, masked_moe_ref, masked_moe_triton
from dsv3serve.moe.ref import TorchRefMoE
from dsv3serve.moe.triton_moe import fused_moe

CONTIGUOUS_TOKENS = (1024, 2048, 4096, 8192)
MASKED_TOKENS = (16, 32, 64, 128)  # per rank, the low-latency decode batch
MASKED_MAX_TOKENS = 128  # DeepEP's num_max_dispatch_tokens_per_rank
ERROR_LIMIT = 2e-2  # e4m3 intermediate on both sides


def contiguous_key(e: int) -> str:
    c = MOE_SHAPE
    return f"E={e},N={c['inter']},K={c['hidden']},top_k={c['top_k']}"


def masked_key(e: int, m: int) -> str:
    return f"E={e},N={MOE_SHAPE['inter']},K={MOE_SHAPE['hidden']},M={m}"


def _moe_path(
    fn: Callable[[int], torch.Tensor],
    ref_rows: torch.Tensor,
    valid: Callable[[torch.Tensor], torch.Tensor],
    reps: int,
) -> dict[str, Any]:
    try:
        err = rel_err(valid(fn(0)), ref_rows)
        us, how = time_call(fn, 2, reps)
    except Exception as e:  # JIT failure, unsupported layout: recorded
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"us": us, "rel_err": err, "timing": how}


def contiguous_point(
    module: ModuleType | None, ex: FusedExperts, t: int, reps: int
) -> dict[str, Any]:
    w, ids = routing(t)
    x = torch.randn(t, MOE_SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    stack = ex.stack(False)
    ref = TorchRefMoE(act_quant=True).forward(x, w, ids, ex).float()
    row: dict[str, Any] = {"T": t, "E": ex.num_experts, "baseline": "triton"}
    same = lambda y: y  # noqa: E731
    row["triton"] = _moe_path(lambda i: fused_moe(x, w, ids, *stack), ref, same, reps)
    if module is not None:
        dg = lambda i: deepgemm_moe_contiguous(module, x, w, ids, stack)  # noqa: E731
        row["deepgemm"] = _moe_path(dg, ref, same, reps)
    return row


def masked_inputs(e: int, m: int, t: int, ep: int) -> tuple[torch.Tensor, ...]:
    """Counts of this rank's ``e`` experts when ``t * ep`` tokens route over all of them,
    and e4m3 rows ``[e, m, H]`` with float32 scales ``[e, m, H/128]``."""
    _, ids = routing(t * ep)
    counts = torch.bincount(ids.flatten().long(), minlength=MOE_SHAPE["e"])[:e].int()
    x = torch.randn(e * m, MOE_SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    xq, xs = quant_per_token_group_fp8(x)
    return counts, xq.view(e, m, -1), xs.view(e, m, -1)


def masked_point(
    module: ModuleType | None, ex: FusedExperts, t: int, ep: int, reps: int
) -> dict[str, Any]:
    e, m, c = ex.num_experts, MASKED_MAX_TOKENS * ep, MOE_SHAPE
    counts, xq, xs = masked_inputs(e, m, t, ep)
    stack = ex.stack(False)
    ref = masked_moe_ref(xq, counts, stack, x_scale=xs)
    mask = (torch.arange(m, device="cuda")[None, :] < counts[:, None])[..., None]
    ref_rows = ref.float()[mask.expand_as(ref)]
    valid = lambda y: y[mask.expand_as(y)]  # noqa: E731
    route = MaskedRoute(t * ep, c["top_k"], c["e"])
    expected_m = max(1, -(-t * ep * c["top_k"] // c["e"]))
    row: dict[str, Any] = {"T": t, "E": e, "M": m, "ep": ep, "baseline": "triton"}
    row["rows"] = int(counts.sum())
    tri = lambda i: masked_moe_triton(xq, counts, stack, x_scale=xs, route=route)  # noqa: E731
    row["triton"] = _moe_path(tri, ref_rows, valid, reps)
    if module is not None:
        dg = lambda i: deepgemm_moe_masked(module, xq, counts, stack, expected_m, x_scale=xs)  # noqa: E731
        row["deepgemm"] = _moe_path(dg, ref_rows, valid, reps)
    return row


def run_contiguous(module: ModuleType | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    c = MOE_SHAPE
    ex = random_experts(c["e"], c["hidden"], c["inter"], True, torch.bfloat16, "cuda")
    rows = []
    for t in args.deepgemm_tokens:
        rows.append(contiguous_point(module, ex, t, args.replays))
        print(moe_line(rows[-1]), flush=True)
    del ex
    torch.cuda.empty_cache()
    return rows


def run_masked(module: ModuleType | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    c, ep = MOE_SHAPE, args.deepgemm_masked_ep
    ex = random_experts(c["e"] // ep, c["hidden"], c["inter"], True, torch.bfloat16, "cuda")
    rows = []
    for t in args.deepgemm_masked_tokens:
        rows.append(masked_point(module, ex, t, ep, args.replays))
        print(moe_line(rows[-1]), flush=True)
    del ex
    torch.cuda.empty_cache()
    return rows


def moe_line(r: dict[str, Any]) -> str:
    dg, tr = r.get("deepgemm"), r.get("triton")
    s = speedup(r)
    where = f"E={r['E']}" + (f" M={r['M']} rows={r['rows']}" if "M" in r else "")
    return (
        f"{where:>24} {r['T']:>5} {cell(dg, 'us', '9.1f'):>9} {cell(tr, 'us', '9.1f'):>9} "
        f"{'-' if s is None else format(s, '.2f'):>6} {cell(dg, 'rel_err', '.1e'):>8} "
        f"{cell(tr, 'rel_err', '.1e'):>8}"
    )


def print_moe(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    print(
        f"{'experts':>24} {'T':>5} {'deepgemm':>9} {'triton':>9} {'speed':>6} {'err dg':>8} "
        f"{'err tr':>8}"
    )
    for r in rows:
        print(moe_line(r))
