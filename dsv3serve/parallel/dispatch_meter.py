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
run no Python, so steps replayed from CUDA graphs are not metered (docs/deepep.md). Nor is
what runs inside :func:`unmetered` (calls that are not traffic: the warm-up forwards before
a capture, DeepEP's start-up self-check), nor anything of a meter made with
``enabled=False`` (the engine's ``disable_moe_dispatch_metrics``): its ``start`` returns at
once, so the call records no event and copies no count, and it is not listed by
:func:`process_snapshots`, so no series is exported for it.

A low-latency combine moves the rows its dispatch received: the dispatch's :meth:`stop`
returns the count it recorded (:class:`Counted`) and the combine passes that back, so the
per-expert counts are summed and copied once per pair.

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
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv3serve.json_types import JSONObject
from dsv3serve.metrics import DISPATCH_LATENCY_BUCKETS

PHASES = ("dispatch", "combine")
MAX_PENDING = 1 << 16  # unread CUDA measurements kept at most (oldest dropped beyond)
DRAIN_AT = 256  # a stop() with this many pending reads the completed ones
# set by unmetered(): per thread (and task), like torch's grad mode
_NOT_TRAFFIC: ContextVar[bool] = ContextVar("dispatch_not_traffic", default=False)


@contextmanager
def unmetered() -> Iterator[None]:
    """Dispatch / combine calls made inside are not traffic (a graph's warm-up forwards,
    DeepEP's self-check): no meter records them (on this thread)."""
    token = _NOT_TRAFFIC.set(True)
    try:
        yield
    finally:
        _NOT_TRAFFIC.reset(token)


@dataclass
class _Mark:
    """Where one metered call began: a perf_counter time or a recorded CUDA event."""

    start: float | torch.cuda.Event


@dataclass(frozen=True)
class Counted:
    """The row count one metered call recorded: a host int, or a host int64 scalar (pinned,
    filled by a copy queued on the call's stream; on CPU the sum itself) that holds the
    count once that call is done. A later call on the same stream that moves as many rows
    (a low-latency combine, after its dispatch) passes it back to :meth:`DispatchMeter.stop`
    instead of summing and copying the counts again."""

    rows: int | Tensor


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
    """One dispatcher's latency and bytes per (phase, mode), rank ``rank`` of its group;
    ``enabled=False``: records nothing and is not listed by :func:`process_snapshots`."""

    def __init__(self, rank: int, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self.totals: dict[tuple[str, str], PhaseTotals] = {}
        self.dropped = 0
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        if enabled:
            _METERS.add(self)

    def start(self, ref: Tensor) -> _Mark | None:
        """Mark the start of a call on ``ref``'s device (None: the call is not recorded --
        the meter is off, the call is :func:`unmetered`, or a graph is being captured)."""
        if not self.enabled or _NOT_TRAFFIC.get():
            return None
        if ref.device.type != "cuda":
            return _Mark(time.perf_counter())
        if torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return _Mark(event)

    def stop(
        self,
        mark: _Mark | None,
        phase: str,
        mode: str,
        rows: int | Tensor | Counted,
        row_bytes: int,
    ) -> Counted | None:
        """End the call begun at ``mark``: it moved ``rows`` rows of ``row_bytes`` bytes
        (``rows`` a host int, a tensor of row counts on the call's device -- summed there and
        read later --, or what an earlier call's ``stop`` returned). Returns the count as
        recorded, None when ``mark`` is (nothing recorded, no work done on ``rows``)."""
        if mark is None:
            return None
        counted = rows if isinstance(rows, Counted) else Counted(self._host_rows(rows, mark))
        if isinstance(mark.start, float):
            end: float | torch.cuda.Event = time.perf_counter()
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self._record(_Pending(phase, mode, mark.start, end, counted.rows, row_bytes))
        return counted

    @staticmethod
    def _host_rows(rows: int | Tensor, mark: _Mark) -> int | Tensor:
        """``rows`` as a host int, or summed on its device and (CUDA) copied without
        blocking into a pinned scalar, read once the call is done."""
        if not isinstance(rows, Tensor):
            return rows
        total = rows.sum()
        if isinstance(mark.start, float):
            return total
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        return host.copy_(total, non_blocking=True)

    def _record(self, entry: _Pending) -> None:
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
            phases: list[JSONObject] = [
                {"phase": p, "mode": m, "bytes": t.bytes, "count": t.count,
                 "seconds": t.seconds, "buckets": list(t.buckets)}
                for (p, m), t in sorted(self.totals.items())
            ]  # fmt: skip
        return {"rank": self.rank, "dropped": self.dropped, "phases": phases}


def process_snapshots() -> list[JSONObject]:
    """The snapshot of every live meter of this process (one per dispatcher)."""
    return [m.snapshot() for m in list(_METERS)]
