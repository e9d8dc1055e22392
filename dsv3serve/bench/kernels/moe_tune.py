"""``python -m dsv3serve.bench.kernels.moe_tune``: time the fused MoE's launch configs on
this GPU and write the table that :func:`dsv3serve.moe.moe_config.get_config` reads.

For each token count T, with random routing from the real router over random logits: for each
``block_m`` the experts are blocked once, every gate/up tile is timed on those blocks, then
every down tile on the best gate/up's output; the ``block_m`` with the smallest sum of the two
best times wins. Times are CUDA-graph medians (``dsv3serve bench kernels``' method). A
config that does not compile or fit in shared memory is skipped. The table is written as
``<out>/E=..,N=..,K=..,device=..,dtype=...json``::

    python -m dsv3serve.bench.kernels.moe_tune --dtype fp8 --tokens 1 8 32 128 512 4096

``--shared`` tunes the stack with the shared expert fused (E + 1 experts, every token also
routed to expert E: the E=257 table). ``--ep-size N`` tunes an expert-parallel rank's stack:
tokens are routed over all ``--experts``, the choices of experts outside rank 0's ``E / N``
become id -1 (:func:`~dsv3serve.moe.sharded.to_local_ids`, as the dispatchers deliver them)
and the table is the ``E / N`` one. Each token count also times the default rule's config,
so the output says what the table gains over it; where the default was as fast, the table
holds the default.

``--quick`` searches 7 token counts, the block sizes near the default rule's and fewer
tiles (sized for a few minutes per table on an H200); ``--budget-s`` stops timing once
that many seconds have passed and writes the default rule's config for the token counts
left, saying so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsv3serve.bench.kernels.timing import graph_us
from dsv3serve.kernels.fp8_quant import quant_per_token_group_fp8
from dsv3serve.moe.align import ExpertBlocks, moe_align_block_size
from dsv3serve.moe.experts import FusedExperts, random_experts
from dsv3serve.moe.gate import grouped_topk
from dsv3serve.moe.moe_config import (
    CONFIG_DIR,
    GemmTile,
    MoEConfig,
    config_file_name,
    default_config,
)
from dsv3serve.moe.sharded import to_local_ids
from dsv3serve.moe.shared import append_shared_expert
from dsv3serve.moe.triton_moe import moe_down, moe_gate_up

BLOCK_MS = (16, 32, 64, 128)
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def tiles(gate_up: bool, fp8: bool, block_m: int, quick: bool = False) -> list[GemmTile]:
    """Candidate tiles of one GEMM (the fp8 gate/up quantises 128-wide groups: block_n 128).

    ``quick``: 3 or 4 stages, and swapped operands only for blocks of at most 32 rows.
    """
    block_ns = (128,) if gate_up and fp8 else (64, 128)
    block_k = 128 if fp8 else 64
    swaps = (False, True) if block_m <= (32 if quick else 64) else (False,)
    stages = (3, 4) if quick else (3, 4, 5)
    grid = itertools.product(block_ns, (4, 8), stages, swaps)
    return [GemmTile(bn, block_k, w, s, sw) for bn, w, s, sw in grid]


def block_ms(tokens: int, experts: int, top_k: float, quick: bool) -> tuple[int, ...]:
    """Candidate ``block_m``: all, or (``quick``) those near the default rule's for the expected
    rows per expert ``T * top_k / E`` (``top_k``: the choices a token makes in this stack)."""
    if not quick:
        return BLOCK_MS
    rows = tokens * top_k / experts
    if rows <= 8:
        return (16, 32)
    return (16, 32, 64) if rows <= 32 else (32, 64, 128)


def _best(
    time_one: Callable[[GemmTile], float], candidates: list[GemmTile]
) -> tuple[float, GemmTile | None]:
    best: tuple[float, GemmTile | None] = (float("inf"), None)
    for tile in candidates:
        try:
            best = min(best, (time_one(tile), tile), key=lambda b: b[0])
        except Exception:  # over the shared-memory limit, or no valid layout: skip
            continue
    return best


def _time_block_m(
    ex: FusedExperts, x: torch.Tensor, blocks: ExpertBlocks, top_k: int, args: argparse.Namespace
) -> tuple[float, MoEConfig | None]:
    """The fastest gate/up tile on ``blocks``, then the fastest down tile on its output."""
    fp8, quick = ex.is_fp8, args.quick
    gate_ups, downs = (
        tiles(True, fp8, blocks.block_m, quick),
        tiles(False, fp8, blocks.block_m, quick),
    )
    return _time_tiles(ex, x, blocks, top_k, gate_ups, downs, args.replays)


def _time_tiles(
    ex: FusedExperts,
    x: torch.Tensor,
    blocks: ExpertBlocks,
    top_k: int,
    gate_ups: list[GemmTile],
    downs: list[GemmTile],
    replays: int,
) -> tuple[float, MoEConfig | None]:
    """Gate/up plus down time of the best of each candidate list (one each: that config)."""
    a, a_s = quant_per_token_group_fp8(x) if ex.is_fp8 else (x, None)

    def gate_up_us(tile: GemmTile) -> float:
        run = lambda i: moe_gate_up(a, a_s, ex.w13, ex.w13_scale_inv, blocks, top_k, tile, x.dtype)  # noqa: E731
        return graph_us(run, 4, replays)

    gu_us, gu = _best(gate_up_us, gate_ups)
    if gu is None:
        return float("inf"), None
    h, h_s = moe_gate_up(a, a_s, ex.w13, ex.w13_scale_inv, blocks, top_k, gu, x.dtype)

    def down_us(tile: GemmTile) -> float:
        run = lambda i: moe_down(h, h_s, ex.w2, ex.w2_scale_inv, blocks, tile, x.dtype)  # noqa: E731
        return graph_us(run, 4, replays)

    dn_us, dn = _best(down_us, downs)
    if dn is None:
        return float("inf"), None
    return gu_us + dn_us, MoEConfig(blocks.block_m, gu, dn)


def routing_ids(t: int, ex: FusedExperts, args: argparse.Namespace) -> torch.Tensor:
    """ids [T, k] from the real router over random logits over all ``args.experts``; under
    ``--ep-size`` those of experts beyond the stack are -1; [T, k + 1] with the shared slot."""
    logits = torch.randn(t, args.experts, device=ex.w13.device)
    bias = torch.randn(args.experts, device=ex.w13.device) * 0.1
    w, ids = grouped_topk(logits, bias, args.top_k, args.n_group, args.topk_group, 2.5)
    if ex.num_experts < args.experts:
        w, ids = to_local_ids(w, ids, range(ex.num_experts))
    return append_shared_expert(w, ids, ex.num_experts)[1] if ex.shared_slots else ids


def local_experts(args: argparse.Namespace) -> int:
    """Experts in the tuned stack: rank 0's share under ``--ep-size``."""
    if args.ep_size < 1 or args.experts % args.ep_size:
        raise SystemExit(f"--ep-size {args.ep_size} does not divide {args.experts} experts")
    if args.ep_size > 1 and args.shared:
        raise SystemExit("--shared: the shared expert is not fused on expert-parallel ranks")
    return args.experts // args.ep_size


