"""``dsv3serve bench model``: prefill, decode and MTP step costs of DeepSeek-V3 at full width.

The model is the repo's own (``ModelRunner`` with the chosen attention and MoE backends)
with one dense layer, as many MoE layers as fit (``--num-moe-layers``) and the NextN
layer, with dummy FP8 weights drawn on the device. The same run's ceilings come first
(``bench kernels``' device copy and GEMM peaks); results are ratios to them.

- prefill: one sequence per input length, tokens/s;
- decode: steps of ``bs`` sequences over a cache pre-filled with random latents, each
  layer's time against its roofline (the bytes it must read / the copy bandwidth);
- MTP: a draft step (NextN layer + head) and a verify step (target over ``k + 1`` tokens per
  sequence) against a decode step, and the speedup per accept length.

Per-layer times are scaled to DeepSeek-V3's 61 layers (3 dense + 58 MoE) for the projected
numbers; the measured ones are kept beside them. Steps run eagerly: the model runner has no
CUDA-graph capture yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dsv3serve.bench.model_batches import context_batch, kv_tokens_needed, prefill_batch
from dsv3serve.bench.model_mtp import ACCEPT_LENGTHS, SpecCosts, speedup_rows
from dsv3serve.bench.model_projection import project_full_depth
from dsv3serve.bench.model_report import environment, print_report
from dsv3serve.bench.model_roofline import decode_roofline, storage_bytes
from dsv3serve.bench.model_setup import (
    activation_reserve_bytes,
    auto_num_moe_layers,
    bench_model_config,
    build_runner,
    fill_kv_random,
    footprint,
)
from dsv3serve.bench.model_steps import draft_step, forward_step
from dsv3serve.bench.model_timing import Marks, StepTime, layer_marks, time_step
from dsv3serve.config import ModelConfig
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.spec.draft import NextNDraft
from dsv3serve.forward_batch import ForwardBatch

TIMING = (
    "eager (the model runner has no CUDA-graph capture); {clock} around each part, device "
    "idle at each step's start, median of {iters} iterations after {warmup} warm-up"
)
PROJECTION = (
    "61-layer numbers scale the bench model's mean dense and mean MoE layer to DeepSeek-V3's "
    "3 dense + 58 MoE layers, other parts (embedding, head) as measured; draft steps are not "
    "scaled (the NextN layer is one layer in the full model too)"
)


@dataclass(frozen=True)
class Plan:
    """What to measure and how many times."""

    prefill_lens: list[int]
    decode_batch_sizes: list[int]
    decode_contexts: list[int]
    mtp_batch_sizes: list[int]
    mtp_context: int
    mtp_steps: list[int]
    warmup: int
    iters: int

    @property
    def prefill_iters(self) -> int:
        """Prefill steps are long and steady: fewer timed iterations."""
        return min(self.iters, 5)


def make_plan(args: argparse.Namespace) -> Plan:
    """Flags, else the ``--quick`` or the full defaults."""

    def pick(value: Any, quick: Any, full: Any) -> Any:
        return value if value is not None else (quick if args.quick else full)

    return Plan(
        prefill_lens=pick(args.prefill_lens, [1024], [1024, 4096]),
        decode_batch_sizes=pick(args.decode_batch_sizes, [1, 32], [1, 8, 32, 128]),
        decode_contexts=pick(args.decode_contexts, [1024], [1024, 4096]),
        mtp_batch_sizes=[] if args.no_mtp else pick(args.mtp_batch_sizes, [1, 8], [1, 8, 32]),
        mtp_context=args.mtp_context,
        mtp_steps=args.mtp_steps,
        warmup=pick(args.warmup, 1, 2),
        iters=pick(args.iters, 3, 10),
    )


def plan_kv_tokens(plan: Plan, page_size: int) -> int:
    """Pool slots for the largest decode, verify and prefill batch of the plan."""
    decode = [
        kv_tokens_needed(plan.decode_batch_sizes, c, 1, page_size) for c in plan.decode_contexts
    ]
    verify = kv_tokens_needed(
        plan.mtp_batch_sizes, plan.mtp_context, max(plan.mtp_steps) + 1, page_size
    )
    prefill = -(-max(plan.prefill_lens, default=0) // page_size) * page_size
    return max([*decode, verify, prefill, page_size])


def _host_copy_TBps(nbytes: int = 64 << 20, reps: int = 5) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e12


def run_ceilings(device: torch.device, replays: int) -> dict[str, float]:
    """``bench kernels``' ceilings on a GPU; on the CPU only a host copy bandwidth."""
    if device.type != "cuda":
        return {"copy_TBps": _host_copy_TBps()}
    from dsv3serve.bench.kernels import measure_ceilings

    ceilings = measure_ceilings(replays)
    torch.cuda.empty_cache()
    return ceilings


