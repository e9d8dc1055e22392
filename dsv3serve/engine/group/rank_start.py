"""How a host starts the follower ranks of a local group (``LLM(tp_size=N)``).

A fresh interpreter per rank (``spawn``) imports torch and the engine again, seconds of CPU
per rank. The default, ``forkserver``, starts one server per calling process that imports
them once (:data:`PRELOAD`) and forks every later rank from it: a rank then starts in a
fraction of a second. ``$DSV3SERVE_WORKER_MULTIPROC_METHOD=spawn`` goes back to one fresh
interpreter per rank (:class:`dsv3serve.settings.Settings`).

The server keeps the environment it started with, so a forked rank is handed the caller's
environment of the moment (:func:`caller_environ`, :func:`adopt_environ`): either way a rank
sees what a spawned one would. The server never touches a device (importing torch does not
initialise CUDA), so forking from it is safe on GPUs too.
"""

from __future__ import annotations

import os
from multiprocessing.context import BaseContext

import torch.multiprocessing as mp

from dsv3serve.settings import Settings

PRELOAD = ("dsv3serve.engine.group.rank",)
"""What the fork server imports once: a follower rank's entry and all it imports."""


def rank_context(method: str | None = None) -> BaseContext:
    """The multiprocessing context to start ranks with: ``method``, or the configured one;
    the fork server, when chosen, preloads :data:`PRELOAD` (before it first starts)."""
    chosen = method or Settings.from_env().worker_multiproc_method
    ctx = mp.get_context(chosen)
    if chosen == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def caller_environ() -> dict[str, str]:
    """The caller's environment now, to hand to a rank it starts."""
    return dict(os.environ)


def adopt_environ(environ: dict[str, str]) -> None:
    """In a started rank: take ``environ`` (the caller's, :func:`caller_environ`) as this
    process's environment, replacing what a fork server inherited when it started."""
    os.environ.clear()
    os.environ.update(environ)
