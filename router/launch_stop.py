"""``dsv3serve serve``'s graceful stop: the drain board it starts with the app, the bound,
and the stop on the first SIGTERM or Ctrl-C (drain, Serve, then the local Ray cluster)."""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, NoReturn

from dsv3serve.json_types import JSONObject
from router.config import ServingConfig, app_args, deploy_applications
from router.drain import DRAIN_BOARD, DRAIN_NAMESPACE, DrainBoard

if TYPE_CHECKING:
    from ray.actor import ActorHandle

# The graceful stop's board (router/drain.py); kept here so it lives as long as the driver.
_BOARDS: list[ActorHandle] = []
IDLE_POLL_S = 0.2


def start_drain_board() -> None:
    """Start the graceful stop's board (``router.drain.DrainBoard``), before the app."""
    import ray

    board = ray.remote(DrainBoard).options(
        name=DRAIN_BOARD, namespace=DRAIN_NAMESPACE, num_cpus=0, max_concurrency=1000
    )
    _BOARDS.append(board.remote())  # type: ignore[arg-type]  # Ray's remote(): handle | class


def graceful_bound_s(data: JSONObject) -> float:
    """The graceful stop's bound: the largest ``router.graceful_shutdown_timeout_s``."""
    apps = deploy_applications(data)
    return max(ServingConfig.parse(app_args(a)).router.graceful_shutdown_timeout_s for a in apps)


def cut_after_s(bound_s: float) -> float:
    """When routers end the streams still running: early enough in the bound that the
    error events go out and Serve and Ray stop before it ends (about 3 s on a loaded
    2-core CPU machine): half the bound, at most 10 s, is left for that."""
    return bound_s - min(10.0, 0.5 * bound_s)


def drain(bound_s: float) -> None:
    """Stop admitting and wait (at most ``bound_s``) until every router replica has nothing
    in flight; routers end the streams still running at ``cut_after_s``."""
    import ray

    if not _BOARDS:
        return
    board = _BOARDS[0]
    ray.get(board.start.remote(cut_after_s(bound_s)))
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and not ray.get(board.all_idle.remote()):
        time.sleep(IDLE_POLL_S)


def stop_local_cluster(bound_s: float = 0.0) -> None:
    """Drain (``drain``: new requests get 503, running ones get at most ``bound_s``, the
    rest end with an error event), stop Serve, then the local Ray cluster; nothing when
    the cluster never started. A second Ctrl-C or SIGTERM skips the rest of the graceful
    part."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return  # no cluster started (serve.shutdown would start one only to ask)
    print(
        f"dsv3serve: stopping, letting requests in flight finish for at most {bound_s:g} s "
        "(Ctrl-C again to stop at once)",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    try:
        if bound_s > 0:
            drain(bound_s)
            _said(f"drained in {time.monotonic() - start:.1f} s")
        serve.shutdown()
        _said(f"Serve stopped {time.monotonic() - start:.1f} s after the signal")
    except KeyboardInterrupt:
        print("dsv3serve: stopping at once", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        _said(f"Ray stopped {time.monotonic() - start:.1f} s after the signal")


def _said(line: str) -> None:
    print(f"dsv3serve: {line}", file=sys.stderr, flush=True)


def stop_and_exit(code: int, bound_s: float = 0.0) -> NoReturn:
    """``stop_local_cluster``, then exit the process with ``code`` (1 if stopping failed)
    without the interpreter's own finalization: after Ray's driver shut down, that was
    seen to spin in garbage collection without end (once a router replica had been killed
    mid-stream), so ``dsv3serve serve`` never exited on Ctrl-C or SIGTERM."""
    try:
        stop_local_cluster(bound_s)
    except BaseException:
        traceback.print_exc()
        code = code or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
