"""The DeepGEMM grouped-GEMM MoE (dsv3serve/moe/deepgemm_moe.py) with the real DeepGEMM at
DeepSeek-V3's widths (H 7168, I 2048): contiguous against ``TorchRefMoE``, masked against
``masked_moe_ref`` with NaN padding rows, and the masked pair replayed in a CUDA graph.
Skipped without CUDA (conftest) or without ``deep_gemm``.

Tolerance: 2e-2 relative (both round the intermediate through e4m3 per 128 channels; one
flip moves a value by 1/16).
"""

from __future__ import annotations

import pytest
import torch

from dsv3serve.kernels import deepgemm
from dsv3serve.kernels.fp8_quant import quant_per_token_group_fp8
from dsv3serve.moe.deepgemm_moe import deepgemm_moe_contiguous, deepgemm_moe_masked
from dsv3serve.moe.experts import random_experts
from dsv3serve.moe.masked_moe import masked_moe_ref
from dsv3serve.moe.ref import TorchRefMoE

pytestmark = pytest.mark.gpu
RTOL = 2e-2
H, INTER = 7168, 2048


@pytest.fixture(scope="module")
def dg():
    pytest.importorskip("deep_gemm")
    status = deepgemm.deepgemm_status("cuda", 0)
    if not status.usable:
        pytest.fail(f"deep_gemm imports but dsv3serve refuses it: {status.reason}")
    return deepgemm.deepgemm_module()


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize(("t", "e", "skip_remote"), [(300, 16, False), (1024, 32, True)])
def test_contiguous_matches_the_reference(dg, t: int, e: int, skip_remote: bool) -> None:  # noqa: ANN001
    torch.manual_seed(t)
    ex = random_experts(e, H, INTER, True, torch.bfloat16, "cuda")
    x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(t, e, device="cuda").topk(8, dim=1).indices.int()
    if skip_remote:  # an EP rank: a quarter of the choices live elsewhere
        ids = torch.where(ids % 4 == 0, -1, ids)
    w = torch.rand(t, 8, device="cuda").where(ids >= 0, torch.zeros((), device="cuda"))
    y = deepgemm_moe_contiguous(dg, x, w, ids, ex.stack(False))
    assert _rel(y, TorchRefMoE(act_quant=True).forward(x, w, ids, ex)) < RTOL


def _masked_case(counts: list[int], m: int, seed: int):
    torch.manual_seed(seed)
    ex = random_experts(len(counts), H, INTER, True, torch.bfloat16, "cuda")
    xq, xs = quant_per_token_group_fp8(torch.randn(len(counts) * m, H, device="cuda"))
    xq, xs = xq.view(len(counts), m, H), xs.view(len(counts), m, -1).clone()
    for e, n in enumerate(counts):
        xs[e, n:] = float("nan")
    return ex.stack(False), xq, xs, torch.tensor(counts, dtype=torch.int32, device="cuda")


def _valid(y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return y[torch.arange(y.shape[1], device=y.device)[None, :] < counts[:, None]]


def test_masked_matches_the_reference(dg) -> None:  # noqa: ANN001
    stack, xq, xs, c = _masked_case([0, 1, 37, 256, 128, 5, 200, 64], 256, seed=3)
    y = deepgemm_moe_masked(dg, xq, c, stack, expected_m=86, x_scale=xs)
    got, ref = _valid(y, c), _valid(masked_moe_ref(xq, c, stack, x_scale=xs), c)
    assert bool(torch.isfinite(got).all()), "padding leaked into a valid row"
    assert _rel(got, ref) < RTOL


def test_masked_replays_in_a_cuda_graph(dg) -> None:  # noqa: ANN001
    stack, xq, xs, c = _masked_case([3, 0, 16, 9], 32, seed=7)
    out = torch.empty((4, 32, H), dtype=torch.bfloat16, device="cuda")
    deepgemm_moe_masked(dg, xq, c, stack, 8, x_scale=xs, out=out)  # JIT outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        deepgemm_moe_masked(dg, xq, c, stack, 8, x_scale=xs, out=out)
    c.copy_(torch.tensor([32, 7, 0, 1], dtype=torch.int32))
    new_q, new_s = quant_per_token_group_fp8(torch.randn(4 * 32, H, device="cuda"))
    xq.copy_(new_q.view_as(xq))
    xs.copy_(new_s.view_as(xs))
    graph.replay()
    torch.cuda.synchronize()
    ref = _valid(masked_moe_ref(xq, c, stack, x_scale=xs), c)
    assert _rel(_valid(out, c), ref) < RTOL
