"""FakeDeepGemmCPU: stand-ins for the ``deep_gemm`` module, which cannot be installed here.

DeepGEMM has no official wheel and needs an SM90 GPU, so the DeepGEMM backend's selection is
checked on the CPU with three fakes injected as ``sys.modules["deep_gemm"]``: one whose
``fp8_gemm_nt`` computes the right result in torch from the documented layouts (and asserts
them), one that writes garbage, and one that raises like a failed JIT compile.
"""

from __future__ import annotations

import types
from typing import Literal

import torch

from dsv3serve.kernels.fp8_ref import dequant_per_token_group, dequant_weight_block

FakeKind = Literal["correct", "garbage", "raises"]


def _check_layout(a: tuple, b: tuple, d: torch.Tensor) -> None:
    (x, xs), (w, ws) = a, b
    m, k = x.shape
    n = w.shape[0]
    assert x.dtype == w.dtype == torch.float8_e4m3fn, "DeepGEMM takes e4m3 operands"
    assert xs.shape == (m, -(-k // 128)) and xs.dtype == torch.float32, "x scales [M, K/128]"
    assert ws.shape == (-(-n // 128), -(-k // 128)) and ws.dtype == torch.float32
    assert d.shape == (m, n) and d.dtype == torch.bfloat16 and d.is_contiguous()


def make_fake_deep_gemm(kind: FakeKind) -> types.ModuleType:
    """A module named ``deep_gemm`` whose ``fp8_gemm_nt(a, b, d, c=None, ...)`` is ``kind``."""

    def fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
        _check_layout(a, b, d)
        if kind == "raises":
            raise RuntimeError("Assertion error (csrc/jit/compiler.hpp): NVCC failed")
        if kind == "garbage":
            d.copy_(torch.randn(d.shape))
            return
        x = dequant_per_token_group(*a)
        d.copy_(x @ dequant_weight_block(*b).t())

    module = types.ModuleType("deep_gemm")
    module.fp8_gemm_nt = fp8_gemm_nt  # type: ignore[attr-defined]
    return module
