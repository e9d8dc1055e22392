"""A worker deployment's way out: routers let go of it before Serve stops it.

Serve starts a deployment at zero replicas again as soon as a request waits in its handle
(its cold-start path, which no custom policy overrides). So when the policy decides a
deployment should stop, :class:`Leaves` first marks it leaving (published to the routers,
``router.autoscale.board``) and keeps it at one replica until the routers have had
``delay_s`` to stop choosing it and Serve counts no request on it (in flight or queued,
over its look-back window), or until ``drain_timeout_s``; only then does it give Serve
0. Pure: the caller passes the clock and Serve's view of the deployment.
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


@dataclass
class Leaves:
    """The deployments on their way out, with when each was marked leaving."""

    delay_s: float
    drain_timeout_s: float
    started: dict[str, float] = field(default_factory=dict)

    def target(self, name: str, want: int, serve: ServeView, now: float) -> int:
        """The replicas to give Serve for deployment ``name`` that the policy ``want``s."""
        if want >= 1:
            self.started.pop(name, None)  # staying, or a leave called off
            return 1
        if serve.target < 1:  # Serve stops it (or never ran it)
            if serve.running < 1:
                self.started.pop(name, None)
            elif name not in self.started:
                self.started[name] = now
            return 0
        since = now - self.started.setdefault(name, now)
        quiet = since >= self.delay_s and serve.ongoing <= 0.0
        return 0 if quiet or since >= self.drain_timeout_s else 1

    def leaving(self) -> set[str]:
        """The deployments routers must not choose."""
        return set(self.started)
