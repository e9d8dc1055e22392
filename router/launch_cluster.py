"""The local Ray cluster's start on a slow host: Ray 2.60 gives a new node a fixed 30 s to
register with its GCS; ``dsv3serve serve`` gives it ``NODE_START_S``.

``ray._private.node.Node.__init__`` asks the GCS for the node it started
(``ray._private.services.get_node``, a RuntimeError while the node is not registered) in a
loop that gives up once 30 s passed (a local variable, not a setting, though its message
names ``RAY_raylet_start_wait_time_s``). On a 2-core box whose cores other processes took,
the GCS answered "Deadline Exceeded" past that and ``ray.init`` failed. While
:func:`patient_node_lookup` is active, each look-up itself retries until ``bound_s``, so
Ray's loop sees a late success, not a failure; tests/router/test_launch_cluster.py checks
that Ray still works this way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

NODE_START_S = 180.0
LOOKUP_POLL_S = 1.0
T = TypeVar("T")


def retrying(
    lookup: Callable[..., T],
    bound_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Callable[..., T]:
    """``lookup`` retried on RuntimeError every ``LOOKUP_POLL_S`` until ``bound_s`` after
    its first call; past that, the last RuntimeError goes to the caller."""
    first_call: list[float] = []

    def patient(*args: object, **kwargs: object) -> T:
        first_call[:] = first_call or [clock()]
        while True:
            try:
                return lookup(*args, **kwargs)
            except RuntimeError:
                if clock() - first_call[0] >= bound_s:
                    raise
                sleep(LOOKUP_POLL_S)

    return patient


@contextmanager
def patient_node_lookup(bound_s: float = NODE_START_S) -> Iterator[None]:
    """Within the block (``ray.init`` starting the local cluster), Ray's look-up of its new
    node retries for up to ``bound_s`` (see the module docstring)."""
    from ray._private import services

    original = services.get_node
    services.get_node = retrying(original, bound_s)
    try:
        yield
    finally:
        services.get_node = original
