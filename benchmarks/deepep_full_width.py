"""DeepEP at DeepSeek-V3's width in a DP2 + EP2 group (issue 28): greedy tokens against the
gather dispatcher's, and decode / prefill throughput per GPU against the rank's roofline.

    python benchmarks/deepep_full_width.py run OUT_DIR CONFIG [--layers 12] [--per-rank 16 64 256]
    python benchmarks/deepep_full_width.py report OUT_DIR  # table, OUT_DIR/deepep_full_width.json

One ``run`` builds one group (``LLM``: it spawns the ranks, NCCL) of full-width DeepSeek-V3
(hidden 7168, 256 experts, top-8, dummy FP8 weights, the first ``--layers`` layers, seed 0 on
every run, so every config holds the same weights) with CONFIG's dispatcher, then:

* greedy: ``GREEDY_PROMPTS`` seeded random prompts, all submitted at once, ``GREEDY_TOKENS``
  tokens each with their top log-probabilities; the ``gather`` config also runs them one
  at a time (another batching of the same engine: its own spread, measured in the run);
* decode: for each per-rank batch, ``2 * per_rank`` prompts of ``--ctx`` tokens, then
  ``--steps`` timed engine steps (median step time, tok/s per GPU);
* prefill: ``--prefill-per-rank`` prompts of ``--prefill-len`` tokens per rank, timed from
  submission to every first token (tok/s per GPU);
* the ceiling: device-to-device copy bandwidth on this GPU, and the rank's bytes per decode
  step (its non-expert parameters, the share of its experts a step hits under uniform
  routing, the batch's KV, each read once), so each step time is also a ratio to the
  rank's roofline.

``report`` merges every ``CONFIG.json`` of OUT_DIR: DeepEP's tokens against gather's
(equal, or parting only where gather's own top-2 margin is within its measured spread), and
the throughput table. ``--device cpu`` runs the plumbing on the tiny checkpoint over gloo
(the ``gather`` config only: DeepEP needs GPUs); its numbers are not results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dsv3serve.bench.engine.greedy_compare import compare, first_difference, spread
from dsv3serve.bench.engine.group import copy_bandwidth, decode_batch, prefill_rate, prompt
from dsv3serve.bench.engine.group_roofline import RankBytes, roofline_ms, step_bytes
from dsv3serve.bench.engine.group_roofline import rank_bytes as group_rank_bytes
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.llm import LLM
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams

CONFIGS: dict[str, dict[str, Any]] = {
    "gather": {"moe_a2a_backend": "none"},  # decode: uniform gather (graphs); prefill: a2a
    "deepep-auto": {"moe_a2a_backend": "deepep", "deepep_mode": "auto"},
    "deepep-auto-eager": {
        "moe_a2a_backend": "deepep",
        "deepep_mode": "auto",
        "disable_cuda_graph": True,
    },
    "deepep-low-latency": {"moe_a2a_backend": "deepep", "deepep_mode": "low_latency"},
    "deepep-normal": {"moe_a2a_backend": "deepep", "deepep_mode": "normal"},  # eager
}
GREEDY_PROMPTS, GREEDY_TOKENS, TOP = 16, 32, 5
RANKS, TOP_K, EXPERTS = 2, 8, 256  # the DP2 + EP2 group of DeepSeek-V3 this script runs
VOCAB_LOW, VOCAB_HIGH = 2, 120_000


def engine_config(args: argparse.Namespace, name: str) -> EngineConfig:
    most = max(args.per_rank)
    tokens = most * (args.ctx + args.steps + 64) + 2 * args.prefill_per_rank * args.prefill_len
    common: dict[str, Any] = {
        "tp_size": 2,
        "dp_size": 2,
        "ep_size": 2,
        "enable_dp_attention": True,
        "max_running_requests": most,
        "cuda_graph_max_bs": most,
        "enable_prefix_caching": False,
        "num_kv_tokens": tokens + 8192,
        "chunked_prefill_size": args.chunk,
        "max_num_batched_tokens": args.chunk,
    }
    common |= json.loads(args.engine_json)
    if args.device == "cpu":
        return EngineConfig(model=args.model, device="cpu", **common, **CONFIGS[name])
    return EngineConfig(
        model="deepseek-v3",
        load_format="dummy",
        device="cuda",
        attention_backend="flashinfer",
        moe_backend="triton",
        hf_overrides={"num_hidden_layers": args.layers, "num_nextn_predict_layers": 0},
        **common,
        **CONFIGS[name],
    )


def _drain(
    engine: Any, tokens: dict[str, list[int]], top: dict[str, list], steps: list[float]
) -> None:
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t0)
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            top.setdefault(out.request_id, []).extend(
                {int(k): float(v) for k, v in t.items()} for t in out.top_logprobs
            )


def greedy(engine: Any, one_at_a_time: bool) -> dict[str, Any]:
    """The greedy prompts' tokens and top log-probabilities (all at once, or one by one)."""
    rng = random.Random(28)
    params = SamplingParams(
        temperature=0, max_new_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=TOP
    )
    tokens: dict[str, list[int]] = {}
    top: dict[str, list] = {}
    steps: list[float] = []
    for i in range(GREEDY_PROMPTS):
        ids = prompt(rng, rng.randrange(48, 400))
        engine.add_request(Request(f"g{i}", params, prompt_ids=ids))
        if one_at_a_time:
            _drain(engine, tokens, top, steps)
    _drain(engine, tokens, top, steps)
    return {
        "steps": len(steps),
        "slowest_steps_s": [round(v, 3) for v in sorted(steps)[-5:]],
        "first_steps_s": [round(v, 3) for v in steps[:6]],
        "tokens": tokens,
        "top": {k: [{str(t): p for t, p in d.items()} for d in v] for k, v in top.items()},
    }


