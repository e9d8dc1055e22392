"""The byte layout of staged KV pages, and the gather/scatter between a pool and one buffer.

Every connector moves the raw storage bytes of a list of pages, so a transfer is bit-exact
whatever the storage dtype (bf16, fp8 e4m3 with float32 scales, float32): nothing is
converted, NaN payloads included.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.handle import KVHandle, TransferError

__all__ = [
    "PageLayout",
    "check_dst_pages",
    "check_publish",
    "digest_pages",
    "dtype_name",
    "gather_pages",
    "layer_chunks",
    "make_handle",
    "page_index",
    "page_slices",
    "pool_buffers",
    "scatter_pages",
]

_SCALE_BYTES = 4  # one float32 scale per token per layer (fp8 pools only)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling a KVHandle carries)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PageLayout:
    """How ``n`` pages of a pool sit in one contiguous ``uint8`` buffer.

    The buffer is ``[kv section | scale section]``:

    - kv: ``[num_layers, n, page_size * kv_dim * element_size]`` bytes, layer-major, the
      pages in the order given (the storage rows of ``kv_buffer(l)[page]``, verbatim);
    - scales (fp8 only): ``[num_layers, n, page_size * 4]`` bytes, the float32 rows of
      ``scale_buffer(l)[page]``.

    The same layout on both sides means page ``i`` of the sender lands in destination
    page ``i`` of the receiver.
    """

    num_layers: int
    page_size: int
    kv_dim: int
    dtype: str
    kv_page_bytes: int
    scale_page_bytes: int

    @classmethod
    def of(cls, pool: MLAKVPool) -> PageLayout:
        """The layout of ``pool``'s pages."""
        element = torch.empty((), dtype=pool.dtype).element_size()
        return cls(
            num_layers=pool.num_layers,
            page_size=pool.page_size,
            kv_dim=pool.kv_dim,
            dtype=dtype_name(pool.dtype),
            kv_page_bytes=pool.page_size * pool.kv_dim * element,
            scale_page_bytes=pool.page_size * _SCALE_BYTES if pool.is_fp8 else 0,
        )

    def nbytes(self, num_pages: int) -> int:
        """Bytes of ``num_pages`` pages across all layers, scales included."""
        return self.num_layers * num_pages * (self.kv_page_bytes + self.scale_page_bytes)

    def sections(
        self, buf: torch.Tensor, num_pages: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views of ``buf`` (1-D uint8): kv ``[L, n, kv_page_bytes]``, scales or None."""
        expected = self.nbytes(num_pages)
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != expected:
            raise ValueError(
                f"expected a 1-D uint8 buffer of {expected} bytes for {num_pages} pages, "
                f"got {buf.dtype} {list(buf.shape)}"
            )
        kv_bytes = self.num_layers * num_pages * self.kv_page_bytes
        kv = buf[:kv_bytes].view(self.num_layers, num_pages, self.kv_page_bytes)
        if not self.scale_page_bytes:
            return kv, None
        scales = buf[kv_bytes:].view(self.num_layers, num_pages, self.scale_page_bytes)
        return kv, scales

    def chunk_views(self, buf: torch.Tensor, num_pages: int, layers: range) -> list[torch.Tensor]:
        """The contiguous 1-D pieces of ``buf`` holding ``layers``: kv bytes, then scales."""
        kv, scales = self.sections(buf, num_pages)
        pieces = [kv[layers.start : layers.stop], scales]
        if scales is not None:
            pieces[1] = scales[layers.start : layers.stop]
        return [piece.reshape(-1) for piece in pieces if piece is not None]

    def layers_per_chunk(self, num_pages: int, chunk_bytes: int) -> int:
        """How many layers of ``num_pages`` pages fit in about ``chunk_bytes`` (>= 1)."""
        per_layer = num_pages * (self.kv_page_bytes + self.scale_page_bytes)
        return max(1, min(self.num_layers, chunk_bytes // max(1, per_layer)))

    def mismatch(self, handle: KVHandle) -> str | None:
        """Why ``handle``'s pages cannot land in a pool of this layout, or None."""
        for field in ("num_layers", "page_size", "kv_dim", "dtype"):
            theirs, ours = getattr(handle, field), getattr(self, field)
            if theirs != ours:
                return f"{field}: the pool expects {ours!r}, the handle has {theirs!r}"
        if handle.nbytes != self.nbytes(handle.num_pages):
            return (
                f"nbytes: {handle.num_pages} pages take {self.nbytes(handle.num_pages)} "
                f"bytes here, the handle has {handle.nbytes}"
            )
        return None


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (uint8, last dim = bytes) viewed as the widest int type that fits.

    Copying 8-byte words instead of bytes is the same bits with 8x fewer elements.
    """
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if rows.shape[-1] % size == 0 and rows.storage_offset() % size == 0:
            return rows.view(dtype)
    return rows


def _kv_rows(pool: MLAKVPool, layer: int) -> torch.Tensor:
    return _wide(pool.kv_buffer(layer).view(torch.uint8).view(pool.num_pages, -1))


def _scale_rows(pool: MLAKVPool, layer: int) -> torch.Tensor:
    scales = pool.scale_buffer(layer)
    assert scales is not None, "fp8 pools have scale buffers"
    return _wide(scales.view(torch.uint8).view(pool.num_pages, -1))


Pages = list[int] | torch.Tensor


def pool_buffers(pool: MLAKVPool) -> list[torch.Tensor]:
    """Every buffer of ``pool`` a transport registers: each layer's KV, then fp8 scales."""
    tensors = [pool.kv_buffer(layer) for layer in range(pool.num_layers)]
    return tensors + [s for s in map(pool.scale_buffer, range(pool.num_layers)) if s is not None]


def page_slices(
    layout: PageLayout, kv_base: list[int], scale_base: list[int], pages: list[int]
) -> list[tuple[int, int]]:
    """(address, length) of every (layer, page) slice: the KV bytes, then the fp8 scales."""
    kv, scale = layout.kv_page_bytes, layout.scale_page_bytes
    return [(b + p * kv, kv) for b in kv_base for p in pages] + [
        (b + p * scale, scale) for b in scale_base for p in pages
    ]


def page_index(pool: MLAKVPool, pages: Pages) -> torch.Tensor:
    """Page ids as an int64 tensor on the pool's device (a copy from the host, which
    waits for the current stream: build it once per transfer, not once per chunk)."""
    if isinstance(pages, torch.Tensor):
        return pages
    return torch.tensor(pages, dtype=torch.int64).to(pool.device)


def gather_pages(
    pool: MLAKVPool,
    pages: Pages,
    out: torch.Tensor | None = None,
    layers: range | None = None,
) -> torch.Tensor:
    """Copy ``pages`` (ids, or their :func:`page_index`) into one uint8 buffer laid out
    as :class:`PageLayout`.

    ``out`` (1-D uint8 on the pool's device, exactly ``nbytes`` long) is written in place;
    without it a buffer is allocated on the pool's device. ``layers`` limits the copy to
    those layers (the rest of ``out`` is left alone). One copy kernel per layer (two for
    fp8), on the current stream; no host sync.
    """
    layout = PageLayout.of(pool)
    if out is None:
        out = torch.empty(layout.nbytes(len(pages)), dtype=torch.uint8, device=pool.device)
    kv, scales = layout.sections(out, len(pages))
    index = page_index(pool, pages)
    for layer in layers or range(pool.num_layers):
        torch.index_select(_kv_rows(pool, layer), 0, index, out=_wide(kv[layer]))
        if scales is not None:
            torch.index_select(_scale_rows(pool, layer), 0, index, out=_wide(scales[layer]))
    return out


def scatter_pages(
    pool: MLAKVPool, pages: Pages, buf: torch.Tensor, layers: range | None = None
) -> None:
    """Inverse of :func:`gather_pages`: write ``buf`` (on the pool's device) into ``pages``."""
    kv, scales = PageLayout.of(pool).sections(buf, len(pages))
    index = page_index(pool, pages)
    for layer in layers or range(pool.num_layers):
        _kv_rows(pool, layer).index_copy_(0, index, _wide(kv[layer]))
        if scales is not None:
            _scale_rows(pool, layer).index_copy_(0, index, _wide(scales[layer]))


def layer_chunks(num_layers: int, layers_per_chunk: int) -> list[range]:
    """``range(num_layers)`` cut into consecutive ranges of ``layers_per_chunk`` layers."""
    step = max(1, layers_per_chunk)
    return [range(a, min(a + step, num_layers)) for a in range(0, num_layers, step)]


def digest_pages(pool: MLAKVPool, pages: list[int]) -> str:
    """SHA-256 of the pages' raw bytes in :class:`PageLayout` order (for bit-exact checks)."""
    return hashlib.sha256(gather_pages(pool, pages).cpu().numpy().tobytes()).hexdigest()


def _page_problem(pages: list[int], num_pages: int) -> str | None:
    if not pages:
        return "no pages given"
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        return f"page ids must be in [0, {num_pages}), got {bad[:5]}"
    if len(set(pages)) != len(pages):
        return "page ids repeat"
    return None


def check_publish(pool: MLAKVPool, pages: list[int], num_tokens: int) -> None:
    """Raise ValueError unless ``pages`` are valid pool pages that hold ``num_tokens``."""
    problem = _page_problem(pages, pool.num_pages)
    if problem:
        raise ValueError(f"publish: {problem}")
    if not 1 <= num_tokens <= len(pages) * pool.page_size:
        raise ValueError(
            f"publish: num_tokens must be in [1, {len(pages) * pool.page_size}] for "
            f"{len(pages)} pages of {pool.page_size}, got {num_tokens}"
        )


def check_dst_pages(
    handle: KVHandle, layout: PageLayout, dst_pages: list[int], num_pages: int, connector: str
) -> None:
    """Raise TransferError unless ``handle`` can be received into ``dst_pages`` here."""
    where = f"receive {handle.request_id!r}"
    if handle.connector != connector:
        raise TransferError(
            f"{where}: handle made by connector {handle.connector!r}, this is {connector!r}"
        )
    problem = layout.mismatch(handle)
    if problem:
        raise TransferError(f"{where}: {problem}")
    if len(dst_pages) != handle.num_pages:
        raise TransferError(
            f"{where}: expected {handle.num_pages} destination pages, got {len(dst_pages)}"
        )
    problem = _page_problem(dst_pages, num_pages)
    if problem:
        raise TransferError(f"{where}: destination {problem}")


def make_handle(
    connector: str,
    layout: PageLayout,
    request_id: str,
    num_pages: int,
    num_tokens: int,
    source: JSONObject,
) -> KVHandle:
    """The JSON-safe handle of ``num_pages`` staged pages."""
    return KVHandle(
        request_id=request_id,
        connector=connector,
        num_tokens=num_tokens,
        num_pages=num_pages,
        page_size=layout.page_size,
        num_layers=layout.num_layers,
        kv_dim=layout.kv_dim,
        dtype=layout.dtype,
        nbytes=layout.nbytes(num_pages),
        source=source,
    )
