"""Fake page copiers for the host tier: over ``FakeKVModel``'s slot dictionary, and one
that copies nothing."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_util import FakeKVModel


class FakeSlotCopier:
    """Copies whole pages of a ``FakeKVModel`` (its per-slot ``(position, token)``) to and
    from a host dictionary, as ``HostKVPool`` does with tensors: a fake for the pool's
    tensors only (the tier's bookkeeping above it is the real one)."""

    def __init__(self, model: FakeKVModel) -> None:
        self.model = model
        self.host: dict[int, tuple[int, int]] = {}
        self.backed_up = 0
        self.loaded = 0

    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self._copy(self.model.kv, self.host, device_pages, host_pages)
        self.backed_up += len(device_pages)

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        self._copy(self.host, self.model.kv, host_pages, device_pages)
        self.loaded += len(host_pages)

    def _copy(
        self,
        source: dict[int, tuple[int, int]],
        destination: dict[int, tuple[int, int]],
        source_pages: Sequence[int],
        destination_pages: Sequence[int],
    ) -> None:
        size = self.model.page_size
        for src, dst in zip(source_pages, destination_pages, strict=True):
            for offset in range(size):
                destination.pop(dst * size + offset, None)
                value = source.get(src * size + offset)
                if value is not None:
                    destination[dst * size + offset] = value


class NullCopier:
    """Counts the copies the host tier asks for; there is no KV to move (a fake)."""

    def __init__(self) -> None:
        self.backed_up = 0
        self.loaded = 0

    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self.backed_up += len(device_pages)

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        self.loaded += len(host_pages)