def rank_bytes(llm: LLM, per_rank: int, ctx: int) -> dict[str, int] | None:
    """Rank 0's bytes by kind (:func:`dsv3serve.bench.engine.group_roofline.rank_bytes`), with
    its batch's KV (bf16 latent + rope per token and layer)."""
    model = getattr(getattr(llm.engine, "runner", None), "model", None)
    if model is None:
        return None
    kv_row = (model.cfg.kv_lora_rank + model.cfg.qk_rope_head_dim) * 2
    return dataclasses.asdict(group_rank_bytes(model, per_rank * ctx, kv_row))


def run(args: argparse.Namespace) -> None:
    cfg = engine_config(args, args.config)
    row: dict[str, Any] = {"config": args.config, "layers": args.layers}
    row["engine"] = CONFIGS[args.config]
    out = args.out / f"{args.config}.json"
    t0 = time.monotonic()
    with LLM.from_config(cfg) as llm:
        row["build_s"] = round(time.monotonic() - t0, 1)
        print(f"{args.config}: group built in {row['build_s']} s", flush=True)
        engine = llm.engine
        t = time.monotonic()
        row["greedy"] = greedy(engine, one_at_a_time=False)
        row["greedy_s"] = round(time.monotonic() - t, 1)
        _save(out, row)
        if args.config == "gather":
            t = time.monotonic()
            row["greedy_one_at_a_time"] = greedy(engine, one_at_a_time=True)
            row["greedy_one_at_a_time_s"] = round(time.monotonic() - t, 1)
        row["copy_bytes_per_s"] = copy_bandwidth(args.device)
        row["decode"] = []
        for per_rank in args.per_rank:
            r = decode_batch(engine, 2 * per_rank, args.ctx, args.steps)
            r |= {"per_rank": per_rank, "tok_s_per_gpu": round(r["tok_s_total"] / 2, 1)}
            r["rank_bytes"] = rank_bytes(llm, per_rank, args.ctx)
            row["decode"].append(r)
            print(json.dumps(r), flush=True)
            _save(out, row)
        if args.prefill_per_rank:
            p = prefill_rate(engine, 2 * args.prefill_per_rank, args.prefill_len)
            row["prefill"] = p | {"tok_s_per_gpu": round(p["tok_s_total"] / 2, 1)}
            print(json.dumps(row["prefill"]), flush=True)
        _save(out, row)
    row["teardown"] = "done"
    _save(out, row)


def _save(path: Path, row: dict[str, Any]) -> None:
    path.write_text(json.dumps(row, indent=1))


# -- report ----------------------------------------------------------------------------


def _tops(top: dict[str, list[dict[str, float]]]) -> dict[str, list[dict[int, float]]]:
    return {k: [{int(t): p for t, p in d.items()} for d in v] for k, v in top.items()}


