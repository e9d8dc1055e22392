"""``dsv3serve bench group``: a sharded group's decode and prefill per GPU against the
rank's roofline (issue 35), the ranks started here (``LLM`` spawns them; NCCL on GPUs, gloo
on CPU).

    dsv3serve bench group --model deepseek-v3 --load-format dummy --device cuda \
        --attention-backend flashinfer --moe-backend triton --tp-size 2 --dp-size 2 \
        --enable-dp-attention --ep-size 2 --hf-overrides '{"num_hidden_layers": 12}' \
        --per-rank 16 64 256 --json group.json

For each per-rank batch: ``dp_size * per_rank`` prompts of ``--ctx`` random tokens, then
``--steps`` timed engine steps (median step, tok/s per GPU); then ``--prefill-per-rank``
prompts of ``--prefill-len`` tokens per rank (prefill tok/s per GPU). The ceiling is the
copy bandwidth measured in the same process; :mod:`dsv3serve.bench.engine.group_roofline` turns
rank 0's bytes into its roofline and the projections (61 layers, EP 8), printed as such.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from dsv3serve.bench.engine.group_profile import profile_line, profile_steps
from dsv3serve.bench.engine.group_roofline import (
    rank_bytes,
    roofline_ms,
    step_bytes,
    to_ep,
    to_full_depth,
)
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.llm import LLM
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 2, 120_000


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def submit(engine: Any, tag: str, total: int, length: int, max_new: int, seed: int) -> None:
    """``total`` greedy requests ``{tag}{i}`` of ``length`` random prompt tokens (``seed``),
    each generating ``max_new`` tokens whatever it samples."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
    for i in range(total):
        engine.add_request(Request(f"{tag}{i}", params, prompt_ids=prompt(rng, length)))


