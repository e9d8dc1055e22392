"""The real DeepGEMM on a GPU (built by benchmarks/deepgemm/build.sh): ``fp8_gemm_nt`` through
dsv3serve's backend at DeepSeek-V3's shapes and inside a CUDA graph, and the startup log of
which backend runs where. Skipped without CUDA (conftest) or without ``deep_gemm``.

Tolerance: ``||y - ref|| / ||ref||`` < 2e-2 against the float32 reference of the same e4m3
weights (the activations are quantised by our Triton kernel on one side and the torch
reference on the other; the output is bf16: ~2e-3 expected).
"""

from __future__ import annotations

import logging

import pytest
import torch

from dsv3serve.engine.gemm_log import log_gemm_backends
from dsv3serve.kernels import deepgemm
from dsv3serve.kernels.fp8_gemm import fp8_block_gemm, fp8_block_gemm_deepgemm
from dsv3serve.kernels.fp8_quant import quant_per_token_group_fp8
from dsv3serve.kernels.fp8_ref import fp8_block_linear_ref, quant_weight_block
from dsv3serve.kernels.gemm_table import parse_table
from dsv3serve.plan.cli import model_config

pytestmark = pytest.mark.gpu
RTOL = 2e-2
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module", autouse=True)
def _deepgemm_usable() -> None:
    pytest.importorskip("deep_gemm")
    status = deepgemm.deepgemm_status("cuda", 0)
    if not status.usable:
        pytest.fail(f"deep_gemm imports but dsv3serve refuses it: {status.reason}")


def _weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w, ws = quant_weight_block(torch.randn(n, k, device="cuda") * 0.02)
    return w, ws


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 2112, 7168), (7, 7168, 16384), (64, 24576, 1536), (1000, 32768, 512),
     (4096, 18432, 7168), (2048, 7168, 18432)],
)  # fmt: skip
def test_deepseek_shapes_match_the_reference(m: int, n: int, k: int) -> None:
    torch.manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w, ws = _weight(n, k)
    y = fp8_block_gemm(x, w, ws, backend="deepgemm")
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, fp8_block_linear_ref(x, w, ws)) < RTOL


def test_replays_in_a_cuda_graph() -> None:
    x = torch.randn(256, 7168, device="cuda", dtype=torch.bfloat16)
    w, ws = _weight(2048, 7168)
    xq, xs = quant_per_token_group_fp8(x, m_major_scales=True)
    eager = fp8_block_gemm_deepgemm(xq, xs, w, ws)  # JIT outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_block_gemm_deepgemm(xq, xs, w, ws)
    x.copy_(torch.randn_like(x))
    xq2, xs2 = quant_per_token_group_fp8(x, m_major_scales=True)
    xq.copy_(xq2)
    xs.copy_(xs2)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, fp8_block_gemm_deepgemm(xq, xs, w, ws)) < 1e-6
    assert not torch.equal(out, eager)


def test_startup_log_names_deepgemm_where_its_table_wins(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    point = {"deepgemm_us": 1.0, "baseline": "cublas", "baseline_us": 2.0}
    table = parse_table("x", {"dense": {"N=7168,K=16384": {"1024": point, "8192": point}}})
    monkeypatch.setattr(deepgemm, "table_for", lambda device: table)
    with caplog.at_level(logging.INFO, logger="dsv3serve.engine.gemm_log"):
        log_gemm_backends(model_config("deepseek-v3"), None, CUDA, torch.bfloat16, True, 8192)
    o_proj = next(s for s in caplog.text.splitlines() if "self_attn.o_proj" in s)
    assert o_proj.endswith("cublas M 64-1023, deepgemm M 1024-8192"), caplog.text
    assert "DeepGEMM passed its self-check" in caplog.text
