"""RoPE applied inside the MLA KV-cache write, with the query's rope part rotated in the same
launch: a Triton kernel and its torch reference.

Inputs, per new token ``t`` (T tokens; DeepSeek-V3: R 512, P 64, H 128 heads):

- ``latent`` [T, R + P] bf16, contiguous: ``[kv_a_layernorm(c_kv) | k_pe]`` with ``k_pe``
  not yet rotated (what :func:`dsv3serve.kernels.mla_norm.qkv_a_rmsnorm` writes);
- ``cos``, ``sin`` [T, P/2] float32, contiguous: the step's YaRN rotary factors at each
  token's position (:meth:`dsv3serve.layers.rotary.RotaryEmbedding.cos_sin`, once per step);
- ``slots`` [T] int32/int64: the cache row of each token (``page * page_size + offset``);
- ``kv_buffer`` [pages, page_size, R + P] (bf16, float32 or e4m3) with, for e4m3, either
  ``scale_buffer`` [pages, page_size] float32 (per-token scales) or ``layer_inv_scale`` [1]
  float32 (a ``"layer"`` pool's ``1 / s``) (:class:`dsv3serve.kvcache.pool.MLAKVPool`'s
  layouts, all contiguous);
- ``q_pe`` [T, H, P] bf16, any token and head strides, unit stride along P (a view of
  ``q_b_proj``'s output), or None.

RoPE rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` in place:
``(e, o) -> (e*c - o*s, o*c + e*s)`` in float32, rounded to bf16 (DeepSeek's layout, as
:class:`~dsv3serve.layers.rotary.RotaryEmbedding`). Each cache row becomes ``[c_kv |
rope(k_pe)]``; in an e4m3 pool it is stored as the pool does it: ``s = max(amax *
fl32(1/448), 1e-12)`` over the row's 576 bf16 values, ``e4m3(clamp(x / s, +-448))`` (an IEEE
division), and ``s`` in the scale buffer; in a ``"layer"`` pool as
``e4m3(clamp(x * inv, +-448))`` with the layer's ``inv = 1 / s``. Returns the rotated
``q_pe`` as a new contiguous [T, H, P] tensor.

It replaces the two rotations (each a handful of elementwise kernels), the concatenation
and the cache's scatter (and, for e4m3, its amax and quantisation) with one launch.
"""

from __future__ import annotations

import torch

from dsv3serve.kernels.fp8_quant import HAS_TRITON, JitKernel

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # CPU-only installs: only the reference runs
    triton = tl = None

