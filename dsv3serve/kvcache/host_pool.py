"""Host-memory buffers of the hierarchical cache, and the page copies to and from the pool.

``HostKVPool`` mirrors an :class:`MLAKVPool`'s per-layer layout in host memory (pinned
when the pool is on CUDA): ``[num_host_pages, page_size, kv_dim]`` of the pool's storage
dtype per layer, plus the fp8 scales. It is the :class:`~dsv3serve.kvcache.host_tier.PageCopier`
of the engine's host tier.

On CUDA the copies run on a side stream: it first waits for the work already queued on the
current stream (a page's KV may still be being written there), and the current stream then
waits for the copies, so a later forward neither overwrites a page being backed up nor
reads one being loaded. ``load`` waits for its copies before it returns (its time is the
load time reported). Off CUDA the copies are plain indexed copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv3serve.kvcache.pool import MLAKVPool, bytes_per_page


class HostKVPool:
    """Host pages holding evicted device pages' KV, and the copies between the two."""

    def __init__(self, pool: MLAKVPool, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"host tier: num_pages must be positive, got {num_pages}")
        self.pool, self.num_pages = pool, num_pages
        cuda = pool.device.type == "cuda"
        shape = (num_pages, pool.page_size, pool.kv_dim)
        self._kv = [_host_zeros(shape, pool.dtype, cuda) for _ in range(pool.num_layers)]
        self._scale = [
            _host_zeros(shape[:2], torch.float32, cuda)
            for _ in range(pool.num_layers if pool.is_fp8 else 0)
        ]
        self._stream = torch.cuda.Stream(pool.device) if cuda else None

    @property
    def nbytes(self) -> int:
        """Host bytes held by the buffers, scales included."""
        pool = self.pool
        return self.num_pages * bytes_per_page(
            pool.num_layers, pool.page_size, pool.dtype, pool.kv_dim
        )

    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copy device page ``device_pages[i]`` into host page ``host_pages[i]``."""
        self._copy(self._device_buffers(), self._host_buffers(), device_pages, host_pages)

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        """Copy host page ``host_pages[i]`` into device page ``device_pages[i]``."""
        self._copy(self._host_buffers(), self._device_buffers(), host_pages, device_pages)
        if self._stream is not None:
            self._stream.synchronize()

    def synchronize(self) -> None:
        """Wait until every queued copy is done (before pages go to a reader outside the
        device's streams, e.g. a KV connector writing reserved pages)."""
        if self._stream is not None:
            self._stream.synchronize()

    def host_page(self, layer: int, page: int) -> torch.Tensor:
        """Layer ``layer``'s ``[page_size, kv_dim]`` rows of host page ``page`` (tests)."""
        return self._kv[layer][page]

    def _device_buffers(self) -> list[torch.Tensor]:
        pool = self.pool
        scales = [pool.scale_buffer(layer) for layer in range(pool.num_layers)]
        kv = [pool.kv_buffer(layer) for layer in range(pool.num_layers)]
        return kv + [scale for scale in scales if scale is not None]

    def _host_buffers(self) -> list[torch.Tensor]:
        return self._kv + self._scale

    def _copy(
        self,
        sources: list[torch.Tensor],
        destinations: list[torch.Tensor],
        source_pages: Sequence[int],
        destination_pages: Sequence[int],
    ) -> None:
        if len(source_pages) != len(destination_pages):
            raise ValueError(
                f"page copy: {len(source_pages)} source pages for "
                f"{len(destination_pages)} destination pages"
            )
        if self._stream is None:
            src = torch.tensor(list(source_pages), dtype=torch.int64)
            dst = torch.tensor(list(destination_pages), dtype=torch.int64)
            for source, destination in zip(sources, destinations, strict=True):
                destination[dst] = source[src]
            return
        self._copy_on_side_stream(sources, destinations, source_pages, destination_pages)

    def _copy_on_side_stream(
        self,
        sources: list[torch.Tensor],
        destinations: list[torch.Tensor],
        source_pages: Sequence[int],
        destination_pages: Sequence[int],
    ) -> None:
        assert self._stream is not None
        current = torch.cuda.current_stream(self.pool.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for source, destination in zip(sources, destinations, strict=True):
                for s, d in zip(source_pages, destination_pages, strict=True):
                    destination[d].copy_(source[s], non_blocking=True)
        current.wait_stream(self._stream)


def _host_zeros(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin)