def margin(top: dict[int, float]) -> float:
    """Top-1 minus top-2 log-probability at one position."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def token_verdict(run: dict[str, Any], ref: dict[str, Any], ref_spread: float) -> dict[str, Any]:
    """``run``'s greedy tokens against ``ref``'s (both batched): equal, or parting only at
    positions where ``ref``'s top-2 margin is within ``ref_spread``; and the largest
    log-probability gap where both had the same inputs, against that spread (the one-engine
    spread: ``ref`` batched vs one at a time)."""
    got, want = run["greedy"]["tokens"], ref["greedy"]["tokens"]
    ref_top = _tops(ref["greedy"]["top"])
    parts = []
    for rid, toks in want.items():
        pos = first_difference(got.get(rid, []), toks)
        if pos is not None:
            m = margin(ref_top[rid][pos]) if pos < len(ref_top[rid]) else float("inf")
            parts.append({"request": rid, "position": pos, "ref_top2_margin": round(m, 4)})
    ok = all(p["ref_top2_margin"] <= ref_spread for p in parts)
    equal = sum(1 for rid in want if got.get(rid) == want[rid])
    gaps = compare(got, _tops(run["greedy"]["top"]), want, ref_top, ref_spread)
    return {
        "equal_requests": equal,
        "requests": len(want),
        "parted": parts,
        "parted_within_spread": ok,
        "spread": round(ref_spread, 4),
        "same_input_logprob_gap": gaps["same_input_logprob_gap"],
        "verdict": gaps["verdict"],
    }


def gather_spread(ref: dict[str, Any]) -> float:
    one = ref.get("greedy_one_at_a_time")
    if one is None:
        return 0.0
    batched = ref["greedy"]
    return spread(batched["tokens"], _tops(batched["top"]), [(one["tokens"], _tops(one["top"]))])


def roofline_ratio(r: dict[str, Any], copy_bw: float | None) -> float | None:
    """Step time over the rank's roofline (:mod:`dsv3serve.bench.engine.group_roofline`: the
    bytes a step reads at the copy bandwidth measured in the same run). Records of calls 1-3
    kept ``{experts, other, kv}`` (embedding and head inside ``other``, 12 layers, 9 MoE)."""
    b = r.get("rank_bytes")
    if not b or not copy_bw or "experts" not in b:
        return None
    full = {"head": 0, "layers": 12, "moe_layers": 9} | b
    need = step_bytes(RankBytes(**full), RANKS * r["per_rank"], TOP_K, EXPERTS)
    return round(r["median_step_ms"] / roofline_ms(need, copy_bw), 2)


def report(out: Path) -> dict[str, Any]:
    runs = {
        p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem in CONFIGS
    }
    result: dict[str, Any] = {"runs": {}, "tokens": {}}
    ref = runs.get("gather")
    ref_spread = gather_spread(ref) if ref else 0.0
    print(f"{'config':<20} {'per rank':>8} {'step ms':>9} {'tok/s/GPU':>10} {'x roofline':>10}")
    for name, run in runs.items():
        summary = {k: v for k, v in run.items() if k not in ("greedy", "greedy_one_at_a_time")}
        for r in run.get("decode", []):
            r["x_roofline"] = roofline_ratio(r, run.get("copy_bytes_per_s"))
            print(
                f"{name:<20} {r['per_rank']:>8} {r['median_step_ms']:>9.2f} "
                f"{r['tok_s_per_gpu']:>10.1f} {r['x_roofline']!s:>10}"
            )
        if "prefill" in run:
            p = run["prefill"]
            print(
                f"{name:<20} prefill {p['prompts']} x {p['length']}: "
                f"{p['tok_s_per_gpu']:.0f} tok/s/GPU"
            )
        result["runs"][name] = summary
        if ref and name != "gather" and "greedy" in run:
            result["tokens"][name] = token_verdict(run, ref, ref_spread)
            print(f"{name}: tokens vs gather: {json.dumps(result['tokens'][name])}")
    (out / "deepep_full_width.json").write_text(json.dumps(result, indent=1))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("config", choices=list(CONFIGS))
    r.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    r.add_argument("--model", default="", help="checkpoint for --device cpu (default: tiny)")
    r.add_argument("--layers", type=int, default=12)
    r.add_argument("--per-rank", type=int, nargs="+", default=[16, 64, 256])
    r.add_argument("--ctx", type=int, default=1024)
    r.add_argument("--steps", type=int, default=32)
    r.add_argument("--chunk", type=int, default=8192)
    r.add_argument("--prefill-per-rank", type=int, default=8)
    r.add_argument("--prefill-len", type=int, default=4096)
    r.add_argument("--engine-json", default="{}", help="more EngineConfig fields (JSON)")
    s = sub.add_parser("report")
    s.add_argument("out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cmd == "report":
        report(args.out)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu" and not args.model:
        from dsv3serve.model.tiny import make_tiny_checkpoint

        args.model = str(Path(tempfile.mkdtemp()) / "tiny")
        make_tiny_checkpoint(args.model, fp8=False)
    run(args)


if __name__ == "__main__":
    sys.exit(main())
