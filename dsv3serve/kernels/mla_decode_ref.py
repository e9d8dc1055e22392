"""Torch oracle of the MLA decode kernels: float32 attention over the dequantised paged cache,
reading the pool through the same :class:`~dsv3serve.kernels.mla_decode.MLADecodeMeta`."""

from __future__ import annotations

import torch

from dsv3serve.kernels.mla_decode import MLADecodeMeta

FP8_MAX = 448.0


def quantize_rows_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as ``mla_decode_fp8`` rounds q: e4m3 with one scale per last-dim row
    (``max|row| / 448``), returned dequantised in float32."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    q8 = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q8.float() * scale


def _slots(meta: MLADecodeMeta, t: int) -> torch.Tensor:
    """Cache slots of query token ``t``'s ``kv_len[t]`` tokens, in order."""
    n, ps = int(meta.kv_len[t]), meta.page_size
    first = int(meta.page_start[t])
    pages = meta.kv_indices[first : first + -(-n // ps)].long()
    rows = torch.arange(ps, device=pages.device)
    return (pages[:, None] * ps + rows).flatten()[:n]


def mla_decode_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_scale: torch.Tensor | None,
    meta: MLADecodeMeta,
    sm_scale: float,
    quantize_q: bool = False,
) -> torch.Tensor:
    """float32 [T, H, R]: ``softmax((q . kv^T) * sm_scale) @ kv[:, :R]`` per query token,
    ``kv`` the float32 rows (times their scale for an e4m3 buffer).

    ``quantize_q``: round q first as the FP8 kernel does (isolates the error of its P
    rounding and of the kernel itself from the error of q's rounding).
    """
    t, h, rank = q_nope.shape
    rows = kv_buffer.view(-1, kv_buffer.shape[-1])
    scales = None if kv_scale is None else kv_scale.reshape(-1)
    q = torch.cat([q_nope.float(), q_pe.float()], -1)
    if quantize_q:
        q = quantize_rows_e4m3(q)
    out = torch.zeros(t, h, rank, dtype=torch.float32, device=q_nope.device)
    for i in range(t):
        slots = _slots(meta, i)
        if slots.numel() == 0:
            continue
        kv = rows[slots].float()
        if scales is not None:
            kv = kv * scales[slots][:, None]
        probs = (q[i] @ kv.t() * sm_scale).softmax(-1)
        out[i] = probs @ kv[:, :rank]
    return out
