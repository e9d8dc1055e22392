"""One static batch: prefill latency, per-step decode latency, totals (SGLang-style)."""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams

# Prompt ids are drawn below this: DeepSeek-V3's special tokens start at 128000 (a model
# with a smaller vocabulary draws from its whole vocabulary).
ORDINARY_TOKENS_END = 128000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(engine: Engine, sync: bool = True) -> float:
    if sync:
        _sync(engine.runner.device)
    start = time.perf_counter()
    engine.step()
    if sync:
        _sync(engine.runner.device)
    return time.perf_counter() - start


def measure(engine: Engine, batch: int, input_len: int, output_len: int) -> dict[str, Any]:
    """Prefill the whole batch in one step, then decode to the end.

    Without speculation that is ``output_len - 1`` decode steps; with it a step commits
    ``accept_length`` tokens per sequence on average, so the decode throughput counts the
    tokens the decode steps produced, not the steps.
    """
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    high = min(engine.model_cfg.vocab_size, ORDINARY_TOKENS_END)
    for i in range(batch):
        ids = [rng.randrange(2, high) for _ in range(input_len)]
        engine.add_request(Request(f"b{i}", params, prompt_ids=ids))
    prefill = _timed_step(engine)
    decode = []
    # Decode steps are timed as the host sees them, without a device sync: a step without
    # overlap waits for its own tokens anyway, and with overlap a sync would serialise the
    # next launch behind the device and measure no overlap at all.
    while engine.has_unfinished():
        decode.append(_timed_step(engine, sync=False))
    med = statistics.median(decode) if decode else float("nan")
    steps = len(decode) - int(engine.overlap)  # with overlap the last call only resolves
    tokens_per_step = (output_len - 1) / steps if steps > 0 else 1.0
    total = prefill + sum(decode)
    return {
        "batch_size": batch,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency_s": prefill,
        "prefill_throughput_tok_s": batch * input_len / prefill,
        "median_decode_latency_s": med,
        "median_decode_throughput_tok_s": batch * tokens_per_step / med,
        "accept_length": engine.spec_stats.mean_accept_length or 1.0,
        "total_latency_s": total,
        "total_throughput_tok_s": batch * (input_len + output_len) / total,
    }


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'bs':>4} {'in':>6} {'out':>5} {'prefill s':>10} {'prefill tok/s':>14} "
        f"{'decode s':>10} {'decode tok/s':>13} {'total s':>9} {'total tok/s':>12}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['batch_size']:>4} {r['input_len']:>6} {r['output_len']:>5} "
            f"{r['prefill_latency_s']:>10.4f} {r['prefill_throughput_tok_s']:>14.1f} "
            f"{r['median_decode_latency_s']:>10.4f} {r['median_decode_throughput_tok_s']:>13.1f} "
            f"{r['total_latency_s']:>9.3f} {r['total_throughput_tok_s']:>12.1f}"
        )


def run_one_batch(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every (batch size, input length) pair, print a table and write JSON."""
    need = max(args.batch_size) * (max(args.input_len) + args.output_len)
    cfg = EngineConfig.from_args(
        args,
        num_kv_tokens=args.num_kv_tokens or need + 64 * args.page_size,
        chunked_prefill_size=-1,
        max_num_batched_tokens=max(need, args.max_num_batched_tokens),
        enable_prefix_caching=False,
        max_running_requests=max(args.batch_size),
        max_model_len=max(args.input_len) + args.output_len,
    )
    engine = Engine(cfg)
    measure(engine, 1, 8, 2)  # warm-up
    rows = [measure(engine, b, i, args.output_len) for b in args.batch_size for i in args.input_len]
    _print_table(rows)
    meta = {
        "model": args.model,
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "overlap_schedule": engine.overlap,
        "torch_compile": cfg.enable_torch_compile,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    return rows
