"""Where the autoscaling policy tells every router replica which worker deployments leave,
and where the routers say they have let go.

The policy (``router.autoscale.serve``, in Serve's controller) marks a deployment leaving
before it lets Serve stop it; it publishes the leaving names, with a version that grows
with every change, to a named Ray actor (:class:`LeavingBoard`, one per app, no CPU). Each
router replica's membership watch reads them (:func:`read_leaving`), applies them, then
acknowledges the version (:func:`ack_leaving`); the policy waits for every running router
replica's acknowledgement (:meth:`Publisher.acked`). Everything crosses Ray as JSON bytes,
checked on arrival.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Set

import ray
from pydantic import BaseModel, ConfigDict, TypeAdapter

NAMESPACE = "dsv3serve"
REPUBLISH_S = 5.0  # an unchanged set is sent again this often (a restarted board is empty)
_ACKS = TypeAdapter(dict[str, int])
_ACK = TypeAdapter(tuple[str, int])  # (router replica id, version)
logger = logging.getLogger("ray.serve")


class LeavingSet(BaseModel):
    """The leaving deployments as of ``version`` (0: nothing published yet)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = 0
    leaving: frozenset[str] = frozenset()


def board_name(app: str) -> str:
    """The board actor's name for ``app`` (in namespace :data:`NAMESPACE`)."""
    return f"autoscale-leaving:{app}"


@ray.remote(num_cpus=0, max_restarts=-1)
class LeavingBoard:
    """The app's leaving set and each router replica's acknowledged version (JSON bytes)."""

    def __init__(self) -> None:
        self.data = LeavingSet().model_dump_json().encode()
        self.acks: dict[str, int] = {}

    def publish(self, data: bytes) -> None:
        LeavingSet.model_validate_json(data)
        self.data = data

    def read(self) -> bytes:
        return self.data

    def ack(self, data: bytes) -> None:
        reader, version = _ACK.validate_json(data)
        self.acks[reader] = version

    def acked(self) -> bytes:
        return _ACKS.dump_json(self.acks)


class Publisher:
    """The policy's side. It runs in Serve's control loop, so it never waits on the board:
    sends are fire-and-forget, and acknowledgements are fetched in the background."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.board: ray.actor.ActorHandle | None = None
        self.version = 0
        self.sent: frozenset[str] | None = None
        self.sent_at = 0.0
        self.acks: dict[str, int] = {}
        self.pending: ray.ObjectRef | None = None

    def publish(self, leaving: Set[str]) -> None:
        """Send ``leaving`` (a new version when it changed)."""
        now, names = time.monotonic(), frozenset(leaving)
        if names == self.sent and now - self.sent_at < REPUBLISH_S:
            return
        version = self.version + (names != self.sent)
        data = LeavingSet(version=version, leaving=names).model_dump_json().encode()
        try:
            self._board().publish.remote(data)
        except Exception:  # the next tick tries again; routers keep their last reading
            logger.warning("autoscale: publishing the leaving set failed", exc_info=True)
            return
        self.version, self.sent, self.sent_at = version, names, now

    def acked(self, readers: Set[str]) -> int:
        """The version every one of ``readers`` (running router replica ids) that follows
        the set has applied, as last fetched (the fetch runs on between calls);
        ``self.version`` when none follows it. A router follows it from its first request
        on, and applies the set before its first choice; one that never acknowledged has
        no worker to choose."""
        try:
            if self.pending is None:
                self.pending = self._board().acked.remote()
            ready, _ = ray.wait([self.pending], timeout=0)
            if ready:
                self.acks = _ACKS.validate_json(ray.get(self.pending))
                self.pending = None
        except Exception:  # keep the last acks: a leave waits, at most drain_timeout_s
            logger.warning("autoscale: reading the routers' acknowledgements failed", exc_info=True)
            self.pending = None
        return min((self.acks[r] for r in readers if r in self.acks), default=self.version)

    def _board(self) -> ray.actor.ActorHandle:
        if self.board is None:
            options = {"name": board_name(self.app), "namespace": NAMESPACE}
            # mypy keeps a decorated class's own type: LeavingBoard is Ray's ActorClass
            board = LeavingBoard.options(**options, get_if_exists=True)  # type: ignore[attr-defined]
            self.board = board.remote()
        return self.board


def _find(app: str) -> ray.actor.ActorHandle | None:
    try:
        return ray.get_actor(board_name(app), namespace=NAMESPACE)
    except ValueError:  # no board yet: the policy has not run
        return None


def read_leaving(app: str, timeout_s: float = 5.0) -> LeavingSet:
    """The leaving set of ``app`` (version 0, empty, while the policy has published none)."""
    board = _find(app)
    if board is None:
        return LeavingSet()
    return LeavingSet.model_validate_json(ray.get(board.read.remote(), timeout=timeout_s))


def ack_leaving(app: str, reader: str, version: int) -> None:
    """Tell the policy that router replica ``reader`` applied leaving-set ``version``."""
    board = _find(app)
    if board is not None and version > 0:
        board.ack.remote(_ACK.dump_json((reader, version)))
