"""Host-memory buffers of the hierarchical cache, and the page copies to and from the pool.

``HostKVPool`` mirrors an :class:`MLAKVPool`'s per-layer layout in host memory (pinned
when the pool is on CUDA): ``[num_host_pages, page_size, kv_dim]`` of the pool's storage
dtype per layer, plus the fp8 scales. It is the :class:`~dsv3serve.kvcache.host_tier.PageCopier`
of the engine's host tier.

On CUDA the copies run on a side stream, one per run of pages consecutive on both sides
and layer (``page_runs``), and the current (compute) stream then waits for them, so a
later forward neither overwrites a page being backed up nor reads one being loaded.
A backup does not wait for the compute stream: its source is a prefix-cache page nobody
references, whose KV was final when it entered the tree (a page enters it once its step's
token was read back, or, for an exported prefill, stays locked until the decode side
pulled it), so it overlaps with the forward in flight. A load first waits for the compute
stream's queued work (its destination may be a page a finished sequence's in-flight step
still reads), and ``load`` waits for its copies before it returns (its time is the load
time reported). Off CUDA the same copies run in place, synchronously.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv3serve.kvcache.pool import MLAKVPool


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
            for _ in range(pool.num_layers if pool.token_scales else 0)
        ]
        self._stream = torch.cuda.Stream(pool.device) if cuda else None

    @property
    def nbytes(self) -> int:
        """Host bytes held by the buffers, scales included."""
        return self.num_pages * self.pool.page_nbytes

    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copy device page ``device_pages[i]`` into host page ``host_pages[i]``."""
        self._copy(self._device_buffers(), self._host_buffers(), device_pages, host_pages, False)

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        """Copy host page ``host_pages[i]`` into device page ``device_pages[i]``."""
        self._copy(self._host_buffers(), self._device_buffers(), host_pages, device_pages, True)
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
        after_compute: bool,
    ) -> None:
        if len(source_pages) != len(destination_pages):
            raise ValueError(
                f"page copy: {len(source_pages)} source pages for "
                f"{len(destination_pages)} destination pages"
            )
        runs = page_runs(source_pages, destination_pages)
        if self._stream is None:
            _copy_runs(sources, destinations, runs)
            return
        current = torch.cuda.current_stream(self.pool.device)
        if after_compute:
            self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            _copy_runs(sources, destinations, runs)
        current.wait_stream(self._stream)


def _copy_runs(
    sources: list[torch.Tensor],
    destinations: list[torch.Tensor],
    runs: list[tuple[int, int, int]],
) -> None:
    for source, destination in zip(sources, destinations, strict=True):
        for s, d, n in runs:
            destination[d : d + n].copy_(source[s : s + n], non_blocking=True)


def page_runs(sources: Sequence[int], destinations: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(source, destination, length)`` runs of pages consecutive on both sides, in order:
    one copy per run and layer instead of one per page."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(sources, destinations, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _host_zeros(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin)
