"""``bench kernels --only mla`` on the CPU: its flags and its table (timing needs a GPU)."""

from __future__ import annotations

import argparse

import pytest
import torch
from attention_cases import DEEPSEEK_DIMS, make_case
from fake_flash_mla import decode_calls, install
from fake_flashinfer import install as install_flashinfer

from dsv3serve.attention.flashmla_backend import FlashMLAAttention
from dsv3serve.bench.kernels.mla import FP8_CONFIGS, FP8_KERNELS, KERNELS, add_mla_args
from dsv3serve.bench.kernels.mla_flashmla import bare_call
from dsv3serve.bench.kernels.mla_report import print_mla_table


def _row(kernel: str, us: float, config: dict | None = None) -> dict:
    return {
        "kernel": kernel,
        "kv_dtype": "fp8" if kernel in FP8_KERNELS else "bf16",
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


def test_bare_flashmla_rows_sit_beside_the_backends(capsys) -> None:
    assert {"flashmla-bf16-kernel", "flashmla-fp8-kernel"} <= set(KERNELS)
    assert "flashmla-fp8-kernel" in FP8_KERNELS and "flashmla-bf16-kernel" not in FP8_KERNELS
    rows = [_row("flashinfer", 134.6), _row("flashmla-fp8", 125.0)]
    rows.append(_row("flashmla-fp8-kernel", 116.7))
    print_mla_table({"copy_TBps": 3.0}, {"flashinfer": "0.6", "page_size": 64, "rows": rows})
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.split()[:2] == ["flashmla-fp8-kernel", "fp8"] and " 1.15 " in last


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_bare_flashmla_call_computes_what_the_backend_does(monkeypatch, fp8: bool) -> None:
    """Through FakeFlashMLACPU: the bare row's kernel call (q packed once, the probe's
    metadata and unit descales) gives the backend's output on the same pool and batch."""
    install_flashinfer(monkeypatch)
    fake = install(monkeypatch)
    kw = {"dtype": torch.float8_e4m3fn, "fp8_scales": "layer"} if fp8 else {}
    case = make_case(DEEPSEEK_DIMS, [1] * 3, [10, 70, 64], "cpu", 64, **kw)
    attn = FlashMLAAttention(case.pool, DEEPSEEK_DIMS)
    attn.plan(case.batch)
    for layer in range(case.pool.num_layers):
        attn.save_latent(layer, case.new_latents)
    q = torch.randn(3, 128, 576).to(torch.bfloat16)
    q_latent, q_pe = q[..., :512].contiguous(), q[..., 512:].contiguous()
    scale = DEEPSEEK_DIMS.softmax_scale
    call = bare_call(case.batch, case.pool, q_latent, q_pe, scale)
    for layer in range(case.pool.num_layers):
        want = attn.forward_absorbed(q_latent, q_pe, layer, scale)
        assert torch.equal(call(layer).view_as(want), want)
    bare = decode_calls(fake)[-1]
    assert bare["fp8"] == fp8 and bare["q_shape"] == (3, 1, 128, 576)
    if fp8:
        assert bare["descale_q"].tolist() == bare["descale_k"].tolist() == [1.0]
