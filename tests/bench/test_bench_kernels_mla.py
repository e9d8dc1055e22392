"""``bench kernels --only mla`` on the CPU: its flags and its table (timing needs a GPU)."""

from __future__ import annotations

import argparse

from dsv3serve.bench.kernels.mla import FP8_CONFIGS, KERNELS, add_mla_args
from dsv3serve.bench.kernels.mla_report import print_mla_table


def _row(kernel: str, us: float, config: dict | None = None) -> dict:
    return {
        "kernel": kernel,
        "kv_dtype": "bf16" if kernel in ("flashinfer", "triton-bf16", "flashmla-bf16") else "fp8",
        "config": config,
        "batch": 64,
        "context": 4096,
        "index": "page",
        "us": us,
        "TBps": 2.0,
        "pct_copy_bw": 50.0,
        "TFLOPs": 500.0,
    }


def test_defaults_time_every_kernel_and_at_most_eight_fp8_configs() -> None:
    p = argparse.ArgumentParser()
    add_mla_args(p)
    args = p.parse_args([])
    assert args.mla_kernels == list(KERNELS) and 64 in args.mla_batch
    assert args.mla_fp8_configs == list(FP8_CONFIGS) and len(FP8_CONFIGS) <= 8


def test_table_compares_each_row_with_flashinfer(capsys) -> None:
    cfg = vars(FP8_CONFIGS["n32w4dv2"])
    mla = {"flashinfer": "0.6", "page_size": 64, "rows": [_row("flashinfer", 140.0)]}
    mla["rows"].append(_row("triton-fp8mma", 100.0, cfg))
    print_mla_table({"copy_TBps": 4.0}, mla)
    lines = capsys.readouterr().out.splitlines()
    assert " 1.40 " in lines[-1] and "dv_split=2" in lines[-1]


def test_table_without_flashinfer(capsys) -> None:
    mla = {"flashinfer": None, "page_size": 64, "rows": [_row("triton-fp8", 300.0)]}
    print_mla_table({"copy_TBps": 4.0}, mla)
    assert capsys.readouterr().out.splitlines()[-1].split()[-1] == "-"


def test_flashmla_rows_by_default_with_their_ratio_to_flashinfer(capsys) -> None:
    assert {"flashmla-bf16", "flashmla-fp8"} <= set(KERNELS)
    rows = [_row("flashinfer", 134.5), _row("flashmla-bf16", 123.5), _row("flashmla-fp8", 116.7)]
    mla = {"flashinfer": "0.6", "flash_mla": "1.0.0", "page_size": 64, "rows": rows}
    print_mla_table({"copy_TBps": 4.0}, mla)
    lines = capsys.readouterr().out.splitlines()
    assert "flash_mla 1.0.0" in lines[0]
    assert lines[-1].split()[:2] == ["flashmla-fp8", "fp8"] and " 1.15 " in lines[-1]
    assert rows[1]["x_flashinfer"] == 134.5 / 123.5
