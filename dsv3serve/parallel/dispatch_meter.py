"""Dispatch / combine latency and bytes of one rank, recorded without a host sync.

Every metered backend (all-to-all, DeepEP normal and low-latency) brackets each ``dispatch``
and ``combine`` call with :meth:`DispatchMeter.start` / :meth:`DispatchMeter.stop`:

* **latency**: on CPU tensors ``time.perf_counter`` around the call (gloo collectives are
  synchronous, so that is the call's time); on CUDA tensors two timing events recorded on
  the current stream, read only once the end event has completed (``Event.query``, which
  does not block) -- when a later call or a scrape drains the queue;
* **bytes**: the rows on this rank's expert side -- received by ``dispatch``, sent back by
  ``combine`` -- times the bytes of one row as the backend sends it. The row count is a host
  int where the backend already has one (the all-to-all's split sizes, DeepEP normal mode's
  received shape), else a device scalar (DeepEP low-latency: the per-expert counts' sum),
  copied to pinned host memory without blocking and read, like the events, once done.

Nothing is recorded while the current CUDA stream is capturing a graph: a graph's replays
run no Python, so steps replayed from CUDA graphs are not metered (docs/deepep.md).

:meth:`DispatchMeter.snapshot` returns plain numbers (cumulative bytes and histogram bucket
counts per (phase, mode)), so another process can read them: every meter of a process is
listed by :func:`process_snapshots`, which a group's follower rank answers with (see
``workers/group.py``) and :class:`~dsv3serve.metrics.DispatchStatsCollector` exports.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv3serve.json_types import JSONObject
from dsv3serve.metrics import DISPATCH_LATENCY_BUCKETS

PHASES = ("dispatch", "combine")
MAX_PENDING = 1 << 16  # unread CUDA measurements kept at most (oldest dropped beyond)
DRAIN_AT = 256  # a stop() with this many pending reads the completed ones


@dataclass
class _Mark:
    """Where one metered call began: a perf_counter time or a recorded CUDA event."""

    start: float | torch.cuda.Event


@dataclass
class _Pending:
    phase: str
    mode: str
    start: float | torch.cuda.Event
    end: float | torch.cuda.Event
    rows: int | Tensor
    row_bytes: int

    def ready(self) -> bool:
        return not isinstance(self.end, torch.cuda.Event) or self.end.query()

    def seconds(self) -> float:
        if isinstance(self.end, torch.cuda.Event):
            return self.start.elapsed_time(self.end) / 1e3  # type: ignore[union-attr]
        return self.end - self.start  # type: ignore[operator]


@dataclass
class PhaseTotals:
    """Cumulative numbers of one (phase, mode): bytes, and the latency histogram as
    per-bucket counts (``buckets[i]``: observations ``<= DISPATCH_LATENCY_BUCKETS[i]`` and
    above the previous bound; the last one is +Inf), their count and sum."""

    bytes: int = 0
    count: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(DISPATCH_LATENCY_BUCKETS) + 1))

    def add(self, seconds: float, nbytes: int) -> None:
        self.bytes += nbytes
        self.count += 1
        self.seconds += seconds
        self.buckets[bisect.bisect_left(DISPATCH_LATENCY_BUCKETS, seconds)] += 1


_METERS: weakref.WeakSet[DispatchMeter] = weakref.WeakSet()


class DispatchMeter:
    """One dispatcher's latency and bytes per (phase, mode), rank ``rank`` of its group."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.totals: dict[tuple[str, str], PhaseTotals] = {}
        self.dropped = 0
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        _METERS.add(self)

    def start(self, ref: Tensor) -> _Mark | None:
        """Mark the start of a call on ``ref``'s device (None while a graph is captured)."""
        if ref.device.type != "cuda":
            return _Mark(time.perf_counter())
        if torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return _Mark(event)

    def stop(
        self, mark: _Mark | None, phase: str, mode: str, rows: int | Tensor, row_bytes: int
    ) -> None:
        """End the call begun at ``mark``: it moved ``rows`` rows of ``row_bytes`` bytes
        (``rows`` a host int, or a tensor of row counts on the call's device, summed there
        and read later)."""
        if mark is None:
            return
        if isinstance(rows, Tensor):
            rows = rows.sum()
        if isinstance(mark.start, float):
            entry = _Pending(phase, mode, mark.start, time.perf_counter(), rows, row_bytes)
        else:
            if isinstance(rows, Tensor):
                host = torch.empty((), dtype=torch.int64, pin_memory=True)
                rows = host.copy_(rows, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            entry = _Pending(phase, mode, mark.start, end, rows, row_bytes)
        with self._lock:
            if entry.ready() and isinstance(entry.rows, int):
                self._add(entry)
                return
            self._pending.append(entry)
            if len(self._pending) >= DRAIN_AT:
                self._drain()
            while len(self._pending) > MAX_PENDING:
                self._pending.popleft()
                self.dropped += 1

    def reset(self) -> None:
        """Forget everything recorded so far (e.g. a start-up self-check's round trips)."""
        with self._lock:
            self.totals.clear()
            self._pending.clear()
            self.dropped = 0

    def _add(self, entry: _Pending) -> None:
        totals = self.totals.setdefault((entry.phase, entry.mode), PhaseTotals())
        totals.add(entry.seconds(), int(entry.rows) * entry.row_bytes)

    def _drain(self) -> None:
        """Fold in the completed measurements, oldest first (never waits; lock held)."""
        while self._pending and self._pending[0].ready():
            self._add(self._pending.popleft())

    def snapshot(self) -> JSONObject:
        """The cumulative numbers so far, as plain data: ``rank``, ``dropped`` and per
        (phase, mode) ``bytes``, ``count``, ``seconds`` and ``buckets``."""
        with self._lock:
            self._drain()
            phases = [
                {"phase": p, "mode": m, "bytes": t.bytes, "count": t.count,
                 "seconds": t.seconds, "buckets": list(t.buckets)}
                for (p, m), t in sorted(self.totals.items())
            ]  # fmt: skip
        return {"rank": self.rank, "dropped": self.dropped, "phases": phases}


def process_snapshots() -> list[JSONObject]:
    """The snapshot of every live meter of this process (one per dispatcher)."""
    return [m.snapshot() for m in list(_METERS)]