def _kv_dtype(kv_cache_dtype: str, compute: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else compute


def choose_num_moe_layers(
    args: argparse.Namespace, device: torch.device, plan: Plan, kv_tokens: int
) -> int:
    """``--num-moe-layers``, else as many as free GPU memory holds (2 on the CPU)."""
    if args.num_moe_layers is not None:
        return args.num_moe_layers
    if device.type != "cuda":
        return 2
    dtype = torch.bfloat16
    fp = footprint(
        args.preset, not args.no_mtp, dtype, kv_tokens, _kv_dtype(args.kv_cache_dtype, dtype)
    )
    cfg = bench_model_config(args.preset, 1, not args.no_mtp)
    reserve = activation_reserve_bytes(
        cfg, max(plan.prefill_lens, default=0), args.attention_backend
    )
    if args.reserve_gb is not None:
        reserve = int(args.reserve_gb * 1e9)
    return auto_num_moe_layers(torch.cuda.mem_get_info(device)[0], fp, reserve)


class ModelBench:
    """The built model with its timing helpers; each method measures one kind of step."""

    def __init__(self, runner: ModelRunner, plan: Plan, copy_TBps: float) -> None:
        self.runner, self.plan, self.copy_TBps = runner, plan, copy_TBps
        self.model, self.cfg = runner.model, runner.model_cfg
        self.marks = Marks(runner.device)

    def _batch(self, batch_size: int, context: int, new_tokens: int) -> ForwardBatch:
        page, vocab = self.runner.cfg.page_size, self.cfg.vocab_size
        return context_batch(batch_size, context, new_tokens, page, vocab, self.runner.device)

    def _time_forward(
        self, batch: ForwardBatch, rows: torch.Tensor, warmup: int, iters: int
    ) -> StepTime:
        step = forward_step(self.model, self.runner.attn, batch, rows)
        with layer_marks(self.model, self.marks):
            return time_step(step, self.marks, warmup, iters)

    def prefill(self, length: int) -> dict[str, Any]:
        """One sequence of ``length`` tokens, logits at the last."""
        batch = prefill_batch(length, self.cfg.vocab_size, self.runner.device)
        t = self._time_forward(batch, batch.logits_indices, 1, self.plan.prefill_iters)
        full_ms = project_full_depth(t.parts_ms, self.cfg)
        return {
            "input_len": length,
            "ms": t.ms,
            "tokens_per_s": length / t.ms * 1e3,
            "parts_ms": t.parts_ms,
            "projected_61": {"ms": full_ms, "tokens_per_s": length / full_ms * 1e3},
        }

    def decode(self, batch_size: int, context: int) -> dict[str, Any]:
        """One decode step (logits of every sequence) and its per-layer roofline."""
        batch = self._batch(batch_size, context, 1)
        t = self._time_forward(batch, batch.logits_indices, self.plan.warmup, self.plan.iters)
        roof = decode_roofline(self.model, self.runner.pool, batch_size, context, self.copy_TBps)
        full_ms = project_full_depth(t.parts_ms, self.cfg)
        full_roof_ms = project_full_depth(roof.bytes, self.cfg) / (self.copy_TBps * 1e9)
        return {
            "batch_size": batch_size,
            "context": context,
            "ms": t.ms,
            "tokens_per_s": batch_size / t.ms * 1e3,
            "roofline_ms": roof.total_bytes / (self.copy_TBps * 1e9),
            "ratio": t.ms / (roof.total_bytes / (self.copy_TBps * 1e9)),
            "parts_ms": t.parts_ms,
            "layers": [self._part(name, t, roof) for name in roof.bytes if name != "head"],
            "head": self._part("head", t, roof),
            "projected_61": {
                "ms": full_ms,
                "tokens_per_s": batch_size / full_ms * 1e3,
                "roofline_ms": full_roof_ms,
                "ratio": full_ms / full_roof_ms,
            },
        }

    def _part(self, name: str, t: StepTime, roof: Any) -> dict[str, Any]:
        index = int(name[len("layer") :]) if name.startswith("layer") else None
        kind = "head" if index is None else "moe" if self.cfg.is_moe_layer(index) else "dense"
        ms, roof_ms = t.parts_ms[name], roof.ms(name)
        return {"part": name, "kind": kind, "ms": ms, "bytes": roof.bytes[name],
                "roofline_ms": roof_ms, "ratio": ms / roof_ms}  # fmt: skip

    def draft(self, batch_size: int, context: int) -> StepTime:
        """One chained draft step: NextN layer + shared head over one token per sequence."""
        batch = self._batch(batch_size, context, 1)
        g = torch.Generator(device=self.runner.device).manual_seed(2)
        hidden = torch.randn(
            batch_size, self.cfg.hidden_size, generator=g, device=self.runner.device
        )
        step = draft_step(
            NextNDraft(self.model), self.runner.attn, batch, hidden.to(self.runner.dtype)
        )
        return time_step(step, self.marks, self.plan.warmup, self.plan.iters)

    def verify(self, batch_size: int, context: int, num_steps: int) -> StepTime:
        """The target over ``num_steps + 1`` tokens per sequence, logits at every one."""
        batch = self._batch(batch_size, context, num_steps + 1)
        rows = torch.arange(batch.num_tokens, device=self.runner.device)
        return self._time_forward(batch, rows, self.plan.warmup, self.plan.iters)


def measure_mtp(bench: ModelBench, decode_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Draft and verify costs per batch size, against decode at the same context."""
    plan, cfg = bench.plan, bench.cfg
    measured: dict[int, SpecCosts] = {}
    projected: dict[int, SpecCosts] = {}
    rows = []
    for bs in plan.mtp_batch_sizes:
        decode = next(
            (r for r in decode_rows if (r["batch_size"], r["context"]) == (bs, plan.mtp_context)),
            None,
        ) or bench.decode(bs, plan.mtp_context)
        draft = bench.draft(bs, plan.mtp_context)
        verify = {k: bench.verify(bs, plan.mtp_context, k) for k in plan.mtp_steps}
        measured[bs] = SpecCosts(decode["ms"], draft.ms, {k: v.ms for k, v in verify.items()})
        full_verify = {k: project_full_depth(v.parts_ms, cfg) for k, v in verify.items()}
        projected[bs] = SpecCosts(decode["projected_61"]["ms"], draft.ms, full_verify)
        rows.append(
            {
                "batch_size": bs,
                "decode_ms": decode["ms"],
                "draft_ms": draft.ms,
                "verify_ms": {str(k): v.ms for k, v in verify.items()},
                "projected_61": {
                    "decode_ms": projected[bs].decode_ms,
                    "verify_ms": {str(k): v for k, v in full_verify.items()},
                },
            }
        )
    return {
        "context": plan.mtp_context,
        "num_steps": plan.mtp_steps,
        "accept_lengths": [f"{a:.1f}" for a in ACCEPT_LENGTHS],
        "rows": rows,
        "speedup": speedup_rows(measured),
        "speedup_projected_61": speedup_rows(projected),
    }


def _config_record(
    args: argparse.Namespace,
    cfg: ModelConfig,
    plan: Plan,
    device: torch.device,
    runner: ModelRunner,
) -> dict[str, Any]:
    clock = "CUDA events" if device.type == "cuda" else "host clock"
    return {
        "preset": args.preset,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "n_routed_experts": cfg.n_routed_experts,
        "vocab_size": cfg.vocab_size,
        "num_dense_layers": cfg.first_k_dense_replace,
        "num_moe_layers": cfg.num_hidden_layers - cfg.first_k_dense_replace,
        "mtp": cfg.num_nextn_predict_layers > 0,
        "attention_backend": args.attention_backend,
        "moe_backend": args.moe_backend,
        "kv_cache_dtype": args.kv_cache_dtype,
        "page_size": args.page_size,
        "dtype": str(runner.dtype),
        "quick": args.quick,
        "cuda_graph": False,
        "plan": asdict(plan),
        "timing": TIMING.format(clock=clock, iters=plan.iters, warmup=plan.warmup),
        "projection": PROJECTION,
    }


def _memory_record(runner: ModelRunner, build_s: float) -> dict[str, Any]:
    model = runner.model
    derived = [
        t
        for m in model.modules()
        for t in (getattr(m, "w_uk", None), getattr(m, "w_uv", None))
        if isinstance(t, torch.Tensor)
    ]
    record = {
        "weights_GB": storage_bytes([*model.parameters(), *derived]) / 1e9,
        "kv_cache_GB": runner.pool.nbytes / 1e9,
        "build_s": build_s,
    }
    if runner.device.type == "cuda":
        record["peak_allocated_GB"] = torch.cuda.max_memory_allocated(runner.device) / 1e9
    return record


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run_bench_model(args: argparse.Namespace) -> dict[str, Any]:
    """Ceilings, build, prefill, decode, MTP; print the tables and write ``args.out``."""
    device, plan = _resolve_device(args.device), make_plan(args)
    ceilings = run_ceilings(device, args.replays)
    kv_tokens = plan_kv_tokens(plan, args.page_size)
    num_moe = choose_num_moe_layers(args, device, plan, kv_tokens)
    cfg = bench_model_config(args.preset, num_moe, not args.no_mtp)
    start = time.perf_counter()
    kv = {
        "page_size": args.page_size,
        "num_kv_tokens": kv_tokens,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    runner = build_runner(cfg, str(device), args.attention_backend, args.moe_backend, kv)
    fill_kv_random(runner.pool)
    build_s = time.perf_counter() - start
    bench = ModelBench(runner, plan, ceilings["copy_TBps"])
    result: dict[str, Any] = {"environment": environment(device), "ceilings": ceilings}
    result["config"] = _config_record(args, cfg, plan, device, runner)
    result["prefill"] = [bench.prefill(n) for n in plan.prefill_lens]
    result["decode"] = [
        bench.decode(b, c) for c in plan.decode_contexts for b in plan.decode_batch_sizes
    ]
    result["mtp"] = measure_mtp(bench, result["decode"]) if plan.mtp_batch_sizes else None
    result["memory"] = _memory_record(runner, build_s)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_report(result)
    return result
