"""``dsv3serve bench kernels --only mla``: MLA decode through the attention backends.

DeepSeek-V3 shapes (128 heads, latent 512 + rope 64, bf16 queries), one new token per
sequence over a paged cache whose pages are shuffled as an engine's would be. Rows:
flashinfer (bf16 pool; page or token indices; skipped where flashinfer does not import),
our bf16-dot Triton kernel (:mod:`dsv3serve.kernels.mla_decode`) on bf16 and fp8 pools
(``triton-bf16``, ``triton-fp8``), and the FP8 tensor-core kernel
(:mod:`dsv3serve.kernels.mla_decode_fp8`, ``triton-fp8mma``) on the fp8 pool, over the
configs of ``FP8_CONFIGS`` (``--mla-fp8-configs``), and FlashMLA's decode kernels
(``flashmla-bf16``; ``flashmla-fp8``: e4m3 q and KV, one scale per layer; skipped where
``flash_mla`` does not import). Each point plans once, then
times ``forward_absorbed`` as the model calls it (``q_latent`` and ``q_pe`` two tensors,
as the W_UK product and the rotary op give them), in a CUDA graph (see
``kernels.graph_us``); consecutive calls read different layers of the pool, together
over 4x the L2 cache, so each call reads its KV from device memory. The
``flashmla-bf16-kernel`` / ``flashmla-fp8-kernel`` rows time FlashMLA's kernel alone on the
same pool and batch, ``q`` packed before timing (:mod:`.mla_flashmla`): a backend row's
time over its kernel row's is what the backend adds.

Bandwidth: bytes moved at least (the cached latents of every sequence, 576 values per
token, with fp8 its float32 scale; plus q and the bf16 output) over the time, as a
percentage of the same run's device copy bandwidth; ``x_flashinfer``: flashinfer's time
(bf16, page indices) at the same point over the row's (above 1: faster). TFLOP/s:
``2 * heads * tokens * (2 * 512 + 64)`` per call (QK^T over 576, PV over 512; padding and
duplicated work not counted).
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from dsv3serve.attention.base import AttentionBackend, MLADims
from dsv3serve.bench.kernels.timing import eager_us, graph_us
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kernels.mla_decode import MLADecodeConfig, decode_bytes
from dsv3serve.kernels.mla_decode_fp8 import FP8MLAConfig, decode_flops
from dsv3serve.kvcache.pool import FP8Scales, MLAKVPool, bytes_per_page

MLA_BATCHES = (1, 32, 64, 128)
MLA_CONTEXTS = (1024, 4096, 16384)
KERNELS = (
    "flashinfer",
    "triton-bf16",
    "triton-fp8",
    "triton-fp8mma",
    "flashmla-bf16",
    "flashmla-fp8",
    "flashmla-bf16-kernel",
    "flashmla-fp8-kernel",
)
FP8_KERNELS = ("triton-fp8", "triton-fp8mma", "flashmla-fp8", "flashmla-fp8-kernel")
_W8 = FP8MLAConfig(num_warps=8, dv_split=1, ctas_per_sm=1)
FP8_CONFIGS = {  # name: FP8MLAConfig; spills are ptxas's (sm_90a, triton 3.6), not timed yet
    "n32w4dv2": FP8MLAConfig(),  # the default: 241 registers, no spills, 2 programs an SM
    "n32w4dv2s3": FP8MLAConfig(num_stages=3),
    "n64w4dv2": FP8MLAConfig(block_n=64),  # spills ~120 B
    "n32w8": _W8,  # 247 registers, no spills
    "n32w8s3": replace(_W8, num_stages=3),
    "n64w8": replace(_W8, block_n=64),  # spills ~90 B
    "n32w8pf": replace(_W8, prefetch=True),  # spills ~230 B
}
MAX_COPIES = 64
DIMS = MLADims(128, 512, 128, 64, 128, 192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
TARGET_PCT = 75.0  # of copy bandwidth at batch >= 32


def add_mla_args(p: argparse.ArgumentParser) -> None:
    """The MLA part's flags of ``bench kernels``."""
    p.add_argument("--mla-batch", type=int, nargs="+", default=list(MLA_BATCHES))
    p.add_argument("--mla-context", type=int, nargs="+", default=list(MLA_CONTEXTS))
    p.add_argument("--mla-page-size", type=int, default=64)
    p.add_argument(
        "--mla-index",
        nargs="+",
        choices=["page", "token"],
        default=["page", "token"],
        help="flashinfer: KV indices by page, or one per token slot (page_size 1)",
    )
    p.add_argument(
        "--mla-kernels",
        nargs="+",
        choices=list(KERNELS),
        default=list(KERNELS),
        help="flashinfer on a bf16 pool; our bf16-dot Triton kernel on a bf16 or fp8 pool; "
        "the FP8 tensor-core kernel on an fp8 pool; FlashMLA on a bf16 or fp8 pool, through "
        "the backend or (-kernel) its kernel alone",
    )
    p.add_argument(
        "--mla-fp8-configs",
        nargs="+",
        choices=list(FP8_CONFIGS),
        default=list(FP8_CONFIGS),
        help="triton-fp8mma launch configs to time (FP8_CONFIGS)",
    )
    d = MLADecodeConfig()
    for name, default in (
        ("block-h", d.block_h),
        ("block-n", d.block_n),
        ("warps", d.num_warps),
        ("stages", d.num_stages),
        ("min-split", d.min_split_tokens),
        ("programs-per-sm", d.target_programs),
    ):
        p.add_argument(
            f"--mla-triton-{name}",
            type=int,
            nargs="+",
            default=[default],
            help=f"Triton kernel launch parameter (swept; default {default})",
        )


