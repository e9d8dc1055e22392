"""Waiting, with a deadline, for point-to-point ops and for a side CUDA stream.

``Work.wait(timeout)`` of NCCL polls at a coarse interval, and a plain ``wait()`` or a
stream synchronize can block forever if the peer dies. Here NCCL ops are polled through
``is_completed()`` (a CUDA event query) with a short backoff until a deadline; gloo ops
complete inside ``wait``, which takes the timeout itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["SideStream", "poll_until", "wait_work"]


def poll_until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Return once ``done()``; raise TimeoutError after ``timeout_s``.

    Polls every 10 us at first, backing off to every 100 us (a transfer's waits are
    short, and each one's overshoot adds to its latency).
    """
    deadline = time.monotonic() + timeout_s
    delay = 1e-5
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {timeout_s} s")
        time.sleep(delay)
        delay = min(2 * delay, 1e-4)


def wait_work(work: dist.Work, backend: str, timeout_s: float) -> None:
    """Block the CPU until ``work`` is done; raise on its error or after ``timeout_s``."""
    if backend == "gloo":
        work.wait(timedelta(seconds=timeout_s))
        return
    poll_until(work.is_completed, timeout_s, "an NCCL send/recv")
    work.wait()  # raises the op's error, if any; orders the current stream after it


class SideStream:
    """A CUDA stream of our own for transfer copies (nothing on CPU devices).

    Transfer copies wait on NCCL events; on a side stream a dead peer can never stall
    the engine's stream.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Make the side stream current (and its device) inside the block."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
            yield

    def wait_for(self, event: torch.cuda.Event | None) -> None:
        """Order the side stream after ``event`` (recorded on another stream)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def drain(self, timeout_s: float) -> None:
        """Block the CPU until everything queued on the side stream so far is done."""
        if self.stream is None:
            return
        event = torch.cuda.Event()
        event.record(self.stream)
        poll_until(event.query, timeout_s, "the transfer's copies")
