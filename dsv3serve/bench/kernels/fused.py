"""``dsv3serve bench kernels --only fused``: the fused norm kernels beside the torch ops
they replace, on DeepSeek-V3's widths, at decode token counts (``--fused-rows``).

Rows: ``norm_quant`` (residual add + RMSNorm + 1x128 FP8 quantisation at hidden 7168,
:mod:`dsv3serve.kernels.norm_quant`), ``mla_norm`` (the q and kv norms of the MLA
down-projection, q_lora 1536 quantised, kv_lora 512 + rope 64:
:mod:`dsv3serve.kernels.mla_norm`) and ``rope_kv`` (RoPE inside the bf16 KV-cache write,
with the query's rope part over 128 heads: :mod:`dsv3serve.kernels.rope_kv`). Each kernel
and its reference (``*_ref``) are timed the same way (:func:`~.timing.graph_us`, eagerly
where a reference cannot be captured); their inputs stay the same tensors, in the L2 cache,
as after the layer's previous op. Bandwidth: the bytes each fused kernel moves at least
(inputs read, outputs written) over its time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from dsv3serve.bench.kernels.timing import eager_us, graph_us
from dsv3serve.kernels.mla_norm import qkv_a_rmsnorm_ref, qkv_a_rmsnorm_triton
from dsv3serve.kernels.norm_quant import add_rmsnorm_quant_ref, add_rmsnorm_quant_triton
from dsv3serve.kernels.rope_kv import rope_kv_write_ref, rope_kv_write_triton

HIDDEN, Q_LORA, KV_LORA, ROPE, HEADS = 7168, 1536, 512, 64, 128
FUSED_ROWS = (1, 64)
CALLS = 16  # calls per graph
EPS = 1e-6
Pair = tuple[Callable[[], Any], Callable[[], Any], int]  # fused, reference, bytes moved


def add_fused_args(p: argparse.ArgumentParser) -> None:
    """The fused part's flags of ``bench kernels``."""
    p.add_argument("--fused-rows", type=int, nargs="+", default=list(FUSED_ROWS))


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(torch.bfloat16)


def _fp8_bytes(t: int, width: int) -> int:
    """e4m3 values and their float32 scales (one per 128) of ``t`` rows."""
    return t * width + t * -(-width // 128) * 4


def norm_quant(m: int) -> Pair:
    """Reads x, residual and the weight; writes x + residual and the quantised norm."""
    x, r, w = _bf16(m, HIDDEN), _bf16(m, HIDDEN), 1 + 0.1 * _bf16(HIDDEN)
    moved = 3 * m * HIDDEN * 2 + HIDDEN * 2 + _fp8_bytes(m, HIDDEN)
    return (
        lambda: add_rmsnorm_quant_triton(x, r, w, EPS),
        lambda: add_rmsnorm_quant_ref(x, r, w, EPS),
        moved,
    )


def mla_norm(t: int) -> Pair:
    """Reads q_a, kv_a and both weights; writes the quantised q and the latent."""
    packed = _bf16(t, Q_LORA + KV_LORA + ROPE)
    q_a, kv_a = packed.split([Q_LORA, KV_LORA + ROPE], -1)
    q_w, kv_w = 1 + 0.1 * _bf16(Q_LORA), 1 + 0.1 * _bf16(KV_LORA)
    args = (q_a, kv_a, q_w, kv_w, EPS, EPS, True)
    latent = t * (KV_LORA + ROPE) * 2
    moved = packed.numel() * 2 + (Q_LORA + KV_LORA) * 2 + _fp8_bytes(t, Q_LORA) + latent
    return lambda: qkv_a_rmsnorm_triton(*args), lambda: qkv_a_rmsnorm_ref(*args), moved


def rope_kv(t: int, page_size: int = 64) -> Pair:
    """Reads the latent, cos/sin, slots and q_pe; writes the cache rows and rotated q_pe."""
    width = KV_LORA + ROPE
    latent = _bf16(t, width)
    angle = torch.rand(t, ROPE // 2, device="cuda") * 6.3
    cos, sin = angle.cos(), angle.sin()
    pages = -(-2 * t // page_size)
    slots = torch.randperm(pages * page_size, device="cuda")[:t]
    kv = torch.zeros(pages, page_size, width, dtype=torch.bfloat16, device="cuda")
    q_pe = _bf16(t, HEADS, 2 * ROPE)[:, :, ROPE:]  # a strided view, as q_b_proj's output
    args = (latent, cos, sin, slots, kv, None, q_pe)
    moved = 2 * t * width * 2 + 2 * cos.numel() * 4 + t * 8 + 2 * t * HEADS * ROPE * 2
    return lambda: rope_kv_write_triton(*args), lambda: rope_kv_write_ref(*args), moved


KERNELS: dict[str, Callable[[int], Pair]] = {
    "norm_quant": norm_quant,
    "mla_norm": mla_norm,
    "rope_kv": rope_kv,
}


def _time(fn: Callable[[], Any], replays: int) -> tuple[float, str]:
    try:
        return graph_us(lambda i: fn(), CALLS, replays), "cuda-graph"
    except Exception as err:  # a capture failure: time eagerly, and say so
        print(f"CUDA graph capture failed ({err}); timing eager calls")
        return eager_us(lambda i: fn(), CALLS, replays), "eager"


def run_fused(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (kernel, token count): the fused kernel's and the reference's time."""
    rows = []
    for name, make in KERNELS.items():
        for t in args.fused_rows:
            fused, ref, moved = make(t)
            us, timing = _time(fused, args.replays)
            ref_us, ref_timing = _time(ref, args.replays)
            rows.append(
                {"kernel": name, "rows": t, "us": us, "ref_us": ref_us, "bytes": moved,
                 "GBps": moved / us / 1e3, "timing": timing, "ref_timing": ref_timing}
            )  # fmt: skip
    return rows


def print_fused(rows: list[dict[str, Any]]) -> None:
    """One line per row; ``x ref``: the reference's time over the fused kernel's."""
    print("Fused norm kernels vs their torch references (DeepSeek-V3 widths)")
    print(f"{'kernel':>10} {'rows':>5} {'us':>8} {'GB/s':>7} {'ref us':>8} {'x ref':>6}")
    for r in rows:
        print(
            f"{r['kernel']:>10} {r['rows']:>5} {r['us']:>8.2f} {r['GBps']:>7.1f} "
            f"{r['ref_us']:>8.2f} {r['ref_us'] / r['us']:>6.2f}"
        )