def decode_batch(
    engine: Any, total: int, ctx: int, steps: int, profiled: int = 0, warm: int = 0
) -> dict[str, Any]:
    """``total`` prompts of ``ctx`` tokens, then ``steps`` timed decode steps, then
    ``profiled`` profiled ones (:mod:`~dsv3serve.bench.engine.group_profile`), every one
    with the whole batch decoding: a sequence may decode up to ``warm`` tokens (a bound on
    the prefill's steps) while later prompts still prefill, and its budget covers them.
    ``full_batch`` says whether every timed step emitted ``total`` tokens."""
    tag = f"d{total}-"
    submit(engine, tag, total, ctx, warm + steps + profiled + 8, seed=total)
    started: set[str] = set()
    t0 = time.perf_counter()
    prefill_steps = []
    while len(started) < total:
        s = time.perf_counter()
        started.update(o.request_id for o in engine.step() if o.token_ids)
        prefill_steps.append(time.perf_counter() - s)
    prefill_s = time.perf_counter() - t0
    per_step, times = [], []
    for _ in range(steps):
        s = time.perf_counter()
        per_step.append(_step_tokens(engine))
        times.append(time.perf_counter() - s)
    profile = profile_steps(lambda: _step_tokens(engine), profiled) if profiled else None
    for i in range(total):  # measured: the rest of each budget is not needed
        engine.abort(f"{tag}{i}")
    while engine.has_unfinished():
        engine.step()
    times.sort()
    row = {
        "sequences": total,
        "ctx": ctx,
        "prefill_s": round(prefill_s, 3),
        "prefill_steps": len(prefill_steps),
        "prefill_slowest_steps_s": [round(v, 3) for v in sorted(prefill_steps)[-3:]],
        "median_step_ms": round(1000 * times[len(times) // 2], 3),
        "tok_s_total": round(sum(per_step) / sum(times), 1),
        "decode_s": round(sum(times), 3),
        "min_tokens_per_step": min(per_step),
        "full_batch": min(per_step) == total,
    }
    return row | ({"profile": profile} if profile else {})


def prefill_steps_bound(per_rank: int, ctx: int, cfg: EngineConfig) -> int:
    """The most prefill steps ``per_rank`` prompts of ``ctx`` tokens take on one rank."""
    return math.ceil(per_rank * ctx / prefill_step_tokens(cfg)) + 2


def _step_tokens(engine: Any) -> int:
    """One engine step; the tokens it emitted."""
    return sum(len(o.token_ids) for o in engine.step())


def prefill_rate(engine: Any, total: int, length: int) -> dict[str, Any]:
    """``total`` prompts of ``length`` tokens, timed from submission to every first token."""
    submit(engine, "p", total, length, 1, seed=length)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - t0
    return {
        "prompts": total,
        "length": length,
        "seconds": round(seconds, 3),
        "tok_s_total": round(total * length / seconds, 1),
    }


def prefill_profile(
    engine: Any, ranks: int, cfg: EngineConfig, length: int, profiled: int
) -> dict[str, Any]:
    """``profiled`` profiled prefill steps, each as full as the timed prefill's (a step's
    prompt tokens per rank: ``prefill_step_tokens``), of fresh prompts of ``length``."""
    per_rank = max(1, math.ceil(profiled * prefill_step_tokens(cfg) / length))
    submit(engine, "pp", ranks * per_rank, length, 1, seed=length + 1)
    profile = profile_steps(lambda: _step_tokens(engine), profiled)
    while engine.has_unfinished():
        engine.step()
    return profile | {"prompts_per_rank": per_rank}


def prefill_step_tokens(cfg: EngineConfig) -> int:
    """The most prompt tokens one rank's prefill step takes."""
    return min(n for n in (cfg.chunked_prefill_size, cfg.max_num_batched_tokens) if n > 0)


def copy_bandwidth(device: str) -> float | None:
    """Device-to-device copy, bytes read + written per second (1 GiB, median of 5)."""
    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / sorted(times[1:])[2]


def _ratio_row(r: dict[str, Any], model: Any, cfg: EngineConfig, bw: float | None) -> None:
    """Add the roofline ratio and the projections to decode row ``r`` (CUDA only)."""
    if bw is None or model is None:
        return
    mc = model.cfg
    kv_row = (mc.kv_lora_rank + mc.qk_rope_head_dim) * 2
    b = rank_bytes(model, r["per_rank"] * r["ctx"], kv_row)
    ranks, k, e = max(cfg.dp_size, 1), mc.num_experts_per_tok, mc.n_routed_experts
    roof = roofline_ms(step_bytes(b, ranks * r["per_rank"], k, e), bw)
    ratio = r["median_step_ms"] / roof
    full = to_full_depth(b)
    r["roofline_ms"], r["x_roofline"] = round(roof, 3), round(ratio, 2)
    r["projected_61_layers_ms"] = round(
        ratio * roofline_ms(step_bytes(full, ranks * r["per_rank"], k, e), bw), 2
    )
    wide = to_ep(full, max(cfg.ep_size, 1), 8)
    r["projected_61_layers_ep8_ms"] = round(
        ratio * roofline_ms(step_bytes(wide, 8 * r["per_rank"], k, e), bw), 2
    )


def run_group(args: argparse.Namespace) -> dict[str, Any]:
    """Build the group, measure every batch and the prefill, print the table, write JSON
    (rewritten after each batch)."""
    most = max(args.per_rank)
    cfg = EngineConfig.from_args(args, max_running_requests=most, cuda_graph_max_bs=most)
    if not args.num_kv_tokens:  # every batch's sequences at their whole budget, and the prefill
        seq = args.ctx + prefill_steps_bound(most, args.ctx, cfg) + args.steps
        decode_tokens = most * (seq + args.profile_steps + 16)
        prefill_tokens = args.prefill_per_rank * args.prefill_len
        cfg = cfg.model_copy(update={"num_kv_tokens": decode_tokens + prefill_tokens + 8192})
    ranks = max(cfg.dp_size, 1)
    result: dict[str, Any] = {"engine": cfg.model_dump(mode="json"), "decode": []}
    with LLM.from_config(cfg) as llm:
        model = getattr(getattr(llm.engine, "runner", None), "model", None)
        bw = copy_bandwidth(cfg.device)
        result["copy_bytes_per_s"] = bw
        for per_rank in args.per_rank:
            warm = prefill_steps_bound(per_rank, args.ctx, cfg)
            r = decode_batch(
                llm.engine, ranks * per_rank, args.ctx, args.steps, args.profile_steps, warm
            )
            r |= {"per_rank": per_rank, "tok_s_per_gpu": round(r["tok_s_total"] / cfg.tp_size, 1)}
            _ratio_row(r, model, cfg, bw)
            result["decode"].append(r)
            _save(result, args.json, f"per rank {per_rank}: {_row_line(r)}")
        if args.prefill_per_rank:
            p = prefill_rate(llm.engine, ranks * args.prefill_per_rank, args.prefill_len)
            result["prefill"] = p | {"tok_s_per_gpu": round(p["tok_s_total"] / cfg.tp_size, 1)}
            _save(result, args.json, "prefill done")
            if args.profile_steps:
                result["prefill"]["profile"] = prefill_profile(
                    llm.engine, ranks, cfg, args.prefill_len, args.profile_steps
                )
                _save(result, args.json, "prefill profiled")
    print_table(result)
    return result


def _save(result: dict[str, Any], path: str, done: str) -> None:
    """Write what is measured so far (a run cut short keeps it) and say what was added."""
    Path(path).write_text(json.dumps(result, indent=1))
    print(done, flush=True)


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'per rank':>8} {'step ms':>9} {'tok/s/GPU':>10} {'x roofline':>10} "
        f"{'61 layers ms (proj.)':>21} {'61 layers EP8 ms (proj.)':>25}"
    )
    for r in result["decode"]:
        print(f"{r['per_rank']:>8} {_row_line(r)}")
        if "profile" in r:
            print(profile_line(r["profile"]))
    if "prefill" in result:
        p = result["prefill"]
        print(f"prefill {p['prompts']} x {p['length']}: {p['tok_s_per_gpu']:.0f} tok/s per GPU")
        if "profile" in p:
            print(profile_line(p["profile"]))


def _row_line(r: dict[str, Any]) -> str:
    """A decode row's columns after ``per rank``."""
    return (
        f"{r['median_step_ms']:>9.2f} {r['tok_s_per_gpu']:>10.1f} "
        f"{r.get('x_roofline', '-')!s:>10} {r.get('projected_61_layers_ms', '-')!s:>21} "
        f"{r.get('projected_61_layers_ep8_ms', '-')!s:>25}"
    )


def add_group_arguments(p: argparse.ArgumentParser) -> None:
    """The group bench's own flags (the engine's come from ``dsv3serve``'s engine args)."""
    p.add_argument("--per-rank", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prefill-per-rank", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each decode batch's timed steps and after the timed prefill, profile "
        "this many steps on rank 0 (CUDA): device time by kind of op, device span and host "
        "time per step",
    )
    p.add_argument("--json", default="bench_group.json", help="where to write results")
