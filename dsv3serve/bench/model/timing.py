"""Timing one model step and its parts: CUDA events on the GPU, the host clock on the CPU.

A step marks the start of each part it wants timed (``Marks.mark``); forward pre-hooks mark
each decoder layer and the final norm, so the model's own ``forward`` runs unchanged. Every
iteration starts from an idle device (synchronised), as a serving loop that reads its
sampled tokens back does, and host launch overhead counts where the GPU waits for it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv3serve.forward_batch import SeqSpan
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

if TYPE_CHECKING:
    from dsv3serve.engine.model_runner import ModelRunner


class Marks:
    """Named time stamps recorded in order during one step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._names: list[str] = []
        self._events: list[torch.cuda.Event] = []  # on CUDA
        self._times: list[float] = []  # elsewhere

    def reset(self) -> None:
        """Forget the previous step's stamps."""
        self._names, self._events, self._times = [], [], []

    def mark(self, name: str) -> None:
        """Stamp the start of part ``name`` (and the end of the part before it)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        else:
            self._times.append(time.perf_counter())
        self._names.append(name)

    def parts_ms(self) -> dict[str, float]:
        """Milliseconds from each stamp to the next, by the earlier stamp's name; waits for
        the device. The last stamp only closes the part before it."""
        if self.cuda:
            self._events[-1].synchronize()
            ms = [a.elapsed_time(b) for a, b in zip(self._events, self._events[1:], strict=False)]
        else:
            ms = [1e3 * (b - a) for a, b in zip(self._times, self._times[1:], strict=False)]
        return dict(zip(self._names, ms, strict=False))


@contextmanager
def layer_marks(model: DeepseekV3ForCausalLM, marks: Marks) -> Iterator[None]:
    """While active, decoder layer ``i`` marks ``layer{i}`` and the final norm ``head``."""
    handles = [
        layer.register_forward_pre_hook(lambda *_, name=f"layer{i}": marks.mark(name))
        for i, layer in enumerate(model.layers)
    ]
    handles.append(model.norm.register_forward_pre_hook(lambda *_: marks.mark("head")))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class StepTime:
    """Median milliseconds of a step and of each of its parts over the timed iterations."""

    ms: float
    parts_ms: dict[str, float]
    iters: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[Marks], None], marks: Marks, warmup: int, iters: int) -> StepTime:
    """Run ``step`` ``warmup`` times untimed, then ``iters`` times timed, all with ``marks``.

    ``step(marks)`` must call ``marks.mark`` first at its start and last with ``"end"``.
    """
    for _ in range(warmup):
        marks.reset()
        step(marks)
    totals: list[float] = []
    parts: dict[str, list[float]] = {}
    for _ in range(iters):
        _sync(marks.device)
        marks.reset()
        step(marks)
        split = marks.parts_ms()
        totals.append(sum(split.values()))
        for name, ms in split.items():
            parts.setdefault(name, []).append(ms)
    medians = {name: statistics.median(v) for name, v in parts.items()}
    return StepTime(statistics.median(totals), medians, iters)


def time_decode_graph(
    runner: ModelRunner, spans: list[SeqSpan], warmup: int, iters: int
) -> float | None:
    """Median ms of the decode step over ``spans`` through the runner's CUDA graphs (host
    padding and planning, replay, logits copy), or None without a graph for it."""
    graphs = runner.graphs
    if graphs is None or not graphs.can_run(spans):
        return None
    for _ in range(warmup):
        graphs.run(spans)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(runner.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.run(spans)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
