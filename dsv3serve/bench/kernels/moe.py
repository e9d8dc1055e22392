"""``dsv3serve bench kernels --only moe,gate``: the fused Triton MoE and router gate on
DeepSeek-V3 shapes, against the same run's ceilings (see :mod:`dsv3serve.bench.kernels.timing`).

MoE: one layer's routed experts (E=256, H=7168, I=2048, top-8, FP8 block-scaled), routing
from the real router over random logits. "Bytes" are the expert weights the batch actually
touches (w13 + w2 + their scales, for every expert hit), so ``weight_TBps`` / copy ceiling is
the fraction of bandwidth a decode step gets; TFLOP/s counts ``2 * T * top_k * 3 * H * I`` and
is compared with the fp8 ceiling. All experts (11 GB) exceed the L2 cache many times, and at
T=1 the 8 experts hit (350 MB) still do, so repeated calls read weights from memory.

Shared expert: per T, the fused MoE with the shared expert as expert E (``fused``) against
the routed-only fused MoE plus the shared expert as its own MLP (``separate``: FP8 linears
as the model runs them, Triton at small M and cuBLAS at large M). Bytes add the shared
expert's weights to the experts hit. The largest T up to which ``fused`` wins at every
measured T is what ``--shared-experts-fusion auto`` needs; ``--write-shared-fusion`` stores it
in ``dsv3serve/moe/configs/shared_fusion.json`` for this GPU.

Gate: the Triton kernel against the torch reference (:func:`grouped_topk`) on fp32 logits.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dsv3serve.bench.kernels.timing import graph_us
from dsv3serve.layers.linear import fp8_linear
from dsv3serve.moe.experts import FusedExperts, random_experts
from dsv3serve.moe.gate import grouped_topk
from dsv3serve.moe.gate_triton import grouped_topk_triton
from dsv3serve.moe.moe_config import (
    CONFIG_DIR,
    SHARED_FUSION_FILE,
    get_config,
    shape_key,
    write_shared_fusion,
)
from dsv3serve.moe.shared import append_shared_expert
from dsv3serve.moe.triton_moe import device_name, fused_moe

MOE_SHAPE = {"e": 256, "hidden": 7168, "inter": 2048, "top_k": 8, "n_group": 8, "topk_group": 4}
MOE_TOKENS = (1, 8, 32, 128, 512, 4096)
GATE_TOKENS = (1, 16, 128, 1024, 4096)


def routing(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = MOE_SHAPE
    logits = torch.randn(t, c["e"], device="cuda")
    bias = torch.randn(c["e"], device="cuda") * 0.1
    return grouped_topk(logits, bias, c["top_k"], c["n_group"], c["topk_group"], 2.5)


def _expert_bytes(ex: FusedExperts) -> int:
    """Bytes of one expert's weights and scales."""
    params = [ex.w13, ex.w2, ex.w13_scale_inv, ex.w2_scale_inv]
    return sum(p[0].numel() * p.element_size() for p in params if p is not None)


def moe_point(ex: FusedExperts, t: int, ceil: dict, replays: int) -> dict[str, Any]:
    """Time one fused MoE call on T tokens; bandwidth over the experts hit, TFLOP/s."""
    c = MOE_SHAPE
    w, ids = routing(t)
    x = torch.randn(t, c["hidden"], device="cuda", dtype=torch.bfloat16)
    experts = ex.stack(False)
    us = graph_us(lambda i: fused_moe(x, w, ids, *experts), 4, replays)
    hit = int(torch.unique(ids).numel())
    s = us / 1e6
    weight_tbps = hit * _expert_bytes(ex) / s / 1e12
    tflops = 2 * t * c["top_k"] * 3 * c["hidden"] * c["inter"] / s / 1e12
    cfg = get_config(
        t, c["e"], c["inter"], c["hidden"], c["top_k"], ex.is_fp8, device_name(x.device.index or 0)
    )
    return {
        "T": t,
        "us": us,
        "experts_hit": hit,
        "weight_TBps": weight_tbps,
        "pct_copy_bw": 100 * weight_tbps / ceil["copy_TBps"],
        "TFLOPs": tflops,
        "pct_fp8_peak": 100 * tflops / ceil["fp8_gemm_TFLOPs"],
        "config": cfg.to_json(),
    }


