"""Device ops per decoder layer of the bench model's decode step, with the fusions off, the
fused add + norm + quant alone, and every fusion on.

Builds the bench model (full DeepSeek-V3 width, dummy FP8 weights drawn on the GPU, one
dense and one MoE layer, flashinfer MLA, Triton MoE), then for the dense layer (0) and the
MoE layer (1), in three states of the layers' switches (``off``: none; ``norm_quant``: the
fused add + RMSNorm + FP8 quantisation, ``$DSV3SERVE_FUSED_NORM_QUANT``; ``all``: that and
the MLA fusions, ``$DSV3SERVE_FUSED_MLA``: q/kv norms in one kernel, RoPE inside the KV-cache
write; set through ``DeepseekV3ForCausalLM.set_fusions``), runs one decode step of that layer
alone (``--batch-size`` sequences of one new token over ``--context`` cached tokens, absorbed
MLA, attention planned before) eagerly and as a CUDA-graph replay under ``torch.profiler``,
and counts the device ops (kernels, copies, memsets) per call. ``fused_paths_taken``
records which fused branches the layer really took (``DecoderLayer.fuses_norm_quant``,
``MLAttention.fuses_mla``). Prints a table and writes JSON (``--out``).

Needs a CUDA GPU with triton and flashinfer. Usage, from the repository root:
``python benchmarks/count_layer_ops.py --out /tmp/layer_ops.json``
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsv3serve.bench.model.batches import kv_tokens_needed
from dsv3serve.bench.model.layer_graphs import LayerGraphTimer
from dsv3serve.bench.model.profile import device_ops
from dsv3serve.bench.model.setup import bench_model_config, build_runner, fill_kv_random
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.model.deepseek_v3 import DecoderLayer

# state -> (fused add + norm + quant, MLA fusions)
STATES = {"off": (False, False), "norm_quant": (True, False), "all": (True, True)}


def count_ops(run: Callable[[], Any], calls: int) -> dict[str, Any]:
    """Device ops per call of ``run`` (after one unprofiled call), by kernel name too."""
    run()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            run()
            torch.cuda.synchronize()
    ops = device_ops(prof.events())
    names = Counter(op.name for op in ops)
    return {
        "ops_per_call": len(ops) / calls,
        "device_us_per_call": sum(op.us for op in ops) / calls,
        "by_name": {name: n / calls for name, n in names.most_common()},
    }


def measure_layer(
    timer: LayerGraphTimer, index: int, batch_size: int, state: str, calls: int
) -> dict[str, Any]:
    """One layer's ops per decode call, eager and graphed, with the switches of ``state``."""
    runner = timer.runner
    norm_quant, mla = STATES[state]
    runner.model.set_fusions(norm_quant=norm_quant, mla=mla)
    layer: DecoderLayer = runner.model.layers[index]
    taken = {"norm_quant": layer.fuses_norm_quant, "mla": layer.self_attn.fuses_mla}
    graph = timer.capture(index, batch_size, 1)
    try:
        return {
            "fused_paths_taken": taken,
            "eager": count_ops(graph.eager, calls),
            "graphed": count_ops(graph.replay, calls),
        }
    finally:
        del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def build(args: argparse.Namespace) -> ModelRunner:
    cfg = bench_model_config(args.preset, 1, mtp=False)
    tokens = kv_tokens_needed([args.batch_size], args.context, 1, args.page_size)
    kv = {"page_size": args.page_size, "num_kv_tokens": tokens, "kv_cache_dtype": "auto"}
    runner = build_runner(cfg, "cuda", "flashinfer", "triton", kv)
    fill_kv_random(runner.pool)
    return runner


def print_table(result: dict[str, Any]) -> None:
    print(f"device ops per decoder layer, bs {result['batch_size']}, ctx {result['context']}")
    heads = "".join(f"{s + ' ops':>16} {s + ' µs':>14}" for s in STATES)
    print(f"{'layer':<6} {'mode':<8}{heads}")
    for kind, row in result["layers"].items():
        for mode in ("eager", "graphed"):
            cells = "".join(
                f"{row[s][mode]['ops_per_call']:>16.1f} {row[s][mode]['device_us_per_call']:>14.1f}"
                for s in STATES
            )
            print(f"{kind:<6} {mode:<8}{cells}")
    for state in STATES:
        taken = {k: r[state]["fused_paths_taken"] for k, r in result["layers"].items()}
        print(f"fused paths taken in state {state}: {taken}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="full", help="bench model width: full, small or tiny")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--calls", type=int, default=3, help="profiled calls per point")
    p.add_argument("--out", default="layer_ops.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("count_layer_ops.py needs a CUDA GPU (flashinfer MLA, Triton kernels)")
    runner = build(args)
    timer = LayerGraphTimer(runner, args.context, warmup=2, iters=5)
    result: dict[str, Any] = {"batch_size": args.batch_size, "context": args.context}
    result["device"] = torch.cuda.get_device_name()
    result["layers"] = {
        kind: {
            state: measure_layer(timer, index, args.batch_size, state, args.calls)
            for state in STATES
        }
        for kind, index in timer.layers.items()
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
