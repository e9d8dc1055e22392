"""The ``deepgemm`` section of ``dsv3serve bench kernels``: its arguments, its parts (dense:
:mod:`dsv3serve.bench.kernels.deepgemm`; contiguous and masked MoE:
:mod:`dsv3serve.bench.kernels.deepgemm_moe`), its tables and the measured table it writes.

``python -m dsv3serve.bench.kernels.deepgemm_run warm --deepgemm-parts dense ...`` runs each
DeepGEMM call of the bench once, untimed, on uninitialised weights: the kernels JIT-compile
(nvcc, tens of seconds each) into ``DG_JIT_CACHE_DIR``, so several such processes can fill
the cache in parallel before the timed run (``benchmarks/run_deepgemm_gpu.sh``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from dsv3serve.bench.kernels import deepgemm_moe as moe
from dsv3serve.bench.kernels.deepgemm import (
    DENSE_MS,
    dense_shapes,
    dense_table_points,
    measured,
    print_dense,
    run_dense,
)
from dsv3serve.kernels import deepgemm
from dsv3serve.kernels.fp8_quant import quant_per_token_group_fp8
from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.kernels.gemm_table import Measured, table_path, write_section
from dsv3serve.moe.deepgemm_moe import deepgemm_moe_contiguous, deepgemm_moe_masked
from dsv3serve.moe.experts import ExpertStack

PARTS = ("dense", "contiguous", "masked")


def deepgemm_module() -> tuple[ModuleType | None, str]:
    """The real module if it passed its self-check on this GPU, else None and why."""
    status = deepgemm.deepgemm_status("cuda", torch.cuda.current_device())
    return (deepgemm.deepgemm_module(), status.reason) if status.usable else (None, status.reason)


def _version(module: ModuleType | None) -> str | None:
    return None if module is None else str(getattr(module, "__version__", "unknown"))


def run_deepgemm(args: argparse.Namespace) -> dict[str, Any]:
    """Every part asked for; the baselines run even without DeepGEMM (its columns empty)."""
    module, status = deepgemm_module()
    result: dict[str, Any] = {"deepgemm_status": status, "deep_gemm": _version(module)}
    if "dense" in args.deepgemm_parts:
        result["dense"] = run_dense(module, args)
    if "contiguous" in args.deepgemm_parts:
        result["contiguous"] = moe.run_contiguous(module, args)
    if "masked" in args.deepgemm_parts:
        result["masked"] = moe.run_masked(module, args)
    return result


def print_deepgemm(result: dict[str, Any]) -> None:
    print(f"DeepGEMM {result['deep_gemm']}: {result['deepgemm_status']}")
    if "dense" in result:
        print_dense(result["dense"])
    if "contiguous" in result:
        moe.print_moe("contiguous MoE (prefill): DeepGEMM m-grouped vs fused Triton MoE, us",
                      result["contiguous"])  # fmt: skip
    if "masked" in result:
        moe.print_moe("masked MoE (DeepEP low-latency): DeepGEMM masked vs Triton masked, us",
                      result["masked"])  # fmt: skip


def _moe_points(
    rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], str]
) -> dict[str, list[Measured]]:
    out: dict[str, list[Measured]] = {}
    for r in rows:
        point = measured(r, moe.ERROR_LIMIT)
        if point is not None:
            out.setdefault(key(r), []).append(point)
    return out


def write_deepgemm_table(result: dict[str, Any], path: Path, environment: dict) -> None:
    """Store the accurate points of every part that ran into the GPU's table at ``path``."""
    env = {**environment, "deep_gemm": result["deep_gemm"]}
    if result.get("dense"):
        write_section(path, "dense", dense_table_points(result["dense"]), env)
    if result.get("contiguous"):
        points = _moe_points(result["contiguous"], lambda r: moe.contiguous_key(r["E"]))
        write_section(path, "contiguous", points, env)
    if result.get("masked"):
        points = _moe_points(result["masked"], lambda r: moe.masked_key(r["E"], r["M"]))
        write_section(path, "masked", points, env)
    print(f"wrote {path}")


