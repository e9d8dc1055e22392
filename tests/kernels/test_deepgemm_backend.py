"""The optional DeepGEMM backend's selection, with fake ``deep_gemm`` modules on the CPU
(tests/support/fake_deep_gemm.py): chosen only when it imports and its self-check passes."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from fake_deep_gemm import make_fake_deep_gemm

from dsv3serve.kernels import deepgemm
from dsv3serve.kernels.fp8_gemm import choose_backend, fp8_block_gemm, fp8_block_gemm_deepgemm
from dsv3serve.kernels.fp8_ref import (
    fp8_block_linear_ref,
    quant_per_token_group,
    quant_weight_block,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_status():
    deepgemm.deepgemm_status.cache_clear()
    yield
    deepgemm.deepgemm_status.cache_clear()


def _install(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType | None) -> None:
    monkeypatch.setitem(sys.modules, "deep_gemm", module)  # None: import raises ImportError


def test_correct_module_is_selected_and_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, make_fake_deep_gemm("correct"))
    status = deepgemm.deepgemm_status("cpu")
    assert status.usable, status.reason
    torch.manual_seed(0)
    x = torch.randn(5, 384)
    w, ws = quant_weight_block(torch.randn(192, 384) * 0.02)
    xq, xs = quant_per_token_group(x)
    y = fp8_block_gemm_deepgemm(xq, xs.t().contiguous().t(), w, ws)
    ref = fp8_block_linear_ref(x, w, ws)
    assert y.dtype == torch.bfloat16
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (make_fake_deep_gemm("garbage"), "relative error"),
        (make_fake_deep_gemm("raises"), "raised RuntimeError: Assertion error"),
        (types.ModuleType("deep_gemm"), "has no fp8_gemm_nt"),
        (None, "import deep_gemm failed"),
    ],
)
def test_bad_modules_are_rejected_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, module, why: str
) -> None:
    _install(monkeypatch, module)
    with caplog.at_level(logging.DEBUG, logger="dsv3serve.kernels.deepgemm"):
        status = deepgemm.deepgemm_status("cpu")
    assert not status.usable and why in status.reason
    assert "not used" in caplog.text and why in caplog.text
    xq, xs = quant_per_token_group(torch.randn(4, 256))
    w, ws = quant_weight_block(torch.randn(128, 256))
    with pytest.raises(RuntimeError, match="unusable"):
        fp8_block_gemm_deepgemm(xq, xs, w, ws)


def test_status_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fake = make_fake_deep_gemm("correct")
    inner = fake.fp8_gemm_nt

    def counting(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    fake.fp8_gemm_nt = counting
    _install(monkeypatch, fake)
    assert deepgemm.deepgemm_status("cpu").usable and deepgemm.deepgemm_status("cpu").usable
    assert len(calls) == 1


def test_dispatch_rule() -> None:
    # DeepGEMM takes cuBLAS's place (large M) only when usable; decode M stays on Triton
    assert choose_backend(4096, 7168, 2048, deepgemm_usable=True) == "deepgemm"
    assert choose_backend(4096, 7168, 2048, deepgemm_usable=False) == "cublas"
    assert choose_backend(1, 7168, 2048, deepgemm_usable=True) == "triton"
    assert choose_backend(4096, 7168, 200, deepgemm_usable=True) == "triton"  # K not 128-whole
    assert not deepgemm.usable_on(CPU)


@pytest.mark.gpu
def test_on_this_gpu_deepgemm_is_used_only_if_it_checks_out() -> None:
    """The real module where installed (usually not: then the reason names the import)."""
    cuda = torch.device("cuda", 0)
    status = deepgemm.deepgemm_status("cuda", 0)
    x = torch.randn(256, 7168, device=cuda, dtype=torch.bfloat16)
    w, ws = (t.to(cuda) for t in quant_weight_block(torch.randn(2048, 7168) * 0.02))
    ref = fp8_block_linear_ref(x, w, ws)
    if not status.usable:
        assert choose_backend(256, 2048, 7168, deepgemm.usable_on(cuda)) != "deepgemm"
        pytest.skip(f"DeepGEMM not used here: {status.reason}")
    y = fp8_block_gemm(x, w, ws, backend="deepgemm")
    assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 2e-2


@pytest.mark.gpu
def test_auto_dispatch_picks_a_checked_fake_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a (fake) module that passes on CUDA, ``auto`` routes large M to it."""
    _install(monkeypatch, make_fake_deep_gemm("correct"))
    cuda = torch.device("cuda", 0)
    assert deepgemm.usable_on(cuda)
    calls = []
    fake = sys.modules["deep_gemm"]
    inner = fake.fp8_gemm_nt
    fake.fp8_gemm_nt = lambda *a, **k: calls.append(1) or inner(*a, **k)
    x = torch.randn(1024, 7168, device=cuda, dtype=torch.bfloat16)
    w, ws = (t.to(cuda) for t in quant_weight_block(torch.randn(2048, 7168) * 0.02))
    y = fp8_block_gemm(x, w, ws)
    ref = fp8_block_linear_ref(x, w, ws)
    assert calls and float((y.float() - ref.float()).norm() / ref.float().norm()) < 2e-2
