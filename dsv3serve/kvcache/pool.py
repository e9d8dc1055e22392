"""Paged MLA latent KV cache on a torch device, and the bytes of one page (how many pages a
pool gets: :mod:`dsv3serve.kvcache.sizing`)."""

from __future__ import annotations

from typing import Literal

import torch

from dsv3serve.kvcache.allocator import pages_for_tokens

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_SCALES",
    "MLA_KV_DIM",
    "MLAKVPool",
    "bytes_per_page",
    "pages_for_tokens",
]

MLA_KV_DIM = 576  # kv_lora_rank 512 (latent) + qk_rope_head_dim 64 (rope key)
FP8_E4M3_MAX = 448.0
_STORAGE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float32)
_SCALE_BYTES = 4  # one float32 scale per token per layer (fp8 with per-token scales)
_MIN_SCALE = 1e-12
FP8Scales = Literal["token", "layer"]  # an fp8 pool's scale granularity (see MLAKVPool)
FP8_SCALES: tuple[FP8Scales, ...] = ("token", "layer")
DEFAULT_LAYER_SCALE = 1.0  # an fp8 "layer" pool's scale unless given (see MLAKVPool)


class MLAKVPool:
    """Per-layer paged cache of the MLA latent: one 576-value row per token.

    Layout, for each layer ``l``:

    - ``kv_buffer(l)``: ``[num_pages, page_size, kv_dim]`` of the storage ``dtype``. Row
      ``(page, offset)`` holds the token at slot ``page * page_size + offset``: values
      ``[0:512]`` are the compressed latent ``c_kv`` (after ``kv_a_layernorm``) and
      ``[512:576]`` the rotated rope key ``k_pe``.
    - fp8 (``torch.float8_e4m3fn``), our documented fp8 layout: the row stores
      ``q = x / s`` in e4m3, and ``scale_buffer(l)``, ``[num_pages, page_size]`` float32,
      stores ``s = max(|x|) * fl32(1/448)`` of that token's 576 values (a multiply, so
      every device and the fused RoPE write, ``kernels/rope_kv.py``, get the same bits;
      torch's CUDA division by a scalar multiplies by its reciprocal anyway), floored at
      1e-12; ``x ~= q.float() * s``.
      bf16 and float32 pools have no scale buffer.
    - fp8 with ``fp8_scales="layer"`` (the layout FlashMLA's dense FP8 kernel reads, which
      takes one per-tensor ``descale_k``): no scale buffer; one float32 scale ``s`` per
      layer, fixed when the pool is built (``layer_scale``, default 1.0: the unit scale
      SGLang's FlashMLA FP8 path and vLLM's ``k_scale`` default use for DeepSeek-V3 when the
      checkpoint carries no KV scales). A row stores ``e4m3(clamp(x * (1/s), +-448))``: a
      value beyond ``448 * s`` saturates at the largest e4m3 value instead of becoming NaN,
      and values below ``2**-9 * s`` round to zero. :meth:`layer_scale` is the
      ``descale_k`` tensor, :meth:`layer_inv_scale` the factor writes multiply by.

    ``read`` returns ``compute_dtype`` (default: bf16 for fp8 storage, else the storage
    dtype). Slots are not bounds-checked on the device (no host sync); the scheduler
    only hands out slots of allocated pages.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_dim: int = MLA_KV_DIM,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype | None = None,
        fp8_scales: FP8Scales = "token",
        layer_scale: float = DEFAULT_LAYER_SCALE,
    ) -> None:
        if dtype not in _STORAGE_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {_STORAGE_DTYPES}, got {dtype}")
        _check_fp8_scales(fp8_scales, layer_scale)
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.kv_dim, self.dtype = kv_dim, dtype
        # "" for bf16 / float32 pools
        self.fp8_scales: str = fp8_scales if dtype == torch.float8_e4m3fn else ""
        self.compute_dtype = compute_dtype or (torch.bfloat16 if self.is_fp8 else dtype)
        shape = (num_pages, page_size, kv_dim)
        self._kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.device = self._kv[0].device  # resolved: "cuda" becomes "cuda:<current>"
        self._scale = [
            torch.zeros(shape[:2], dtype=torch.float32, device=device)
            for _ in range(num_layers if self.token_scales else 0)
        ]
        layers = num_layers if self.fp8_scales == "layer" else 0
        f32 = torch.float32
        self._layer_scale = torch.full((layers,), layer_scale, dtype=f32, device=self.device)
        self._layer_inv = torch.full((layers,), 1.0 / layer_scale, dtype=f32, device=self.device)

    @property
    def is_fp8(self) -> bool:
        """Whether values are stored as e4m3 (with per-token or per-layer scales)."""
        return self.dtype == torch.float8_e4m3fn

    @property
    def token_scales(self) -> bool:
        """Whether the pool keeps a float32 scale per token (``scale_buffer``)."""
        return self.fp8_scales == "token"

    @property
    def num_slots(self) -> int:
        """Token slots per layer (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    @property
    def page_nbytes(self) -> int:
        """Bytes one page takes across all layers, per-token scales included."""
        return bytes_per_page(
            self.num_layers, self.page_size, self.dtype, self.kv_dim, self.token_scales
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' pages, per-token scales included (the per-layer
        scales of a ``"layer"`` pool, 8 bytes a layer, are not counted)."""
        return self.num_pages * self.page_nbytes

    def kv_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s ``[num_pages, page_size, kv_dim]`` storage tensor."""
        return self._kv[layer]

    def scale_buffer(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s ``[num_pages, page_size]`` float32 fp8 scales, or None."""
        return self._scale[layer] if self.token_scales else None

    def layer_scale(self, layer: int) -> torch.Tensor | None:
        """A ``"layer"`` fp8 pool's scale of ``layer`` as a [1] float32 device tensor (the
        kernels' ``descale_k``); None for other pools."""
        return self._layer_scale[layer : layer + 1] if self._layer_scale.numel() else None

    def layer_inv_scale(self, layer: int) -> torch.Tensor | None:
        """``1 / layer_scale(layer)`` ([1] float32): what writes multiply values by."""
        return self._layer_inv[layer : layer + 1] if self._layer_inv.numel() else None

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """Store ``latent`` ``[T, kv_dim]`` (any float dtype) at ``slots`` ``[T]`` (int)."""
        self._check_args(slots, latent)
        flat_kv = self._kv[layer].view(self.num_slots, self.kv_dim)
        if not self.is_fp8:
            flat_kv[slots] = latent.to(self.dtype)
            return
        values = latent.float()
        if not self.token_scales:
            quantized = (values * self._layer_inv[layer]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
            flat_kv[slots] = quantized.to(self.dtype)
            return
        # Floor the scale so all-zero rows stay finite even where subnormals flush to 0.
        scale = (values.abs().amax(dim=-1) * (1.0 / FP8_E4M3_MAX)).clamp_min(_MIN_SCALE)
        quantized = (values / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        flat_kv[slots] = quantized.to(self.dtype)
        self._scale[layer].view(self.num_slots)[slots] = scale

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows at ``slots`` ``[T]`` as ``[T, kv_dim]`` in ``compute_dtype`` (dequantized)."""
        self._check_slots(slots)
        rows = self._kv[layer].view(self.num_slots, self.kv_dim)[slots]
        if not self.is_fp8:
            return rows.to(self.compute_dtype)
        if not self.token_scales:
            return (rows.float() * self._layer_scale[layer]).to(self.compute_dtype)
        scale = self._scale[layer].view(self.num_slots)[slots]
        return (rows.float() * scale[:, None]).to(self.compute_dtype)

    def _check_slots(self, slots: torch.Tensor) -> None:
        if slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"slots: expected a 1-D int64/int32 tensor, got {slots.dtype} {list(slots.shape)}"
            )
        if slots.device != self.device:
            raise ValueError(f"slots: expected device {self.device}, got {slots.device}")

    def _check_args(self, slots: torch.Tensor, latent: torch.Tensor) -> None:
        self._check_slots(slots)
        expected = [slots.shape[0], self.kv_dim]
        if list(latent.shape) != expected:
            raise ValueError(f"latent: expected shape {expected}, got {list(latent.shape)}")
        if not latent.is_floating_point() or latent.device != self.device:
            raise ValueError(
                f"latent: expected a float tensor on {self.device}, "
                f"got {latent.dtype} on {latent.device}"
            )


def _check_fp8_scales(fp8_scales: str, layer_scale: float) -> None:
    if fp8_scales not in FP8_SCALES:
        raise ValueError(f"fp8_scales: expected one of {FP8_SCALES}, got {fp8_scales!r}")
    if not (0.0 < layer_scale < float("inf")):
        raise ValueError(f"layer_scale: expected a finite value > 0, got {layer_scale}")


def bytes_per_page(
    num_layers: int,
    page_size: int,
    dtype: torch.dtype,
    kv_dim: int = MLA_KV_DIM,
    token_scales: bool = True,
) -> int:
    """Bytes one page takes across all layers; fp8 pages include their float32 per-token
    scales unless ``token_scales`` is False (a ``"layer"`` pool: exactly half of bf16)."""
    fp8 = dtype == torch.float8_e4m3fn
    scale_bytes = _SCALE_BYTES if fp8 and token_scales else 0
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return num_layers * page_size * (kv_dim * element_bytes + scale_bytes)
