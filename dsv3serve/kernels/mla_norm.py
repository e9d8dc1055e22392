"""The MLA down-projection's norms in one kernel: RMSNorm of the query part (with the FP8
1x128 quantisation ``q_b_proj`` reads), RMSNorm of the KV latent and the rope key passed
through; a Triton kernel and its torch reference.

The packed ``q_a_proj`` + ``kv_a_proj_with_mqa`` GEMM gives, per token, ``[q_a (Q) | c_kv (R)
| k_pe (P)]`` (DeepSeek-V3: Q 1536, R 512, P 64). One program per token row computes:

- ``q = weight_q * bf16(q_a * rsqrt(mean(q_a**2) + eps))`` (``q_a_layernorm``, the arithmetic
  of :func:`dsv3serve.kernels.norm_quant.rms_norm_ref`); written as bf16 [T, Q], or, with
  ``quantize``, as e4m3 values [T, Q] and float32 scales [T, ceil(Q/128)] laid out M-major
  (strides ``(1, T)``), the layout :func:`~dsv3serve.kernels.fp8_gemm.fp8_block_gemm_quantized`
  takes; ``scale = max(amax, 1e-10) * fl32(1/448)`` as the fused add + norm kernel;
- ``latent = [kv_a_layernorm(c_kv) (R) | k_pe (P)]`` bf16 [T, R + P], contiguous: the cache
  row before RoPE (:mod:`dsv3serve.kernels.rope_kv` rotates the rope part as it writes it).

It replaces the two norms' elementwise ops and reductions, the split and the quantisation
kernel of ``q_b_proj`` with one read of the GEMM output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsv3serve.kernels.fp8_quant import HAS_TRITON, SCALE_EPS, JitKernel
from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, FP8_MAX, quant_per_token_group
from dsv3serve.kernels.norm_quant import rms_norm_ref, rms_normed, store_fp8_groups

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # CPU-only installs: only the reference runs
    triton = tl = None


def mla_kernels_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the MLA fusion kernels (this module's and :mod:`dsv3serve.kernels.rope_kv`)
    run for activations of ``dtype`` on ``device``: bf16 on CUDA with Triton. Elsewhere (CPU,
    float32) the model keeps its reference ops."""
    return HAS_TRITON and device.type == "cuda" and dtype == torch.bfloat16


class QKVNormOut(NamedTuple):
    """What :func:`qkv_a_rmsnorm` returns (layouts in the module docstring)."""

    q: torch.Tensor  # [T, Q] e4m3 with quantize, else bf16 (the normed q_a)
    scale: torch.Tensor  # [T, ceil(Q/128)] float32, strides (1, T); [T, 0] unquantised
    latent: torch.Tensor  # [T, R + P] bf16: normed c_kv | k_pe as it came (no RoPE yet)


