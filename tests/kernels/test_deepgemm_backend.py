"""The optional DeepGEMM backend's selection, with fake ``deep_gemm`` modules on the CPU
(tests/support/fake_deep_gemm.py): chosen only where the GPU's measured table says it wins,
and there only when it imports and its self-check passes; a WARNING, once, when it cannot."""

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
from dsv3serve.kernels.gemm_table import DeepGemmTable, parse_table

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_status():
    deepgemm.deepgemm_status.cache_clear()
    deepgemm._warn_unusable.cache_clear()
    yield
    deepgemm.deepgemm_status.cache_clear()
    deepgemm._warn_unusable.cache_clear()


def _point(deepgemm_us: float, baseline_us: float, baseline: str = "cublas") -> dict:
    return {"deepgemm_us": deepgemm_us, "baseline": baseline, "baseline_us": baseline_us}


# DeepGEMM measured 1.2x faster at M = 1024 and 2048 for N x K = 7168 x 2048, only 1.02x at
# 4096, slower at 64 (against Triton)
TABLE = parse_table(
    "NVIDIA H200",
    {
        "dense": {
            "N=7168,K=2048": {
                "64": _point(30.0, 20.0, "triton"),
                "1024": _point(100.0, 120.0),
                "2048": _point(200.0, 240.0),
                "4096": _point(400.0, 408.0),
            }
        }
    },
)


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
    with caplog.at_level(logging.WARNING, logger="dsv3serve.kernels.deepgemm"):
        status = deepgemm.deepgemm_status("cpu")
    assert not status.usable and why in status.reason
    assert "DeepGEMM not used" in caplog.text and why in caplog.text
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
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
    # DeepGEMM wherever the pick says so (and its shape rule holds), else Triton / cuBLAS by M
    assert choose_backend(4096, 7168, 2048, use_deepgemm=True) == "deepgemm"
    assert choose_backend(64, 7168, 2048, use_deepgemm=True) == "deepgemm"
    assert choose_backend(4096, 7168, 2048, use_deepgemm=False) == "cublas"
    assert choose_backend(1, 7168, 2048, use_deepgemm=False) == "triton"
    assert choose_backend(4096, 7168, 200, use_deepgemm=True) == "triton"  # K not 128-whole
    assert not deepgemm.usable_on(CPU) and not deepgemm.dense_pick(4096, 7168, 2048, CPU)


def _usable() -> bool:
    return deepgemm.deepgemm_status("cpu").usable


@pytest.mark.parametrize(
    ("m", "n", "k", "picked"),
    [
        (1024, 7168, 2048, True),  # measured 1.2x
        (1500, 7168, 2048, True),  # between two winning points
        (2048, 7168, 2048, True),
        (3000, 7168, 2048, False),  # 2048 won, 4096 only 1.02x: not both sides
        (4096, 7168, 2048, False),  # 1.02x < 1.05x
        (8192, 7168, 2048, False),  # past the measured range
        (64, 7168, 2048, False),  # slower than Triton
        (512, 7168, 2048, False),  # 64 lost, 1024 won: not both sides
        (1024, 2048, 7168, False),  # no entry for this shape
    ],
)
def test_table_driven_pick(monkeypatch: pytest.MonkeyPatch, m, n, k, picked: bool) -> None:
    _install(monkeypatch, make_fake_deep_gemm("correct"))
    assert deepgemm.picks(TABLE, m, n, k, _usable) is picked


def test_no_table_never_picks_or_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    fake = make_fake_deep_gemm("correct")
    inner = fake.fp8_gemm_nt
    fake.fp8_gemm_nt = lambda *a, **kw: calls.append(1) or inner(*a, **kw)
    _install(monkeypatch, fake)
    empty = DeepGemmTable("NVIDIA_H200", {}, {})
    assert not deepgemm.picks(None, 4096, 7168, 2048, _usable)
    assert not deepgemm.picks(empty, 4096, 7168, 2048, _usable)
    assert not deepgemm.picks(TABLE, 64, 7168, 2048, _usable)  # the table says no
    assert calls == []  # the self-check never ran


@pytest.mark.parametrize("module", [None, make_fake_deep_gemm("raises")])
def test_missing_deepgemm_warns_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, module
) -> None:
    _install(monkeypatch, module)
    with caplog.at_level(logging.DEBUG, logger="dsv3serve.kernels.deepgemm"):
        for m in (1024, 1500, 2048, 1024):
            assert not deepgemm.picks(TABLE, m, 7168, 2048, _usable)
            assert choose_backend(m, 7168, 2048, False) == "cublas"
        deepgemm.deepgemm_status.cache_clear()  # another device: the same reason
        assert not deepgemm.picks(TABLE, 1024, 7168, 2048, _usable)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "DeepGEMM not used" in warnings[0].getMessage()
    assert "docs/deepgemm.md" in warnings[0].getMessage()


@pytest.mark.gpu
def test_on_this_gpu_deepgemm_is_used_only_if_it_checks_out() -> None:
    """The real module where installed (usually not: then the reason names the import)."""
    cuda = torch.device("cuda", 0)
    status = deepgemm.deepgemm_status("cuda", 0)
    x = torch.randn(256, 7168, device=cuda, dtype=torch.bfloat16)
    w, ws = (t.to(cuda) for t in quant_weight_block(torch.randn(2048, 7168) * 0.02))
    ref = fp8_block_linear_ref(x, w, ws)
    if not status.usable:
        assert not deepgemm.picks(TABLE, 1024, 7168, 2048, lambda: deepgemm.usable_on(cuda))
        pytest.skip(f"DeepGEMM not used here: {status.reason}")
    y = fp8_block_gemm(x, w, ws, backend="deepgemm")
    assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 2e-2


@pytest.mark.gpu
def test_auto_dispatch_picks_a_checked_fake_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a (fake) module that passes on CUDA and a table where it wins, ``auto`` routes
    that shape to it."""
    _install(monkeypatch, make_fake_deep_gemm("correct"))
    win = {"1024": _point(1.0, 2.0)}
    monkeypatch.setattr(
        deepgemm, "table_for", lambda device: parse_table("x", {"dense": {"N=2048,K=7168": win}})
    )
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
