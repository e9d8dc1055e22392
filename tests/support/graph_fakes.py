"""A stand-in for a captured CUDA graph, for tests of graph release on the CPU."""

from __future__ import annotations


class RecordingFakeGraph:
    """Stands in for a captured ``torch.cuda.CUDAGraph`` (none exists without a GPU)."""

    def __init__(self) -> None:
        self.resets = 0

    def replay(self) -> None:
        raise AssertionError("a released graph must not be replayed")

    def reset(self) -> None:
        self.resets += 1
