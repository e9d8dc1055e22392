"""The overlap scheduler's device ring of sampled token ids (see ``engine/overlap_loop.py``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


class FutureTokens:
    """Device ring buffer of sampled token ids, addressed by negative placeholder ids.

    ``buffer`` is [size] int64 on the model's device. A step that samples ``n`` rows
    reserves ``n`` consecutive slots; placeholder ``-(slot + 1)`` stands for the token the
    step writes into ``slot``. Only the placeholders of the two most recent steps are ever
    live, so ``size >= 3 * max_rows + 1`` keeps them apart.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self._next = 0

    @property
    def size(self) -> int:
        return int(self.buffer.shape[0])

    def reserve(self, num: int) -> int:
        """First slot of ``num`` consecutive free slots (wrapping to 0 at the end)."""
        if num > self.size:
            raise ValueError(f"expected at most {self.size} sampled rows per step, got {num}")
        if self._next + num > self.size:
            self._next = 0
        start, self._next = self._next, self._next + num
        return start

    @staticmethod
    def placeholders(start: int, num: int) -> list[int]:
        """The placeholder ids of slots ``start .. start+num-1``."""
        return [-(start + i + 1) for i in range(num)]

    def store(self, start: int, token_ids: Tensor) -> None:
        """Write ``token_ids`` [n] int64 (on the buffer's device) into slots from ``start``."""
        self.buffer[start : start + token_ids.shape[0]].copy_(token_ids)

    def resolve(self, ids: Tensor) -> Tensor:
        """``ids`` [T] int64 with each placeholder replaced by its slot's token (no sync)."""
        return torch.where(ids < 0, self.buffer[(-1 - ids).clamp(min=0)], ids)

    def install(self, embedding: nn.Module) -> RemovableHandle:
        """Resolve placeholders in the input ids of every ``embedding`` call (graphs too)."""
        return embedding.register_forward_pre_hook(lambda _m, args: (self.resolve(args[0]),))
