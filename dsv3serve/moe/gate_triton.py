"""DeepSeek-V3 router top-k as one Triton kernel: the fused :func:`moe.gate.grouped_topk`."""

from __future__ import annotations

import torch

from dsv3serve.kernels.fp8_quant import HAS_TRITON
from dsv3serve.moe.gate import grouped_topk

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice


def _sigmoid_body(x, LIBDEVICE_EXP: tl.constexpr):
    """float32 sigmoid with an IEEE division (``tl`` division is approximate on CUDA)."""
    if LIBDEVICE_EXP:  # noqa: SIM108 (a statement keeps the untaken branch uncompiled)
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + e)


def _grouped_topk_body(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_lt, stride_wt, stride_it, scaling,
    E: tl.constexpr, N_GROUP: tl.constexpr, GS: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, G_PAD: tl.constexpr, GS_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
):  # fmt: skip
    """One token per program: biased grouped top-k over ``E`` experts in ``N_GROUP`` groups of
    ``GS`` (``*_PAD``: the next powers of two).

    logits [T, E] (any float dtype, read as float32), bias [E] float32; writes weights [T, TOP_K]
    float32 and ids [T, TOP_K] (the output's integer dtype), best biased score first. The group
    score is the sum of a group's two best biased scores; experts outside the ``TOPK_GROUP``
    best groups are excluded; the weights are the unbiased sigmoid scores, renormalised to sum 1
    when ``RENORM``, times ``scaling``. Ties go to the lower index. The sigmoid is computed as
    CUDA's torch does, ``1 / (1 + expf(-x))`` with an IEEE division, and with
    ``LIBDEVICE_EXP`` the same ``expf`` (the interpreter has no libdevice), so the selection
    matches the reference's bit for bit up to exact ties.
    """
    t = tl.program_id(0).to(tl.int64)
    row = logits_ptr + t * stride_lt
    # group scores on a [G_PAD, GS_PAD] view; padding is -inf
    g = tl.arange(0, G_PAD)
    j = tl.arange(0, GS_PAD)
    ok2 = (g[:, None] < N_GROUP) & (j[None, :] < GS)
    e2 = g[:, None] * GS + j[None, :]
    x2 = tl.load(row + e2, mask=ok2, other=0.0).to(tl.float32)
    b2 = tl.load(bias_ptr + e2, mask=ok2, other=0.0).to(tl.float32)
    biased2 = tl.where(ok2, _sigmoid(x2, LIBDEVICE_EXP) + b2, float("-inf"))
    best = tl.argmax(biased2, axis=1)
    second = tl.max(tl.where(j[None, :] == best[:, None], float("-inf"), biased2), axis=1)
    group_score = tl.max(biased2, axis=1) + second
    # the TOPK_GROUP best groups, as a mask over experts
    offs = tl.arange(0, E_PAD)
    keep = offs < 0
    for _ in tl.static_range(TOPK_GROUP):
        gi = tl.argmax(group_score, axis=0)
        keep = keep | ((offs // GS) == gi)
        group_score = tl.where(g == gi, float("-inf"), group_score)
    ok = offs < E
    x = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
    scores = _sigmoid(x, LIBDEVICE_EXP)
    bias = tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    cand = tl.where(keep & ok, scores + bias, float("-inf"))
    # TOP_K rounds of argmax
    kk = tl.arange(0, K_PAD)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        ei = tl.argmax(cand, axis=0)
        ids = tl.where(kk == i, ei, ids)
        wi = tl.sum(tl.where(offs == ei, scores, 0.0), axis=0)
        weights = tl.where(kk == i, wi, weights)
        cand = tl.where(offs == ei, float("-inf"), cand)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    out_ok = kk < TOP_K
    tl.store(weights_ptr + t * stride_wt + kk, weights * scaling, mask=out_ok)
    tl.store(ids_ptr + t * stride_it + kk, ids.to(ids_ptr.dtype.element_ty), mask=out_ok)


if HAS_TRITON:
    _sigmoid = triton.jit(_sigmoid_body)
    _grouped_topk_kernel = triton.jit(_grouped_topk_body)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@torch.compiler.disable  # opaque to torch.compile: Inductor fails to re-emit our Triton kernels
def grouped_topk_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    renormalize: bool = True,
    ids_dtype: torch.dtype = torch.int64,
    libdevice_exp: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; same arguments and results as :func:`grouped_topk`.

    router_logits [T, E] (last dim contiguous), correction_bias [E]. Returns
    ``(topk_weights [T, top_k] float32, topk_ids [T, top_k] ids_dtype)``. ``libdevice_exp``
    (default: on CUDA tensors) uses CUDA's ``expf`` as torch does.
    """
    t, e = router_logits.shape
    assert router_logits.stride(1) == 1, "expected router logits with unit stride along experts"
    assert correction_bias.shape == (e,), f"expected bias [{e}], got {list(correction_bias.shape)}"
    assert e % n_group == 0 and e // n_group >= 2, f"expected E={e} split in groups of >= 2"
    assert top_k <= topk_group * (e // n_group), f"top_k={top_k} exceeds the selected experts"
    dev = router_logits.device
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=ids_dtype, device=dev)
    if t == 0:
        return weights, ids
    use_libdevice = router_logits.is_cuda if libdevice_exp is None else libdevice_exp
    _grouped_topk_kernel[(t,)](
        router_logits, correction_bias.contiguous(), weights, ids,
        router_logits.stride(0), weights.stride(0), ids.stride(0), float(routed_scaling_factor),
        E=e, N_GROUP=n_group, GS=e // n_group, TOPK_GROUP=topk_group, TOP_K=top_k, E_PAD=_pow2(e),
        G_PAD=_pow2(n_group), GS_PAD=_pow2(e // n_group), K_PAD=_pow2(top_k),
        RENORM=renormalize, LIBDEVICE_EXP=use_libdevice, num_warps=1 if e <= 512 else 4,
    )  # fmt: skip
    return weights, ids


def grouped_topk_fused(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA tensors with Triton installed, else the torch reference."""
    fn = grouped_topk_triton if HAS_TRITON and router_logits.is_cuda else grouped_topk
    return fn(
        router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
        renormalize,
    )  # fmt: skip
