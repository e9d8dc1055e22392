"""Where the time of ``bench kernels --only mla``'s FlashMLA rows goes, kernel by kernel: a
torch.profiler op table per bench case (the device run's ``profile`` stage).

    python benchmarks/flashmla_profile.py [--batch 64] [--context 4096] [--kernels K ...]

Per kernel row (default flashmla-fp8, flashmla-fp8-kernel, flashmla-bf16,
flashmla-bf16-kernel): the bench's own pool, batch and call
(:func:`dsv3serve.bench.kernels.mla.timed_call`), warmed up, then CALLS calls profiled
twice: eagerly, and as one replay of a CUDA graph of them (what the bench times). Each
table lists the ops and kernels by device time, summed over the CALLS calls.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from dsv3serve.bench.kernels.mla import DIMS, decode_batch, kernel_pool, timed_call
from dsv3serve.kernels.mla_decode import MLADecodeConfig

CALLS = 4
DEFAULT = ["flashmla-fp8", "flashmla-fp8-kernel", "flashmla-bf16", "flashmla-bf16-kernel"]


def _table(prof: profile, title: str) -> None:
    print(f"--- {title}")
    try:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14))
    except (AttributeError, KeyError):  # older torch: the CUDA-named column
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14))


def profile_kernel(kernel: str, batch_size: int, context: int) -> None:
    batch = decode_batch(batch_size, context, 64)
    pool = kernel_pool(kernel, batch_size, context, 64)
    heads = DIMS.num_heads
    q_latent = torch.randn(batch_size, heads, DIMS.kv_lora_rank, device="cuda").bfloat16()
    q_pe = torch.randn(batch_size, heads, DIMS.qk_rope_head_dim, device="cuda").bfloat16()
    call, _ = timed_call(kernel, batch, pool, "page", MLADecodeConfig(), q_latent, q_pe)
    for i in range(CALLS):  # warm-up (and JIT) outside the profile
        call(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as eager:
        for i in range(CALLS):
            call(i)
        torch.cuda.synchronize()
    _table(eager, f"{kernel} {batch_size}x{context}: {CALLS} eager calls")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as graphed:
        graph.replay()
        torch.cuda.synchronize()
    _table(graphed, f"{kernel} {batch_size}x{context}: one graph replay of {CALLS} calls")


def main() -> None:
    p = argparse.ArgumentParser(description="torch.profiler op tables of the FlashMLA bench rows")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--kernels", nargs="+", default=DEFAULT)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for kernel in args.kernels:
        try:
            profile_kernel(kernel, args.batch, args.context)
        except Exception as err:  # report and go on to the next row
            print(f"--- {kernel}: failed: {type(err).__name__}: {err}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
