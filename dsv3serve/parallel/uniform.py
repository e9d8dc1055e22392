"""A forward in which every rank of the group runs exactly the same number of rows.

A CUDA graph replays fixed shapes, so a group that replays one must agree on its batch size
before the step (the DP step header carries it) and pad every rank to it. Inside
:func:`uniform_batch` the collectives that would otherwise exchange row counts on the host
(``Comm.all_gather_rows``, the all-gather dispatcher) use the agreed size instead: no host
sync, so the forward can be captured. The size is a property of the forward being run, not
of a rank, so it lives in a context variable set around that forward. So does the device
scalar holding how many of those rows are real tokens (a graph's padding rows follow), which
a masked dispatcher uses to route the padding nowhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from torch import Tensor

_ROWS: ContextVar[int | None] = ContextVar("dsv3serve_uniform_rows", default=None)
_REAL: ContextVar[Tensor | None] = ContextVar("dsv3serve_uniform_real", default=None)


@contextmanager
def uniform_batch(rows: int, real: Tensor | None = None) -> Iterator[None]:
    """Within the block, every rank of the group forwards exactly ``rows`` tokens, of
    which the first ``real`` (a 0-dim integer tensor on the device, read by the kernels, so
    a replayed graph sees the value loaded before the replay; None: all) are tokens."""
    if rows < 1:
        raise ValueError(f"expected a uniform batch of at least 1 row, got {rows}")
    token, real_token = _ROWS.set(rows), _REAL.set(real)
    try:
        yield
    finally:
        _ROWS.reset(token)
        _REAL.reset(real_token)


def uniform_real_tokens(rows: int) -> Tensor | None:
    """The device scalar of real tokens of the current uniform batch when ``rows`` is its
    size (None: outside one, another size, or every row real)."""
    return _REAL.get() if _ROWS.get() == rows else None


def uniform_rows() -> int | None:
    """The agreed rows per rank of the forward being run (None: ranks may differ)."""
    return _ROWS.get()


def check_uniform(rows: int, what: str) -> int:
    """``rows`` if it is the agreed size of the current uniform batch, else ValueError."""
    agreed = uniform_rows()
    if agreed is None or rows != agreed:
        raise ValueError(f"{what}: expected {agreed} rows in a uniform batch, got {rows}")
    return rows