def decode_batch(
    batch_size: int, context: int, page_size: int, device: str = "cuda", seed: int = 0
) -> ForwardBatch:
    """``batch_size`` sequences of ``context`` tokens (the last one new) on shuffled pages."""
    per_seq = -(-context // page_size)
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(batch_size * per_seq, generator=gen).view(batch_size, per_seq)
    rows = torch.arange(page_size)
    spans = []
    for b in range(batch_size):
        slots = (pages[b, :, None] * page_size + rows).flatten()[:context].tolist()
        spans.append(SeqSpan([1], context - 1, slots))
    return ForwardBatch.build(spans, device)


def bench_pool(
    batch_size: int,
    context: int,
    page_size: int,
    dtype: torch.dtype = torch.bfloat16,
    fp8_scales: FP8Scales = "token",
) -> MLAKVPool:
    """Enough layers (copies) that one graph's calls read over 4x the L2 cache."""
    pages = batch_size * -(-context // page_size)
    token_scales = fp8_scales == "token"
    layer_bytes = pages * bytes_per_page(1, page_size, dtype, DIMS.kv_cache_dim, token_scales)
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    copies = max(1, min(MAX_COPIES, -(-4 * l2 // layer_bytes)))
    pool = MLAKVPool(
        copies, pages, page_size, DIMS.kv_cache_dim, dtype, "cuda", fp8_scales=fp8_scales
    )
    for layer in range(copies):
        if pool.is_fp8:  # e4m3 of N(0, 1) values, with scales like the pool writes
            pool.kv_buffer(layer).copy_(torch.randn(pool.kv_buffer(layer).shape, device="cuda"))
            scales = pool.scale_buffer(layer)  # none with one scale per layer (1.0)
            if scales is not None:
                scales.uniform_(0.005, 0.02)
        else:
            pool.kv_buffer(layer).normal_()
    return pool


def kernel_pool(kernel: str, batch_size: int, context: int, page_size: int) -> MLAKVPool:
    """The pool ``kernel``'s rows read: e4m3 for the fp8 kernels (one scale per layer for
    FlashMLA, per token for Triton), else bf16."""
    dtype = torch.float8_e4m3fn if kernel in FP8_KERNELS else torch.bfloat16
    scales: FP8Scales = "layer" if kernel.startswith("flashmla") else "token"
    return bench_pool(batch_size, context, page_size, dtype, scales)


Config = MLADecodeConfig | FP8MLAConfig


def _backend(kernel: str, pool: MLAKVPool, index: str, cfg: Config) -> AttentionBackend:
    if kernel == "flashinfer":
        from dsv3serve.attention.flashinfer_backend import FlashInferMLAAttention

        return FlashInferMLAAttention(pool, DIMS, paged=index == "page")
    if kernel.startswith("flashmla"):
        from dsv3serve.attention.flashmla_backend import FlashMLAAttention

        return FlashMLAAttention(pool, DIMS)
    from dsv3serve.attention.triton_mla import TritonMLAAttention

    if isinstance(cfg, FP8MLAConfig):
        return TritonMLAAttention(pool, DIMS, fp8_config=cfg, fp8_kernel="mma")
    return TritonMLAAttention(pool, DIMS, config=cfg, fp8_kernel="dequant")


def timed_call(
    kernel: str,
    batch: ForwardBatch,
    pool: MLAKVPool,
    index: str,
    cfg: Config,
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
) -> tuple[Callable[[int], Any], str]:
    """``call(i)`` (one decode attention call over layer ``i`` mod the pool's layers), and
    the row's index mode."""
    if kernel.endswith("-kernel"):
        from dsv3serve.bench.kernels.mla_flashmla import bare_call

        return bare_call(batch, pool, q_latent, q_pe, DIMS.softmax_scale), "page"
    attn = _backend(kernel, pool, index, cfg)
    attn.plan(batch)

    def call(i: int) -> torch.Tensor:
        return attn.forward_absorbed(q_latent, q_pe, i % pool.num_layers, DIMS.softmax_scale)

    return call, getattr(attn, "index_mode", "")


def bench_point(
    batch: ForwardBatch,
    pool: MLAKVPool,
    index: str,
    ceil: dict,
    replays: int,
    kernel: str = "flashinfer",
    cfg: Config | None = None,
) -> dict[str, Any]:
    """Time one decode attention call; bandwidth as a share of the copy ceiling."""
    cfg = cfg or MLADecodeConfig()
    bs, heads = batch.batch_size, DIMS.num_heads
    q_latent = torch.randn(bs, heads, DIMS.kv_lora_rank, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(bs, heads, DIMS.qk_rope_head_dim, device="cuda").to(torch.bfloat16)
    call, index_mode = timed_call(kernel, batch, pool, index, cfg, q_latent, q_pe)
    layers = pool.num_layers
    try:
        us, timing = graph_us(call, max(layers, 4), replays), "cuda-graph"
    except Exception as err:  # a capture failure: time eagerly, and say so
        print(f"CUDA graph capture failed ({err}); timing eager calls")
        us, timing = eager_us(call, max(layers, 4), replays), "eager"
    row_bytes = bytes_per_page(1, 1, pool.dtype, DIMS.kv_cache_dim, pool.token_scales)
    read = decode_bytes(batch.kv_slots.numel(), row_bytes, q_latent, DIMS.kv_lora_rank)
    read += q_pe.numel() * q_pe.element_size()
    tbps = read / us / 1e6
    flops = decode_flops(batch.kv_slots.numel(), heads, DIMS.kv_lora_rank, DIMS.qk_rope_head_dim)
    return {
        "kernel": kernel,
        "kv_dtype": "fp8" if pool.is_fp8 else "bf16",
        "config": vars(cfg) if kernel.startswith("triton") else None,
        "batch": bs,
        "context": batch.kv_indptr[1],
        "index": index_mode,
        "us": us,
        "bytes_read": read,
        "TBps": tbps,
        "pct_copy_bw": 100 * tbps / ceil["copy_TBps"],
        "TFLOPs": flops / us / 1e6,
        "timing": timing,
    }


def bench_mla(args: argparse.Namespace, ceil: dict) -> dict[str, Any]:
    """Every (batch, context, index) point; returns the JSON section."""
    kernels, version = list(args.mla_kernels), None
    try:
        import flashinfer

        version = flashinfer.__version__
    except ImportError as err:
        print(f"MLA: flashinfer rows skipped, flashinfer does not import ({err})")
        kernels = [k for k in kernels if k != "flashinfer"]
    kernels, flash_mla = _with_flash_mla(kernels)
    rows = []
    for context in args.mla_context:
        for bs in args.mla_batch:
            batch = decode_batch(bs, context, args.mla_page_size)
            for kernel in kernels:
                rows += _kernel_rows(kernel, batch, bs, context, args, ceil)
            torch.cuda.empty_cache()
    add_flashinfer_ratios(rows)
    return {
        "flashinfer": version,
        "flash_mla": flash_mla,
        "page_size": args.mla_page_size,
        "dims": vars(DIMS),
        "target_pct_copy_bw_at_batch_ge_32": TARGET_PCT,
        "rows": rows,
    }


def _with_flash_mla(kernels: list[str]) -> tuple[list[str], str | None]:
    """``kernels`` without the FlashMLA rows where ``flash_mla`` does not import, and its
    version (None then)."""
    if not any(k.startswith("flashmla") for k in kernels):
        return kernels, None
    try:
        import flash_mla
    except (ImportError, OSError) as err:
        print(f"MLA: flashmla rows skipped, flash_mla does not import ({err})")
        return [k for k in kernels if not k.startswith("flashmla")], None
    return kernels, getattr(flash_mla, "__version__", "?")


def add_flashinfer_ratios(rows: list[dict[str, Any]]) -> None:
    """``x_flashinfer`` on every row: flashinfer's (bf16, page indices) time at the same
    point over the row's; None without a flashinfer row there."""
    fi = {
        (r["batch"], r["context"]): r["us"]
        for r in rows
        if r["kernel"] == "flashinfer" and r["index"] == "page"
    }
    for r in rows:
        base = fi.get((r["batch"], r["context"]))
        r["x_flashinfer"] = base / r["us"] if base else None


def _triton_configs(args: argparse.Namespace) -> list[MLADecodeConfig]:
    sweep = itertools.product(
        args.mla_triton_block_h,
        args.mla_triton_block_n,
        args.mla_triton_warps,
        args.mla_triton_stages,
        args.mla_triton_min_split,
        args.mla_triton_programs_per_sm,
    )
    return [
        MLADecodeConfig(
            block_h=h, block_n=n, num_warps=w, num_stages=s, min_split_tokens=m, target_programs=p
        )
        for h, n, w, s, m, p in sweep
    ]


def _kernel_rows(
    kernel: str, batch: ForwardBatch, bs: int, context: int, args: argparse.Namespace, ceil: dict
) -> list[dict[str, Any]]:
    """One kernel's rows at one (batch, context): index modes or Triton configs."""
    pool = kernel_pool(kernel, bs, context, args.mla_page_size)
    if kernel == "flashinfer":
        points: list[tuple[str, Config | None]] = [(index, None) for index in args.mla_index]
    elif kernel.startswith("flashmla"):
        points = [("page", None)]
    elif kernel == "triton-fp8mma":
        points = [("page", FP8_CONFIGS[name]) for name in args.mla_fp8_configs]
    else:
        points = [("page", cfg) for cfg in _triton_configs(args)]
    rows = []
    for index, cfg in points:
        try:
            rows.append(bench_point(batch, pool, index, ceil, args.replays, kernel, cfg))
        except Exception as err:  # a launch config that does not fit: report, go on
            print(f"{kernel} {cfg} failed: {err}")
            continue
        keys = ("kernel", "batch", "context", "index", "us", "pct_copy_bw", "TFLOPs")
        print({k: rows[-1][k] for k in keys}, flush=True)
    del pool
    return rows