def tune_tokens(ex: FusedExperts, t: int, args: argparse.Namespace) -> MoEConfig:
    """The fastest config for T = ``t`` tokens."""
    ids = routing_ids(t, ex, args)
    slots, top_k = ex.num_experts + ex.shared_slots, ids.shape[1]
    x = torch.randn(t, ex.hidden, device="cuda", dtype=torch.bfloat16)
    results = []
    held = top_k * ex.num_experts / args.experts if ex.num_experts < args.experts else top_k
    for bm in block_ms(t, slots, held, args.quick):
        blocks = moe_align_block_size(ids, slots, bm)
        results.append(_time_block_m(ex, x, blocks, top_k, args))
        print(json.dumps({"T": t, "block_m": bm, "us": results[-1][0]}), flush=True)
    us, cfg = min(results, key=lambda r: r[0])
    if cfg is None:
        raise RuntimeError(f"no config ran for T={t}")
    default = default_config(t, slots, top_k, ex.is_fp8)
    blocks = moe_align_block_size(ids, slots, default.block_m)
    default_us, _ = _time_tiles(
        ex, x, blocks, top_k, [default.gate_up], [default.down], args.replays
    )
    line = {"T": t, "best_us": us, "default_us": default_us, "default_over_best": default_us / us}
    if default_us <= us:  # the search missed it: the table never holds a slower config
        cfg = default
    print(json.dumps(line | {"config": cfg.to_json()}), flush=True)
    return cfg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dsv3serve.bench.kernels.moe_tune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--experts", type=int, default=256, help="routed experts of the model")
    p.add_argument("--ep-size", type=int, default=1, help="tune an EP rank's E / N experts")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048, help="moe_intermediate_size (per shard)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--n-group", type=int, default=8)
    p.add_argument("--topk-group", type=int, default=4)
    p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="expert weights")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="default: all or quick")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--shared", action="store_true", help="shared expert fused: E + 1 experts")
    p.add_argument("--quick", action="store_true", help="7 token counts, fewer candidates")
    p.add_argument("--budget-s", type=float, default=None, help="stop timing after this long")
    p.add_argument("--out", type=Path, default=CONFIG_DIR, help="folder of the table")
    p.add_argument("--merge", action="store_true", help="keep the file's other token counts")
    return p


def write_table(path: Path, table: dict[str, dict], merge: bool) -> None:
    """Write ``table`` (token count -> config JSON) to ``path``, ordered by token count; with
    ``merge`` the file's entries for other token counts are kept (one run per T adds up)."""
    if merge and path.is_file():
        table = json.loads(path.read_text()) | table
    ordered = dict(sorted(table.items(), key=lambda kv: int(kv[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ordered, indent=1) + "\n")


def tune_table(ex: FusedExperts, args: argparse.Namespace) -> dict[str, dict]:
    """Time each token count (within the budget); the default rule for those past it."""
    tokens = args.tokens or list(QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    slots, top_k = ex.num_experts + ex.shared_slots, args.top_k + ex.shared_slots
    start, table = time.monotonic(), {}
    for t in tokens:
        if args.budget_s is not None and time.monotonic() - start > args.budget_s:
            cfg = default_config(t, slots, top_k, ex.is_fp8)
            print(json.dumps({"T": t, "budget_spent": True, "default": cfg.to_json()}), flush=True)
            if args.merge:
                continue  # never replace an entry an earlier run measured with the default
        else:
            cfg = tune_tokens(ex, t, args)
        table[str(t)] = cfg.to_json()
    print(json.dumps({"tuning_s": round(time.monotonic() - start, 1)}), flush=True)
    return table


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tuning needs a CUDA GPU")
    fp8, shared, local = args.dtype == "fp8", int(args.shared), local_experts(args)
    ex = random_experts(local, args.hidden, args.inter, fp8, torch.bfloat16, "cuda", shared)
    table = tune_table(ex, args)
    name = config_file_name(
        local + shared, args.inter, args.hidden, torch.cuda.get_device_name(), fp8
    )
    write_table(args.out / name, table, args.merge)
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
