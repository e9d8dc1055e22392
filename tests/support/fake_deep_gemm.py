"""FakeDeepGemmCPU: stand-ins for the ``deep_gemm`` module, which cannot be installed here.

DeepGEMM has no wheel for our torch and needs an SM90 GPU, so the DeepGEMM backend's
selection and the grouped-GEMM glue are checked on the CPU with fakes injected as
``sys.modules["deep_gemm"]`` (or passed where a module is an argument): one whose GEMMs
compute the right result in torch from the documented layouts (and assert them, including
the contiguous layout's 128-row expert blocks and the masked layout's counts), one that
writes garbage, and one that raises like a failed JIT compile.
"""

from __future__ import annotations

import types
from typing import Literal

import torch

from dsv3serve.kernels.fp8_ref import dequant_per_token_group, dequant_weight_block

FakeKind = Literal["correct", "garbage", "raises"]
M_ALIGN = 128


def _check_layout(a: tuple, b: tuple, d: torch.Tensor) -> None:
    (x, xs), (w, ws) = a, b
    m, k = x.shape
    n = w.shape[0]
    assert x.dtype == w.dtype == torch.float8_e4m3fn, "DeepGEMM takes e4m3 operands"
    assert xs.shape == (m, -(-k // 128)) and xs.dtype == torch.float32, "x scales [M, K/128]"
    assert ws.shape == (-(-n // 128), -(-k // 128)) and ws.dtype == torch.float32
    assert d.shape == (m, n) and d.dtype == torch.bfloat16 and d.is_contiguous()


def _gemm(a: tuple, b: tuple) -> torch.Tensor:
    return dequant_per_token_group(*a) @ dequant_weight_block(*b).t()


def _check_blocks(m_indices: torch.Tensor, rows: int, groups: int) -> None:
    assert m_indices.dtype == torch.int32 and m_indices.shape == (rows,), "m_indices [M] int32"
    assert rows % M_ALIGN == 0, "the contiguous layout's M is a multiple of 128"
    blocks = m_indices.view(-1, M_ALIGN)
    assert bool((blocks == blocks[:, :1]).all()), "one group (or -1) per 128-row block"
    assert bool((m_indices < groups).all()), "group index past the weights"


def _contiguous(a, b, d, m_indices) -> None:  # noqa: ANN001
    (x, xs), (w, ws) = a, b
    _check_blocks(m_indices, x.shape[0], w.shape[0])
    for g in range(w.shape[0]):
        rows = (m_indices == g).nonzero().flatten()
        if rows.numel():
            _check_layout((x[rows], xs[rows]), (w[g], ws[g]), d[rows].contiguous())
            d[rows] = _gemm((x[rows], xs[rows]), (w[g], ws[g])).to(d.dtype)


def _masked(a, b, d, masked_m, expected_m) -> None:  # noqa: ANN001
    (x, xs), (w, ws) = a, b
    e = x.shape[0]
    assert masked_m.dtype == torch.int32 and masked_m.shape == (e,), "masked_m [G] int32"
    assert expected_m > 0 and d.shape[:2] == x.shape[:2] and d.dtype == torch.bfloat16
    for g, n in enumerate(masked_m.tolist()):
        assert 0 <= n <= x.shape[1], f"count {n} past the {x.shape[1]} rows of group {g}"
        if n:
            d[g, :n] = _gemm((x[g, :n], xs[g, :n]), (w[g], ws[g])).to(d.dtype)


def make_fake_deep_gemm(kind: FakeKind) -> types.ModuleType:
    """A module named ``deep_gemm`` whose GEMMs (``fp8_gemm_nt``, the m-grouped contiguous
    and masked ones) behave as ``kind``."""

    def fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
        _check_layout(a, b, d)
        _act(kind, d, lambda: d.copy_(_gemm(a, b)))

    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, recipe=None, **kw):
        _act(kind, d, lambda: _contiguous(a, b, d, m_indices))

    def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, recipe=None, **kw):
        _act(kind, d, lambda: _masked(a, b, d, masked_m, expected_m))

    module = types.ModuleType("deep_gemm")
    module.fp8_gemm_nt = fp8_gemm_nt  # type: ignore[attr-defined]
    module.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous  # type: ignore[attr-defined]
    module.m_grouped_fp8_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked  # type: ignore[attr-defined]
    module.get_mk_alignment_for_contiguous_layout = lambda: M_ALIGN  # type: ignore[attr-defined]
    return module


def _act(kind: FakeKind, d: torch.Tensor, compute) -> None:  # noqa: ANN001
    if kind == "raises":
        raise RuntimeError("Assertion error (csrc/jit/compiler.hpp): NVCC failed")
    if kind == "garbage":
        d.copy_(torch.randn(d.shape))
        return
    compute()
