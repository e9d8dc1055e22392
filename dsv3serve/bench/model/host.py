"""Where the host time of one graphed call goes: ``cProfile`` over repeated calls.

``bench model --profile-graphs`` reports ``host_ms`` (wall time less the device ops); this
names the Python functions behind it (padding, ``ForwardBatch`` building, copies to the
device, attention planning, the replay's own launch), by cumulative time per call.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from typing import Any

import torch

HOST_TOP = 25


def _label(func: tuple[str, int, str]) -> str:
    """``path:line(name)`` with the path cut to the package-relative part."""
    path, line, name = func
    for marker in ("dsv3serve/", "flashinfer/", "torch/", "triton/"):
        if marker in path:
            path = marker + path.split(marker, 1)[1]
            break
    return f"{path}:{line}({name})"


def host_breakdown(run: Callable[[], Any], calls: int = 20, top: int = HOST_TOP) -> dict[str, Any]:
    """The ``top`` functions by cumulative time per call of ``run()`` (ms), and the
    profiled wall time per call; the device is synchronised before each call, not inside."""
    profiler = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        profiler.enable()
        run()
        profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = []
    for func, (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((cumtime, tottime, ncalls, _label(func)))
    rows.sort(reverse=True)
    total = stats.total_tt / calls  # type: ignore[attr-defined]
    return {
        "calls": calls,
        "profiled_ms_per_call": total * 1e3,
        "top": [
            {
                "fn": label,
                "cum_ms": cum / calls * 1e3,
                "self_ms": own / calls * 1e3,
                "ncalls": n / calls,
            }
            for cum, own, n, label in rows[:top]
        ],  # fmt: skip
    }
