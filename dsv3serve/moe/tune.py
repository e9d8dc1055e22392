"""``python -m dsv3serve.moe.tune``: time the fused MoE's launch configs on this GPU and write
the table that :func:`dsv3serve.moe.moe_config.get_config` reads.

For each token count T, with random routing from the real router over random logits: for each
``block_m`` the experts are blocked once, every gate/up tile is timed on those blocks, then
every down tile on the best gate/up's output; the ``block_m`` with the smallest sum of the two
best times wins. Times are CUDA-graph medians (``dsv3serve bench kernels``' method). A
config that does not compile or fit in shared memory is skipped. The table is written as
``<out>/E=..,N=..,K=..,device=..,dtype=...json``::

    python -m dsv3serve.moe.tune --dtype fp8 --tokens 1 8 32 128 512 4096
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from dsv3serve.bench.kernels import graph_us
from dsv3serve.kernels.fp8_quant import quant_per_token_group_fp8
from dsv3serve.moe.align import ExpertBlocks, moe_align_block_size
from dsv3serve.moe.experts import FusedExperts, random_experts
from dsv3serve.moe.gate import grouped_topk
from dsv3serve.moe.moe_config import CONFIG_DIR, GemmTile, MoEConfig, config_file_name
from dsv3serve.moe.triton_moe import moe_down, moe_gate_up

BLOCK_MS = (16, 32, 64, 128)
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def tiles(gate_up: bool, fp8: bool, block_m: int) -> list[GemmTile]:
    """Candidate tiles of one GEMM (the fp8 gate/up quantises 128-wide groups: block_n 128)."""
    block_ns = (128,) if gate_up and fp8 else (64, 128)
    block_k = 128 if fp8 else 64
    swaps = (False, True) if block_m <= 64 else (False,)
    grid = itertools.product(block_ns, (4, 8), (3, 4, 5), swaps)
    return [GemmTile(bn, block_k, w, s, sw) for bn, w, s, sw in grid]


def _best(time_one, candidates: list[GemmTile]) -> tuple[float, GemmTile | None]:
    best: tuple[float, GemmTile | None] = (float("inf"), None)
    for tile in candidates:
        try:
            best = min(best, (time_one(tile), tile), key=lambda b: b[0])
        except Exception:  # over the shared-memory limit, or no valid layout: skip
            continue
    return best


def _time_block_m(
    ex: FusedExperts, x: torch.Tensor, blocks: ExpertBlocks, top_k: int, replays: int
) -> tuple[float, MoEConfig | None]:
    fp8 = ex.is_fp8
    a, a_s = quant_per_token_group_fp8(x) if fp8 else (x, None)

    def gate_up_us(tile: GemmTile) -> float:
        run = lambda i: moe_gate_up(a, a_s, ex.w13, ex.w13_scale_inv, blocks, top_k, tile, x.dtype)  # noqa: E731
        return graph_us(run, 4, replays)

    gu_us, gu = _best(gate_up_us, tiles(True, fp8, blocks.block_m))
    if gu is None:
        return float("inf"), None
    h, h_s = moe_gate_up(a, a_s, ex.w13, ex.w13_scale_inv, blocks, top_k, gu, x.dtype)

    def down_us(tile: GemmTile) -> float:
        run = lambda i: moe_down(h, h_s, ex.w2, ex.w2_scale_inv, blocks, tile, x.dtype)  # noqa: E731
        return graph_us(run, 4, replays)

    dn_us, dn = _best(down_us, tiles(False, fp8, blocks.block_m))
    if dn is None:
        return float("inf"), None
    return gu_us + dn_us, MoEConfig(blocks.block_m, gu, dn)


def tune_tokens(ex: FusedExperts, t: int, args: argparse.Namespace) -> MoEConfig:
    """The fastest config for T = ``t`` tokens."""
    logits = torch.randn(t, ex.num_experts, device="cuda")
    bias = torch.randn(ex.num_experts, device="cuda") * 0.1
    _, ids = grouped_topk(logits, bias, args.top_k, args.n_group, args.topk_group, 2.5)
    x = torch.randn(t, ex.hidden, device="cuda", dtype=torch.bfloat16)
    results = []
    for bm in BLOCK_MS:
        blocks = moe_align_block_size(ids, ex.num_experts, bm)
        results.append(_time_block_m(ex, x, blocks, args.top_k, args.replays))
        print(json.dumps({"T": t, "block_m": bm, "us": results[-1][0]}), flush=True)
    us, cfg = min(results, key=lambda r: r[0])
    if cfg is None:
        raise RuntimeError(f"no config ran for T={t}")
    print(json.dumps({"T": t, "best_us": us, "config": cfg.to_json()}), flush=True)
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv3serve.moe.tune", description=__doc__)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048, help="moe_intermediate_size (per shard)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--n-group", type=int, default=8)
    p.add_argument("--topk-group", type=int, default=4)
    p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="expert weights")
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--out", type=Path, default=CONFIG_DIR, help="folder of the table")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tuning needs a CUDA GPU")
    fp8 = args.dtype == "fp8"
    ex = random_experts(args.experts, args.hidden, args.inter, fp8, torch.bfloat16, "cuda")
    table = {str(t): tune_tokens(ex, t, args).to_json() for t in args.tokens}
    name = config_file_name(
        args.experts, args.inter, args.hidden, torch.cuda.get_device_name(), fp8
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / name).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
