"""A worker deployment's way out: routers let go of it before Serve stops it.

Serve starts a deployment at zero replicas again as soon as a request waits in its handle
(its cold-start path, which no custom policy overrides). So when the policy decides a
deployment should stop, :class:`Leaves` first marks it leaving (published to the routers
with a new version, ``router.autoscale.board``) and keeps it at one replica until every
router replica has acknowledged that version, ``delay_s`` has passed (Serve's view of the
requests sent just before catches up) and Serve counts no request on it (in flight or
queued, over its look-back window); or until ``drain_timeout_s``. Only then does Serve
get its 0. Pure: the caller passes the clock, the versions and Serve's view.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServeView:
    """What Serve reports of one worker deployment: its target replicas, its running
    replicas and its ongoing requests (running plus queued, averaged over the look-back)."""

    target: int
    running: int
    ongoing: float


@dataclass(frozen=True)
class Versions:
    """The leaving set's version a newly marked deployment is published in, and the version
    every router replica has acknowledged."""

    next: int
    acked: int


@dataclass
class Leaves:
    """The deployments on their way out: when each was marked leaving, in which version."""

    delay_s: float
    drain_timeout_s: float
    started: dict[str, tuple[float, int]] = field(default_factory=dict)

    def target(self, name: str, want: int, serve: ServeView, now: float, seen: Versions) -> int:
        """The replicas to give Serve for deployment ``name`` that the policy ``want``s."""
        if want >= 1:
            self.started.pop(name, None)  # staying, or a leave called off
            return 1
        if serve.target < 1:  # Serve stops it (or never ran it)
            if serve.running < 1:
                self.started.pop(name, None)
            else:
                self.started.setdefault(name, (now, seen.next))
            return 0
        since, version = self.started.setdefault(name, (now, seen.next))
        waited = now - since
        let_go = seen.acked >= version and waited >= self.delay_s
        return 0 if (let_go and serve.ongoing <= 0.0) or waited >= self.drain_timeout_s else 1

    def leaving(self) -> set[str]:
        """The deployments routers must not choose."""
        return set(self.started)