CACHE_FP8_MAX = 448.0  # the pool's e4m3 range
CACHE_MIN_SCALE = 1e-12  # the pool's floor on a row's scale
HEADS_PER_PROGRAM = 16


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` [T, ..., D]; ``cos``/``sin`` [T, D/2] broadcast over
    the middle dims; float32 math, result in ``x.dtype`` (the model's rotary op)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1)
    return out.flatten(-2).to(x.dtype)


def _rope_pairs_body(base, cs, sn, pairs, mask, out_ty: tl.constexpr):
    """Rotated (even, odd) halves of the interleaved pairs at ``base + 2 * pairs``."""
    e = tl.load(base + 2 * pairs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(base + 2 * pairs + 1, mask=mask, other=0.0).to(tl.float32)
    return (e * cs - o * sn).to(out_ty), (o * cs + e * sn).to(out_ty)


def _write_row_body(lat, cs, sn, kv_row, s_ptr, slot, R, P,
                    RB: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr,
                    LAYER: tl.constexpr, QMAX: tl.constexpr,
                    MIN_SCALE: tl.constexpr):  # fmt: skip
    """One cache row: the latent as it is, the rope key rotated; e4m3 with its scale
    (``LAYER``: ``s_ptr`` holds the layer's inverse scale, nothing is stored there)."""
    rc, half = tl.arange(0, RB), tl.arange(0, HALF)
    rmask, pmask = rc < R, half < P // 2
    c = tl.load(lat + rc, mask=rmask, other=0.0)
    re, ro = _rope_pairs(lat + R, cs, sn, half, pmask, lat.dtype.element_ty)
    if FP8 and LAYER:
        inv = tl.load(s_ptr)
        c = tl.minimum(tl.maximum(c.to(tl.float32) * inv, -QMAX), QMAX)
        re = tl.minimum(tl.maximum(re.to(tl.float32) * inv, -QMAX), QMAX)
        ro = tl.minimum(tl.maximum(ro.to(tl.float32) * inv, -QMAX), QMAX)
    elif FP8:
        amax = tl.max(tl.abs(c.to(tl.float32)), axis=0)
        amax = tl.maximum(amax, tl.max(tl.maximum(tl.abs(re), tl.abs(ro)).to(tl.float32), 0))
        s = tl.maximum(amax * (1.0 / QMAX), MIN_SCALE)  # the pool's multiply, not a division
        c = tl.minimum(tl.maximum(tl.math.div_rn(c.to(tl.float32), s), -QMAX), QMAX)
        re = tl.minimum(tl.maximum(tl.math.div_rn(re.to(tl.float32), s), -QMAX), QMAX)
        ro = tl.minimum(tl.maximum(tl.math.div_rn(ro.to(tl.float32), s), -QMAX), QMAX)
        tl.store(s_ptr + slot, s)
    ty = kv_row.dtype.element_ty
    tl.store(kv_row + rc, c.to(ty), mask=rmask)
    tl.store(kv_row + R + 2 * half, re.to(ty), mask=pmask)
    tl.store(kv_row + R + 2 * half + 1, ro.to(ty), mask=pmask)


def _rope_kv_body(
    lat_ptr, cos_ptr, sin_ptr, slot_ptr, kv_ptr, s_ptr, q_ptr, qo_ptr, R, P, H,
    stride_qt, stride_qh,
    RB: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr, FP8: tl.constexpr,
    LAYER: tl.constexpr, HAS_Q: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):  # fmt: skip
    """Grid (T, head blocks): program (t, 0) writes token t's cache row; program (t, b)
    rotates heads [b*HB, (b+1)*HB) of its q_pe."""
    tok, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    half = tl.arange(0, HALF)
    pmask = half < P // 2
    cs = tl.load(cos_ptr + tok * (P // 2) + half, mask=pmask, other=0.0)
    sn = tl.load(sin_ptr + tok * (P // 2) + half, mask=pmask, other=0.0)
    if hb == 0:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        kv_row = kv_ptr + slot * (R + P)
        _write_row(lat_ptr + tok * (R + P), cs, sn, kv_row, s_ptr, slot, R, P,
                   RB, HALF, FP8, LAYER, QMAX, MIN_SCALE)  # fmt: skip
    if HAS_Q:
        heads = hb * HB + tl.arange(0, HB)
        mask = (heads < H)[:, None] & pmask[None, :]
        src = q_ptr + tok * stride_qt + heads[:, None].to(tl.int64) * stride_qh
        re, ro = _rope_pairs(src, cs[None, :], sn[None, :], half[None, :], mask,
                             qo_ptr.dtype.element_ty)  # fmt: skip
        dst = qo_ptr + (tok * H + heads[:, None]) * P + 2 * half[None, :]
        tl.store(dst, re, mask=mask)
        tl.store(dst + 1, ro, mask=mask)


_rope_pairs: JitKernel = triton.jit(_rope_pairs_body) if HAS_TRITON else None
_write_row: JitKernel = triton.jit(_write_row_body) if HAS_TRITON else None
_rope_kv_kernel: JitKernel = triton.jit(_rope_kv_body) if HAS_TRITON else None


def _check(
    latent: torch.Tensor,
    cos: torch.Tensor,
    slots: torch.Tensor,
    kv_buffer: torch.Tensor,
    scale_buffer: torch.Tensor | None,
    q_pe: torch.Tensor | None,
    layer_inv_scale: torch.Tensor | None,
) -> None:
    t, width = latent.shape
    assert latent.is_contiguous(), "expected a contiguous latent [T, R + P]"
    assert cos.shape[0] == t and cos.is_contiguous(), f"expected cos [{t}, P/2], got {cos.shape}"
    assert slots.shape == (t,), f"expected slots [{t}], got {list(slots.shape)}"
    assert kv_buffer.shape[-1] == width and kv_buffer.is_contiguous(), (
        f"expected a contiguous cache of rows {width} wide, got {list(kv_buffer.shape)}"
    )
    fp8 = kv_buffer.dtype == torch.float8_e4m3fn
    scaled = (scale_buffer is not None) + (layer_inv_scale is not None)
    assert scaled == int(fp8), (
        "expected exactly one of a scale buffer and a layer inverse scale for an e4m3 pool, "
        "neither for another"
    )
    if layer_inv_scale is not None:
        assert layer_inv_scale.shape == (1,) and layer_inv_scale.dtype == torch.float32, (
            f"expected a [1] float32 layer inverse scale, got {layer_inv_scale.dtype} "
            f"{list(layer_inv_scale.shape)}"
        )
    if q_pe is not None:
        p = cos.shape[1] * 2
        assert q_pe.dim() == 3 and q_pe.shape[0] == t and q_pe.shape[2] == p, (
            f"expected q_pe [{t}, H, {p}], got {list(q_pe.shape)}"
        )
        assert q_pe.stride(2) == 1, "expected q_pe with unit stride along its last dim"


def rope_kv_write_triton(
    latent: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    kv_buffer: torch.Tensor,
    scale_buffer: torch.Tensor | None,
    q_pe: torch.Tensor | None,
    layer_inv_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The Triton kernel (any device Triton runs on, the CPU interpreter included)."""
    _check(latent, cos, slots, kv_buffer, scale_buffer, q_pe, layer_inv_scale)
    t, width = latent.shape
    p = cos.shape[1] * 2
    heads = q_pe.shape[1] if q_pe is not None else 0
    q_out = (
        None if q_pe is None else torch.empty((t, heads, p), dtype=q_pe.dtype, device=q_pe.device)
    )
    if t == 0:
        return q_out
    hb = min(HEADS_PER_PROGRAM, triton.next_power_of_2(max(heads, 1)))
    grid = (t, max(1, -(-heads // hb)))
    q_in = q_pe if q_pe is not None else latent
    scales = next((s for s in (scale_buffer, layer_inv_scale) if s is not None), cos)
    _rope_kv_kernel[grid](
        latent, cos, sin, slots, kv_buffer, scales, q_in,
        q_out if q_out is not None else latent, width - p, p, heads,
        q_in.stride(0), q_in.stride(1) if q_pe is not None else 0,
        RB=triton.next_power_of_2(width - p), HALF=triton.next_power_of_2(p // 2), HB=hb,
        FP8=scales is not cos, LAYER=layer_inv_scale is not None, HAS_Q=q_pe is not None,
        QMAX=CACHE_FP8_MAX, MIN_SCALE=CACHE_MIN_SCALE, num_warps=4,
    )  # fmt: skip
    return q_out


def rope_kv_write_ref(
    latent: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    kv_buffer: torch.Tensor,
    scale_buffer: torch.Tensor | None,
    q_pe: torch.Tensor | None,
    layer_inv_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The same from reference ops: :func:`rope_ref` on both rope parts, the concatenation,
    and the pool's own write (``MLAKVPool.write``'s scatter and e4m3 quantisation)."""
    _check(latent, cos, slots, kv_buffer, scale_buffer, q_pe, layer_inv_scale)
    p = cos.shape[1] * 2
    r = latent.shape[1] - p
    rows = torch.cat([latent[:, :r], rope_ref(latent[:, r:], cos, sin)], -1)
    flat = kv_buffer.view(-1, latent.shape[1])
    if layer_inv_scale is not None:
        q = (rows.float() * layer_inv_scale[0]).clamp(-CACHE_FP8_MAX, CACHE_FP8_MAX)
        flat[slots] = q.to(flat.dtype)
    elif scale_buffer is None:
        flat[slots] = rows.to(flat.dtype)
    else:
        values = rows.float()
        scale = (values.abs().amax(dim=-1) * (1.0 / CACHE_FP8_MAX)).clamp_min(CACHE_MIN_SCALE)
        q = (values / scale[:, None]).clamp(-CACHE_FP8_MAX, CACHE_FP8_MAX)
        flat[slots] = q.to(flat.dtype)
        scale_buffer.view(-1)[slots] = scale
    return None if q_pe is None else rope_ref(q_pe, cos, sin).contiguous()


@torch.compiler.disable  # opaque to torch.compile, as the other Triton kernels
def rope_kv_write(
    latent: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    kv_buffer: torch.Tensor,
    scale_buffer: torch.Tensor | None,
    q_pe: torch.Tensor | None = None,
    layer_inv_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Write the new tokens' cache rows with RoPE applied to their rope key, and return
    ``q_pe`` rotated (None without one). The kernel on CUDA with Triton, else the reference.
    Shapes, layouts and rounding: see the module docstring."""
    args = (latent, cos, sin, slots, kv_buffer, scale_buffer, q_pe, layer_inv_scale)
    if HAS_TRITON and latent.is_cuda:
        return rope_kv_write_triton(*args)
    return rope_kv_write_ref(*args)
