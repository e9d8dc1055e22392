"""Start a test's rank processes the way a local group starts its followers: forked from a
server that imported torch and the engine once (``dsv3serve.engine.group.rank_start``), each
with the caller's environment of the moment, as a spawned process would have it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from dsv3serve.engine.group.rank_start import adopt_environ, caller_environ, rank_context


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; raises as ``mp.spawn`` does
    (``mp.ProcessRaisedException`` / ``mp.ProcessExitedException``). ``fn`` must be
    importable (a module-level function)."""
    method = rank_context().get_start_method()
    mp.start_processes(
        _entry, args=(caller_environ(), fn, args), nprocs=nprocs, join=True, start_method=method
    )


def _entry(rank: int, environ: dict[str, str], fn: Callable[..., None], args: tuple) -> None:
    adopt_environ(environ)
    fn(rank, *args)