def default_table_path() -> Path:
    return table_path(torch.cuda.get_device_name(torch.cuda.current_device()))


def _parts(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(PARTS):
        raise argparse.ArgumentTypeError(f"expected a comma list of {PARTS}, got {text!r}")
    return names


def add_deepgemm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deepgemm-parts", type=_parts, default=list(PARTS), help=",".join(PARTS))
    p.add_argument("--deepgemm-ms", type=int, nargs="+", default=list(DENSE_MS))
    p.add_argument("--deepgemm-tp", type=int, default=1, help="dense shapes of a TP rank")
    p.add_argument("--deepgemm-shapes", nargs="+", default=None, help="linear names (default all)")
    p.add_argument("--deepgemm-tokens", type=int, nargs="+", default=list(moe.CONTIGUOUS_TOKENS))
    p.add_argument("--deepgemm-masked-ep", type=int, default=8)
    p.add_argument("--deepgemm-masked-tokens", type=int, nargs="+", default=list(moe.MASKED_TOKENS))
    p.add_argument(
        "--write-deepgemm-table",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="store the points where DeepGEMM was accurate in this GPU's measured table "
        "(default path: the shipped dsv3serve/kernels/configs/deepgemm,device=<GPU>.json)",
    )


# --- JIT warm-up: each DeepGEMM call once, untimed -------------------------------------------


def _empty_stack(e: int, hidden: int, inter: int) -> ExpertStack:
    w13 = torch.empty((e, 2 * inter, hidden), dtype=FP8_DTYPE, device="cuda")
    w2 = torch.empty((e, hidden, inter), dtype=FP8_DTYPE, device="cuda")
    s13 = torch.ones((e, 2 * inter // 128, hidden // 128), device="cuda")
    s2 = torch.ones((e, hidden // 128, inter // 128), device="cuda")
    return ExpertStack(w13, w2, s13, s2)


def warm(module: ModuleType, args: argparse.Namespace) -> None:
    c = moe.MOE_SHAPE
    for name, (n, k) in dense_shapes(args.deepgemm_tp).items():
        shapes = args.deepgemm_shapes
        if "dense" not in args.deepgemm_parts or (shapes and name not in shapes):
            continue
        w = torch.empty((n, k), dtype=FP8_DTYPE, device="cuda")
        ws = torch.ones((-(-n // 128), k // 128), device="cuda")
        for m in args.deepgemm_ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quant_per_token_group_fp8(x, m_major_scales=True)
            deepgemm.deepgemm_gemm(module, xq, xs, w, ws)
            print(f"warm dense {name} M={m}", flush=True)
    if "contiguous" in args.deepgemm_parts:
        stack = _empty_stack(c["e"], c["hidden"], c["inter"])
        for t in args.deepgemm_tokens:  # DeepGEMM's M is the blocks' bound: T alone sets it
            w, ids = moe.routing(t)
            x = torch.randn(t, c["hidden"], device="cuda", dtype=torch.bfloat16)
            deepgemm_moe_contiguous(module, x, w, ids, stack)
            print(f"warm contiguous T={t}", flush=True)
    if "masked" in args.deepgemm_parts:
        ep = args.deepgemm_masked_ep
        stack = _empty_stack(c["e"] // ep, c["hidden"], c["inter"])
        for t in args.deepgemm_masked_tokens:
            counts, xq, xs = moe.masked_inputs(c["e"] // ep, moe.MASKED_MAX_TOKENS * ep, t, ep)
            expected_m = max(1, -(-t * ep * c["top_k"] // c["e"]))
            deepgemm_moe_masked(module, xq, counts, stack, expected_m, x_scale=xs)
            print(f"warm masked T={t}", flush=True)
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("command", choices=["warm"])
    add_deepgemm_args(p)
    args = p.parse_args(argv)
    warm(deepgemm.deepgemm_module(), args)  # no self-check: a broken build fails here
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
