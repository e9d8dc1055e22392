"""Where the autoscaling policy tells every router replica which worker deployments leave.

The policy (``router.autoscale.serve``, in Serve's controller) marks a deployment leaving
before it lets Serve stop it; it publishes the leaving names to a named Ray actor
(:class:`LeavingBoard`, one per app, no CPU) and the routers' membership watch reads them
(:func:`read_leaving`). The names cross Ray as JSON bytes, checked on arrival.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Set

import ray
from pydantic import TypeAdapter

NAMESPACE = "dsv3serve"
REPUBLISH_S = 5.0  # unchanged sets are sent again this often (a restarted board starts empty)
_NAMES = TypeAdapter(list[str])
logger = logging.getLogger("ray.serve")


def board_name(app: str) -> str:
    """The board actor's name for ``app`` (in namespace :data:`NAMESPACE`)."""
    return f"autoscale-leaving:{app}"


def encode_names(names: Set[str]) -> bytes:
    return _NAMES.dump_json(sorted(names))


def decode_names(data: bytes) -> set[str]:
    """The names in ``data``; raises pydantic ValidationError on anything but a list of str."""
    return set(_NAMES.validate_json(data))


@ray.remote(num_cpus=0, max_restarts=-1)
class LeavingBoard:
    """The app's leaving worker deployments, as JSON bytes (a list of names)."""

    def __init__(self) -> None:
        self.data = encode_names(set())

    def publish(self, data: bytes) -> None:
        decode_names(data)
        self.data = data

    def read(self) -> bytes:
        return self.data


class Publisher:
    """The policy's side: sends the leaving set when it changes, and every
    :data:`REPUBLISH_S` (never waits for an answer: it runs in Serve's control loop)."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.board: ray.actor.ActorHandle | None = None
        self.sent: set[str] | None = None
        self.sent_at = 0.0

    def publish(self, leaving: Set[str]) -> None:
        now = time.monotonic()
        if leaving == self.sent and now - self.sent_at < REPUBLISH_S:
            return
        try:
            if self.board is None:
                options = {"name": board_name(self.app), "namespace": NAMESPACE}
                self.board = LeavingBoard.options(**options, get_if_exists=True).remote()
            self.board.publish.remote(encode_names(leaving))
        except Exception:  # the next tick tries again; routers keep their last reading
            logger.warning("autoscale: publishing the leaving set failed", exc_info=True)
            return
        self.sent, self.sent_at = set(leaving), now


def read_leaving(app: str, timeout_s: float = 5.0) -> set[str]:
    """The leaving deployments of ``app`` (empty while the policy has published none)."""
    try:
        board = ray.get_actor(board_name(app), namespace=NAMESPACE)
    except ValueError:  # no board yet: the policy has not run
        return set()
    return decode_names(ray.get(board.read.remote(), timeout=timeout_s))
