"""The decoder layer's fused add + RMSNorm + FP8 quantisation path, on CPU.

The switch: read from the environment through Settings, honoured by the model options, and
never taken on CPU by itself (the reference path that the HF-equality tests compare).
The wiring: with the layer forced onto the fused path on CPU (``takes_quantized`` faked
true, the quantised GEMM faked by its dequantise-then-matmul reference, both named fakes
below), the tiny FP8 model's logits equal the reference path's: both quantise the same
bf16 norm outputs the same way, so any difference is a wiring fault (a dropped residual,
a wrong norm weight, input read unquantised). The fused op here is its torch reference
(what :func:`add_rmsnorm_quant` runs on CPU): the Triton kernel's 1-step e4m3 flips (its
scale is ``amax * fl32(1/448)``, the CPU reference's ``amax / 448``) are bounded in
tests/kernels/test_norm_quant_interp.py, and the tiny random model amplifies a handful of
them to ~10% of its logits, which would hide a wiring fault of that size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import load_ours, make_attn, prefill_logits

import dsv3serve.layers.linear as linear_mod
import dsv3serve.model.deepseek_v3 as dsv3
from dsv3serve.kernels.fp8_ref import dequant_per_token_group, dequant_weight_block
from dsv3serve.model.deepseek_v3 import DecoderLayer, ModelOptions
from dsv3serve.settings import FUSED_NORM_QUANT_ENV, Settings


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False)])
def test_env_switch(value: str | None, on: bool) -> None:
    env = {} if value is None else {FUSED_NORM_QUANT_ENV: value}
    assert Settings.from_env(env).fused_norm_quant is on


def test_model_options_default_reads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FUSED_NORM_QUANT_ENV, "0")
    assert ModelOptions().fuse_norm_quant is False
    monkeypatch.delenv(FUSED_NORM_QUANT_ENV)
    assert ModelOptions().fuse_norm_quant is True


def test_cpu_keeps_reference_path(tiny_fp8_dir: Path) -> None:
    model = load_ours(tiny_fp8_dir, fuse_norm_quant=True)
    layer = next(m for m in model.modules() if isinstance(m, DecoderLayer))
    assert layer.fuse_norm_quant and not layer.fuses_norm_quant


def _fake_gemm_quantized(xq, xs, w, ws):  # fake: the reference of the quantised GEMM
    y = dequant_per_token_group(xq, xs) @ dequant_weight_block(w, ws).t()
    return y.to(torch.bfloat16)


def _logits(model_dir: Path, fused: bool) -> torch.Tensor:
    model = load_ours(model_dir, fuse_norm_quant=fused)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (4, 7)]
    return torch.cat(prefill_logits(model, make_attn(model), prompts)).float()


def test_fused_wiring_equals_reference_path(
    tiny_fp8_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _logits(tiny_fp8_dir, fused=False)
    calls: list[bool] = []
    kernel = dsv3.add_rmsnorm_quant

    def counted(*args, **kwargs):
        calls.append(True)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(linear_mod.Linear, "takes_quantized", lambda self, *where: self.is_fp8)
    monkeypatch.setattr(linear_mod, "fp8_block_gemm_quantized", _fake_gemm_quantized)
    monkeypatch.setattr(dsv3, "add_rmsnorm_quant", counted)
    fused = _logits(tiny_fp8_dir, fused=True)
    layers = load_ours(tiny_fp8_dir).cfg.num_hidden_layers
    assert len(calls) == 2 * layers, f"expected {2 * layers} fused calls, got {len(calls)}"
    rel = float((fused - ref).norm() / ref.norm())
    print(f"fused (reference op) vs reference path: relative logit difference {rel:.2e}")
    assert rel < 1e-3, f"expected fused == reference path, relative difference {rel:.2e}"
