"""``dsv3serve bench kernels --only mla``: MLA decode through the flashinfer backend.

DeepSeek-V3 shapes (128 heads, latent 512 + rope 64, bf16), one new token per sequence
over a paged cache whose pages are shuffled as an engine's would be. Each point plans
once, then times ``forward_absorbed`` as the model calls it, in a CUDA graph (see
``kernels.graph_us``); consecutive calls read different layers of the pool, together
over 4x the L2 cache, so each call reads its KV from device memory.

Bandwidth: bytes read (the cached latents of every sequence, 576 bf16 values per token,
plus q) over the time, as a percentage of the same run's device copy bandwidth.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from dsv3serve.attention.base import MLADims
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kvcache.pool import MLAKVPool

MLA_BATCHES = (1, 32, 128)
MLA_CONTEXTS = (1024, 4096, 16384)
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
        help="KV indices by page, or one per token slot (page_size 1)",
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


def _pool(batch_size: int, context: int, page_size: int) -> MLAKVPool:
    """Enough layers (copies) that one graph's calls read over 4x the L2 cache."""
    pages = batch_size * -(-context // page_size)
    layer_bytes = pages * page_size * DIMS.kv_cache_dim * 2
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    copies = max(1, min(MAX_COPIES, -(-4 * l2 // layer_bytes)))
    pool = MLAKVPool(copies, pages, page_size, DIMS.kv_cache_dim, torch.bfloat16, "cuda")
    for layer in range(copies):
        pool.kv_buffer(layer).normal_()
    return pool


def bench_point(
    batch: ForwardBatch, pool: MLAKVPool, index: str, ceil: dict, replays: int
) -> dict[str, Any]:
    """Time one decode attention call; bandwidth as a share of the copy ceiling."""
    from dsv3serve.attention.flashinfer_backend import FlashInferMLAAttention
    from dsv3serve.bench.kernels import graph_us

    attn = FlashInferMLAAttention(pool, DIMS, paged=index == "page")
    attn.plan(batch)
    bs, heads = batch.batch_size, DIMS.num_heads
    q = torch.randn(bs, heads, DIMS.kv_cache_dim, device="cuda").to(torch.bfloat16)
    q_latent, q_pe = q.split([DIMS.kv_lora_rank, DIMS.qk_rope_head_dim], -1)
    layers = pool.num_layers

    def call(i: int) -> torch.Tensor:
        return attn.forward_absorbed(q_latent, q_pe, i % layers, DIMS.softmax_scale)

    try:
        us, timing = graph_us(call, max(layers, 4), replays), "cuda-graph"
    except Exception as err:  # a capture failure: time eagerly, and say so
        print(f"CUDA graph capture failed ({err}); timing eager calls")
        us, timing = _eager_us(call, max(layers, 4), replays), "eager"
    read = batch.kv_slots.numel() * DIMS.kv_cache_dim * 2 + q.numel() * 2
    tbps = read / us / 1e6
    return {
        "batch": bs,
        "context": batch.kv_indptr[1],
        "index": attn.index_mode,
        "us": us,
        "bytes_read": read,
        "TBps": tbps,
        "pct_copy_bw": 100 * tbps / ceil["copy_TBps"],
        "timing": timing,
    }


def _eager_us(fn: Any, calls: int, replays: int) -> float:
    """Median time of one call from rows of eager calls between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] * 1e3 / calls


def bench_mla(args: argparse.Namespace, ceil: dict) -> dict[str, Any]:
    """Every (batch, context, index) point; returns the JSON section."""
    try:
        import flashinfer
    except ImportError as err:
        print(f"MLA part skipped: flashinfer does not import ({err})")
        return {"skipped": str(err)}
    rows = []
    for context in args.mla_context:
        for bs in args.mla_batch:
            batch = decode_batch(bs, context, args.mla_page_size)
            pool = _pool(bs, context, args.mla_page_size)
            for index in args.mla_index:
                rows.append(bench_point(batch, pool, index, ceil, args.replays))
                print({k: rows[-1][k] for k in ("batch", "context", "index", "us")}, flush=True)
            del pool
            torch.cuda.empty_cache()
    return {
        "flashinfer": flashinfer.__version__,
        "page_size": args.mla_page_size,
        "dims": vars(DIMS),
        "target_pct_copy_bw_at_batch_ge_32": TARGET_PCT,
        "rows": rows,
    }


def print_mla_table(ceil: dict, mla: dict) -> None:
    if "skipped" in mla:
        print(f"MLA decode: skipped ({mla['skipped']})")
        return
    print(
        f"MLA decode, flashinfer {mla['flashinfer']}: 128 heads, 512+64, bf16, page "
        f"{mla['page_size']}; copy ceiling {ceil['copy_TBps']:.2f} TB/s; "
        f"target >= {TARGET_PCT:.0f}% at batch >= 32"
    )
    print(f"{'batch':>5} {'context':>7} {'index':>5} {'us':>9} {'TB/s':>6} {'%copy':>6}")
    for r in mla["rows"]:
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['index']:>5} {r['us']:>9.1f} "
            f"{r['TBps']:>6.2f} {r['pct_copy_bw']:>6.1f}"
        )
