"""What a worker replica reports to Serve's autoscaler (``record_autoscaling_stats``).

Names match what ``router.autoscale.serve`` reads. Prefill: ``queued_prompt_tokens``
(prompt tokens of prefills this replica holds, waiting or running), ``prefill_tokens_per_s``
(prompt tokens over the summed durations of the prefills finished in the window: prefills
that overlap count their shared seconds twice, so under concurrency this is a lower bound,
which errs towards more replicas) and
``ttft_p99_s`` (this replica's part of TTFT: arrival to first token, p99 over the window;
the router's hop and the KV handoff are not in it). Decode: ``kv_usage``, ``running`` and
``itl_p99_s`` (gaps between a stream's token chunks, p99 over the window).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from workers.protocol import WorkerLoad

Clock = Callable[[], float]


class Window:
    """Samples of the last ``span_s`` seconds (``clock`` in seconds, monotonic)."""

    def __init__(self, span_s: float, clock: Clock = time.monotonic) -> None:
        self.span_s = span_s
        self.clock = clock
        self._samples: deque[tuple[float, float, float]] = deque()

    def add(self, value: float, weight: float = 0.0) -> None:
        """One sample; ``weight`` rides along (e.g. the prompt tokens of a prefill)."""
        self._samples.append((self.clock(), value, weight))

    def _live(self) -> list[tuple[float, float]]:
        cutoff = self.clock() - self.span_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        return [(value, weight) for _, value, weight in self._samples]

    def p99(self) -> float:
        """The 99th percentile of the values (nearest rank); 0 with no samples."""
        values = sorted(value for value, _ in self._live())
        if not values:
            return 0.0
        return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]

    def rate(self) -> float:
        """Sum of weights over sum of values (tokens per busy second); 0 with none."""
        live = self._live()
        busy = sum(value for value, _ in live)
        return sum(weight for _, weight in live) / busy if busy > 0 else 0.0


class AutoscaleStats:
    """One replica's autoscaling inputs, fed by the host as prefills and streams run."""

    def __init__(self, span_s: float = 10.0, clock: Clock = time.monotonic) -> None:
        self.queued_prompt_tokens = 0
        self.prefills = Window(span_s, clock)  # value: seconds to first token, weight: tokens
        self.gaps = Window(span_s, clock)  # value: seconds between a stream's chunks

    def prefill_started(self, prompt_tokens: int) -> None:
        self.queued_prompt_tokens += prompt_tokens

    def prefill_ended(self, prompt_tokens: int, seconds: float | None) -> None:
        """A prefill left this replica after ``seconds`` from its arrival to its first
        token; None: it did not finish (no sample)."""
        self.queued_prompt_tokens -= prompt_tokens
        if seconds is not None:
            self.prefills.add(seconds, prompt_tokens)

    def token_gap(self, seconds: float) -> None:
        self.gaps.add(seconds)

    def snapshot(self, load: WorkerLoad) -> dict[str, float]:
        """The metrics of ``load.role`` for ``record_autoscaling_stats``."""
        if load.role == "prefill":
            return {
                "queued_prompt_tokens": float(self.queued_prompt_tokens),
                "prefill_tokens_per_s": self.prefills.rate(),
                "ttft_p99_s": self.prefills.p99(),
            }
        used = 1.0 - load.free_pages / load.num_pages if load.num_pages else 0.0
        return {"kv_usage": used, "running": float(load.running), "itl_p99_s": self.gaps.p99()}