def shared_mlp(ex: FusedExperts, x: torch.Tensor) -> torch.Tensor:
    """The shared expert (slot E) as the unfused model runs it: three FP8 linears."""
    e, i = ex.num_experts, ex.inter
    s13, s2 = ex.w13_scale_inv, ex.w2_scale_inv
    assert s13 is not None and s2 is not None, "the bench runs FP8 experts"
    gate = fp8_linear(x, ex.w13[e, :i], s13[e, : i // 128])
    up = fp8_linear(x, ex.w13[e, i:], s13[e, i // 128 :])
    return fp8_linear(F.silu(gate) * up, ex.w2[e], s2[e])


def shared_point(ex: FusedExperts, t: int, ceil: dict, replays: int) -> dict[str, Any]:
    """Time fused (shared expert as expert E) against routed-only + separate shared MLP."""
    w, ids = routing(t)
    x = torch.randn(t, MOE_SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    routed, with_shared = ex.stack(False), ex.stack(True)

    def fused(i: int) -> torch.Tensor:
        return fused_moe(x, *append_shared_expert(w, ids, ex.num_experts), *with_shared)

    def separate(i: int) -> torch.Tensor:
        return fused_moe(x, w, ids, *routed) + shared_mlp(ex, x)

    times = {
        "fused_us": graph_us(fused, 4, replays),
        "separate_us": graph_us(separate, 4, replays),
        "routed_us": graph_us(lambda i: fused_moe(x, w, ids, *routed), 4, replays),
        "shared_us": graph_us(lambda i: shared_mlp(ex, x), 4, replays),
    }  # fmt: skip
    nbytes = (int(torch.unique(ids).numel()) + 1) * _expert_bytes(ex)
    pct = {
        k.replace("_us", "_pct_copy_bw"): 100 * nbytes / (v / 1e6) / 1e12 / ceil["copy_TBps"]
        for k, v in times.items()
        if k in ("fused_us", "separate_us")
    }
    return {
        "T": t,
        **times,
        "bytes": nbytes,
        **pct,
        "speedup": times["separate_us"] / times["fused_us"],
    }


def fusion_max_tokens(rows: list[dict[str, Any]]) -> int:
    """The largest T up to which fused beat separate at every measured T (-1: not even the
    first)."""
    best = -1
    for r in sorted(rows, key=lambda r: r["T"]):
        if r["speedup"] <= 1.0:
            break
        best = r["T"]
    return best


def gate_point(t: int, replays: int) -> dict[str, Any]:
    """Time the Triton gate and the torch reference on T tokens of fp32 logits."""
    c = MOE_SHAPE
    logits = torch.randn(t, c["e"], device="cuda")
    bias = torch.randn(c["e"], device="cuda") * 0.1
    args = (logits, bias, c["top_k"], c["n_group"], c["topk_group"], 2.5)
    triton_us = graph_us(lambda i: grouped_topk_triton(*args), 8, replays)
    torch_us = graph_us(lambda i: grouped_topk(*args), 8, replays)
    return {"T": t, "triton_us": triton_us, "torch_us": torch_us, "speedup": torch_us / triton_us}


def run_moe(ceil: dict, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per T: the routed-only fused MoE, and under ``"shared"`` fused vs separate."""
    c = MOE_SHAPE
    ex = random_experts(c["e"], c["hidden"], c["inter"], True, torch.bfloat16, "cuda", 1)
    rows = [moe_point(ex, t, ceil, args.replays) for t in args.moe_tokens]
    for row in rows:
        row["shared"] = shared_point(ex, row["T"], ceil, args.replays)
    del ex
    torch.cuda.empty_cache()
    if args.write_shared_fusion:
        key = shape_key(c["e"], c["inter"], c["hidden"], device_name(0), True)
        max_t = fusion_max_tokens([r["shared"] for r in rows])
        write_shared_fusion(Path(args.write_shared_fusion), key, max_t)
        print(f"{args.write_shared_fusion}: {key} -> {max_t}")
    return rows


def run_gate(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [gate_point(t, args.replays) for t in args.gate_tokens]


def print_moe(rows: list[dict]) -> None:
    print("fused MoE, E=256 H=7168 I=2048 top-8, fp8 block-scaled (bytes: experts hit)")
    print(
        f"{'T':>5} {'us':>9} {'hit':>4} {'TB/s':>6} {'%copy':>6} {'TFLOP/s':>8} {'%fp8':>5} "
        f"{'block_m':>7}"
    )
    for r in rows:
        print(
            f"{r['T']:>5} {r['us']:>9.1f} {r['experts_hit']:>4} {r['weight_TBps']:>6.2f} "
            f"{r['pct_copy_bw']:>6.1f} {r['TFLOPs']:>8.1f} {r['pct_fp8_peak']:>5.1f} "
            f"{r['config']['block_m']:>7}"
        )
    if rows and "shared" in rows[0]:
        print_shared(rows)


def print_shared(rows: list[dict]) -> None:
    shared = [r["shared"] for r in rows]
    print("shared expert fused as expert E vs routed-only + separate shared MLP (bytes: hit + 1)")
    print(
        f"{'T':>5} {'fused us':>9} {'sep us':>9} {'routed':>9} {'shared':>8} {'%copy f':>7} "
        f"{'%copy s':>7} {'speedup':>7}"
    )
    for r in shared:
        print(
            f"{r['T']:>5} {r['fused_us']:>9.1f} {r['separate_us']:>9.1f} {r['routed_us']:>9.1f} "
            f"{r['shared_us']:>8.1f} {r['fused_pct_copy_bw']:>7.1f} "
            f"{r['separate_pct_copy_bw']:>7.1f} {r['speedup']:>7.2f}"
        )
    print(f"fused faster at every T up to {fusion_max_tokens(shared)} (-1: none)")


def print_gate(rows: list[dict]) -> None:
    print("router gate, E=256, 8 groups, top-4 groups, top-8")
    print(f"{'T':>5} {'triton us':>9} {'torch us':>9} {'speedup':>7}")
    for r in rows:
        print(f"{r['T']:>5} {r['triton_us']:>9.1f} {r['torch_us']:>9.1f} {r['speedup']:>7.1f}")


def add_moe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--moe-tokens", type=int, nargs="+", default=list(MOE_TOKENS))
    p.add_argument("--gate-tokens", type=int, nargs="+", default=list(GATE_TOKENS))
    p.add_argument(
        "--write-shared-fusion",
        nargs="?",
        const=str(CONFIG_DIR / SHARED_FUSION_FILE),
        default=None,
        metavar="PATH",
        help="store where fusing the shared expert won, for --shared-experts-fusion auto "
        "(default path: the shipped dsv3serve/moe/configs/shared_fusion.json)",
    )
