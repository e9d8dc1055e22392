"""``dsv3serve bench kernels``: the FP8 kernels, the fused MoE, the router gate, MLA decode
attention and the fused norm kernels on DeepSeek-V3 shapes, against the same run's ceilings
(device copy bandwidth, bf16 and per-tensor fp8 GEMM peaks at 8192^3).
``--only fp8,moe,gate,mla,fused`` picks the sections (FP8: :mod:`dsv3serve.bench.kernels.fp8`;
MoE and gate: :mod:`dsv3serve.bench.kernels.moe`; MLA: :mod:`dsv3serve.bench.kernels.mla`;
fused norms: :mod:`dsv3serve.bench.kernels.fused`; timing: :mod:`dsv3serve.bench.kernels.timing`).
``deepgemm`` (DeepGEMM against cuBLAS / Triton, :mod:`dsv3serve.bench.kernels.deepgemm_run`)
runs only when named: its kernels JIT-compile for minutes on first use.
This module is the subcommand's registry: it imports the sections, none imports it.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

import torch

from dsv3serve.bench.kernels import deepgemm_run, fp8, fused, mla, mla_report, moe
from dsv3serve.bench.kernels.timing import measure_ceilings
from dsv3serve.kernels.fp8_quant import HAS_TRITON

SECTIONS = ("fp8", "moe", "gate", "mla", "fused", "deepgemm")
DEFAULT_SECTIONS = ("fp8", "moe", "gate", "mla", "fused")


def _environment() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
    }


def run_bench_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the ceilings, then the chosen sections; print tables and write JSON."""
    if not (HAS_TRITON and torch.cuda.is_available()):
        raise ValueError("bench kernels needs a CUDA GPU and Triton")
    ceil = measure_ceilings(args.replays)
    result: dict[str, Any] = {"environment": _environment(), "ceilings": ceil}
    if "fp8" in args.only:
        result["rows"] = fp8.run_fp8(ceil, args)
        result["cublas_faster_from_m"] = fp8.crossover(result["rows"])
    if "moe" in args.only:
        result["moe"] = moe.run_moe(ceil, args)
    if "gate" in args.only:
        result["gate"] = moe.run_gate(args)
    if "mla" in args.only:
        result["mla"] = mla.bench_mla(args, ceil)
    if "fused" in args.only:
        result["fused"] = fused.run_fused(args)
    if "deepgemm" in args.only:
        result["deepgemm"] = deepgemm_run.run_deepgemm(args)
    Path(args.json).write_text(json.dumps(result, indent=1))
    if "fp8" in args.only:
        fp8.print_table(ceil, result["rows"])
        print("cuBLAS faster from M:", result["cublas_faster_from_m"])
    if "moe" in args.only:
        moe.print_moe(result["moe"])
    if "gate" in args.only:
        moe.print_gate(result["gate"])
    if "mla" in args.only:
        mla_report.print_mla_table(ceil, result["mla"])
    if "fused" in args.only:
        fused.print_fused(result["fused"])
    if "deepgemm" in args.only:
        deepgemm_run.print_deepgemm(result["deepgemm"])
        _write_deepgemm_table(args, result)
    return result


def _write_deepgemm_table(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.write_deepgemm_table is None:
        return
    path = Path(args.write_deepgemm_table or deepgemm_run.default_table_path())
    env = {**result["environment"], "ceilings": result["ceilings"]}
    deepgemm_run.write_deepgemm_table(result["deepgemm"], path, env)


def parse_sections(text: str) -> list[str]:
    """``"moe,gate"`` -> ``["moe", "gate"]``, each one of :data:`SECTIONS`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {SECTIONS}, got {text!r}")
    return names


def _run(args: argparse.Namespace) -> int:
    run_bench_kernels(args)
    return 0


def add_kernels_parser(bench: Any) -> argparse.ArgumentParser:
    """Add ``kernels`` to the ``bench`` subparsers (``bench``: argparse's subparsers action)."""
    p = bench.add_parser(
        "kernels",
        help="FP8 quant and block GEMM, fused MoE, router gate, MLA decode, fused norms vs the "
        "GPU's ceilings",
    )
    p.add_argument(
        "--only",
        type=parse_sections,
        default=list(DEFAULT_SECTIONS),
        help="comma list of sections: fp8 (quant + GEMM), moe, gate, mla, fused, deepgemm "
        "(default: all but deepgemm)",
    )
    p.add_argument("--m", type=int, nargs="+", default=list(fp8.DEFAULT_MS), help="batch rows")
    p.add_argument("--shapes", nargs="+", default=list(fp8.SHAPES), choices=list(fp8.SHAPES))
    p.add_argument("--no-sweep", action="store_true", help="skip the Triton config sweep")
    p.add_argument("--replays", type=int, default=10, help="timed graph replays per point")
    p.add_argument("--json", default="bench_kernels.json", help="where to write results")
    moe.add_moe_args(p)
    mla.add_mla_args(p)
    fused.add_fused_args(p)
    deepgemm_run.add_deepgemm_args(p)
    p.set_defaults(func=_run)
    return p