def _qkv_norm_body(
    qa_ptr, kva_ptr, qw_ptr, kvw_ptr, q_ptr, qs_ptr, lat_ptr, T, Q, R, P,
    stride_qa, stride_kva, eps_q, eps_kv,
    QUANT: tl.constexpr, QGROUPS: tl.constexpr, GROUP: tl.constexpr, RB: tl.constexpr,
    PB: tl.constexpr, QMAX: tl.constexpr, SEPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, QGROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < Q
    x = tl.load(qa_ptr + row * stride_qa + cols, mask=mask, other=0.0).to(tl.float32)
    y = rms_normed(x, tl.sum(tl.sum(x * x, axis=1), axis=0), qw_ptr, cols, mask, Q, eps_q)
    if QUANT:
        s_offs, smask = row + groups * T, groups < tl.cdiv(Q, GROUP)
        store_fp8_groups(y, q_ptr, row * Q + cols, qs_ptr, s_offs, mask, smask, QMAX, SEPS)
    else:
        tl.store(q_ptr + row * Q + cols, y, mask=mask)
    rc = tl.arange(0, RB)
    rmask = rc < R
    c = tl.load(kva_ptr + row * stride_kva + rc, mask=rmask, other=0.0).to(tl.float32)
    lat = lat_ptr + row * (R + P)
    c = rms_normed(c, tl.sum(c * c, axis=0), kvw_ptr, rc, rmask, R, eps_kv)
    tl.store(lat + rc, c, mask=rmask)
    pc = tl.arange(0, PB)
    pe = tl.load(kva_ptr + row * stride_kva + R + pc, mask=pc < P, other=0.0)
    tl.store(lat + R + pc, pe, mask=pc < P)


_qkv_norm_kernel: JitKernel = triton.jit(_qkv_norm_body) if HAS_TRITON else None


def _check(q_a: torch.Tensor, kv_a: torch.Tensor, q_w: torch.Tensor, kv_w: torch.Tensor) -> None:
    t, q_dim = q_a.shape
    assert kv_a.dim() == 2 and kv_a.shape[0] == t, f"expected kv_a [{t}, R+P], got {kv_a.shape}"
    assert q_a.stride(1) == 1 and kv_a.stride(1) == 1, "expected unit stride along the row"
    assert q_w.shape == (q_dim,), f"expected q norm weight [{q_dim}], got {list(q_w.shape)}"
    r = kv_w.shape[0]
    assert kv_a.shape[1] > r, f"expected kv_a wider than the latent {r}, got {kv_a.shape[1]}"
    dtypes = {q_a.dtype, kv_a.dtype, q_w.dtype, kv_w.dtype}
    assert len(dtypes) == 1, f"expected inputs and weights of one dtype, got {dtypes}"


def _q_outputs(
    t: int, q_dim: int, quantize: bool, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty q [t, q_dim] (e4m3 or ``like``'s dtype) and M-major scales [t, groups or 0]."""
    dtype = FP8_DTYPE if quantize else like.dtype
    groups = -(-q_dim // BLOCK) if quantize else 0
    q = torch.empty((t, q_dim), dtype=dtype, device=like.device)
    return q, torch.empty((groups, t), dtype=torch.float32, device=like.device).t()


def qkv_a_rmsnorm_triton(
    q_a: torch.Tensor,
    kv_a: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    eps_q: float,
    eps_kv: float,
    quantize: bool,
) -> QKVNormOut:
    """The Triton kernel (any device Triton runs on, the CPU interpreter included)."""
    _check(q_a, kv_a, q_weight, kv_weight)
    (t, q_dim), r = q_a.shape, kv_weight.shape[0]
    p = kv_a.shape[1] - r
    q, scale = _q_outputs(t, q_dim, quantize, q_a)
    latent = torch.empty((t, r + p), dtype=q_a.dtype, device=q_a.device)
    if t > 0:
        groups = triton.next_power_of_2(-(-q_dim // BLOCK))
        _qkv_norm_kernel[(t,)](
            q_a, kv_a, q_weight, kv_weight, q, scale, latent, t, q_dim, r, p,
            q_a.stride(0), kv_a.stride(0), eps_q, eps_kv,
            QUANT=quantize, QGROUPS=groups, GROUP=BLOCK, RB=triton.next_power_of_2(r),
            PB=triton.next_power_of_2(p), QMAX=FP8_MAX, SEPS=SCALE_EPS,
            num_warps=min(8, max(4, groups // 2)),
        )  # fmt: skip
    return QKVNormOut(q, scale, latent)


def qkv_a_rmsnorm_ref(
    q_a: torch.Tensor,
    kv_a: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    eps_q: float,
    eps_kv: float,
    quantize: bool,
) -> QKVNormOut:
    """The same outputs from the model's reference ops: the two RMSNorms
    (:func:`rms_norm_ref`), the concatenation and the 1x128 quantisation reference."""
    _check(q_a, kv_a, q_weight, kv_weight)
    r = kv_weight.shape[0]
    y = rms_norm_ref(q_a, q_weight, eps_q)
    latent = torch.cat([rms_norm_ref(kv_a[:, :r], kv_weight, eps_kv), kv_a[:, r:]], -1)
    if not quantize:
        return QKVNormOut(y, _q_outputs(q_a.shape[0], 0, True, q_a)[1], latent)
    q, scale = quant_per_token_group(y)
    return QKVNormOut(q, scale.t().contiguous().t(), latent)


@torch.compiler.disable  # opaque to torch.compile, as the other Triton kernels
def qkv_a_rmsnorm(
    q_a: torch.Tensor,
    kv_a: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    eps_q: float,
    eps_kv: float,
    quantize: bool,
) -> QKVNormOut:
    """q_a_layernorm (+ FP8 quantisation) and kv_a_layernorm of one down-projection output.

    ``q_a`` [T, Q] and ``kv_a`` [T, R + P] bf16, unit stride along the row (views of the
    packed GEMM's [T, Q + R + P] output, or two tensors); ``q_weight`` [Q], ``kv_weight``
    [R] the norms' weights. The kernel on CUDA with Triton, else the torch reference.
    Layouts and rounding: see the module docstring.
    """
    if HAS_TRITON and q_a.is_cuda:
        return qkv_a_rmsnorm_triton(q_a, kv_a, q_weight, kv_weight, eps_q, eps_kv, quantize)
    return qkv_a_rmsnorm_ref(q_a, kv_a, q_weight, kv_weight, eps_q, eps_kv, quantize)
