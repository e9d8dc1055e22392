"""``dsv3serve serve``'s start waits: Serve's proxies, then each app, come up within a
bound, or a :class:`StartupError` names what did not start (the HTTP proxy, the gRPC
proxy, which deployment)."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsv3serve.json_types import JSONObject, json_int

if TYPE_CHECKING:
    from ray.serve.deployment import Application
    from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview

# Serve's controller gives a new proxy this long to answer `ready`, three times, before it
# replaces it (and serve.start may fail). Serve's 5 s default ran out on a 2-core host whose
# cores another process took; read by the controller, so set before the cluster starts.
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_CHECK_S = 30.0
PROXY_START_S = 300.0  # Serve's proxies: HTTP and gRPC servers listening, HEALTHY
APP_START_S = 1800.0  # an app: every replica built (a published checkpoint loads for minutes)
POLL_S = 1.0
REPORT_EVERY_S = 30.0


class StartupError(RuntimeError):
    """What ``dsv3serve serve`` starts (the local Ray cluster, Serve's proxy, an app) did
    not come up within its bound; the message names it."""


def port_accepting(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class Listeners:
    """Where Serve's proxy listens: HTTP on ``http_host:http_port``, gRPC on ``grpc_port``
    of every interface (None: no gRPC proxy)."""

    http_host: str
    http_port: int
    grpc_port: int | None = None

    @classmethod
    def of(cls, http: JSONObject, grpc: JSONObject | None) -> Listeners:
        """From ``serve.start``'s ``http_options`` and ``grpc_options``."""
        grpc_port = None if grpc is None else json_int(grpc["port"], "grpc_options.port")
        return cls(str(http["host"]), json_int(http["port"], "http_options.port"), grpc_port)

    def describe(self, accepting: Callable[[str, int], bool] = port_accepting) -> str:
        """Which of the proxy's servers accept connections now, by name and address."""
        host = "127.0.0.1" if self.http_host in ("0.0.0.0", "::", "") else self.http_host
        parts = [
            _listening(f"HTTP proxy on {host}:{self.http_port}", accepting(host, self.http_port))
        ]
        if self.grpc_port is not None:
            up = accepting("127.0.0.1", self.grpc_port)
            parts.append(_listening(f"gRPC proxy on port {self.grpc_port}", up))
        return "; ".join(parts)


def _listening(what: str, up: bool) -> str:
    return f"{what} {'listening' if up else 'not listening'}"


def use_patient_proxy_checks() -> None:
    """Give Serve's proxy ``PROXY_READY_CHECK_S`` per readiness check (unless the variable
    is set by hand). Call before ``ray.init`` starts the local cluster: the controller
    inherits this process's environment through the raylet."""
    os.environ.setdefault(PROXY_READY_ENV, f"{PROXY_READY_CHECK_S:g}")


def say(line: str) -> None:
    """A progress line of the start on stderr."""
    print(f"dsv3serve: {line}", file=sys.stderr, flush=True)


def poll_until(
    pending: Callable[[], str | None],
    what: str,
    bound_s: float,
    *,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    report: Callable[[str], None] = say,
    since: float | None = None,
) -> float:
    """Call ``pending`` (None: up; else what is still missing) until it returns None;
    reports the missing part every ``REPORT_EVERY_S``. Returns the seconds it took, counted
    from ``since`` (a ``clock`` reading; None: now).

    Raises StartupError naming ``what`` and the last missing part once ``bound_s`` passed."""
    start = clock() if since is None else since
    reported = start
    while (missing := pending()) is not None:
        now = clock()
        if now - start >= bound_s:
            raise StartupError(f"{what} did not start within {bound_s:.0f} s: {missing}")
        if now - reported >= REPORT_EVERY_S:
            report(f"waiting for {what} ({now - start:.0f} of {bound_s:.0f} s): {missing}")
            reported = now
        sleep(poll_s)
    return clock() - start


def proxies_pending(
    proxies: Mapping[str, str],
    listeners: Listeners,
    accepting: Callable[[str, int], bool] = port_accepting,
) -> str | None:
    """None when every proxy Serve reports is HEALTHY; else which are not, and which of
    their servers accept connections (``accepting``)."""
    if not proxies:
        return f"no proxy reported by Serve's controller yet ({listeners.describe(accepting)})"
    waiting = {node: status for node, status in proxies.items() if status != "HEALTHY"}
    if not waiting:
        return None
    states = ", ".join(f"node {node[:12]} {_value(s)}" for node, s in sorted(waiting.items()))
    return f"Serve's proxy {states} ({listeners.describe(accepting)})"


def _value(status: object) -> str:
    return str(getattr(status, "value", status))


def _proxy_statuses() -> Mapping[str, str]:
    from ray import serve

    return serve.status().proxies


def start_serve(http: JSONObject, grpc: JSONObject | None, bound_s: float = PROXY_START_S) -> float:
    """``serve.start``; when it fails because the proxy was slow to answer its readiness
    check (the controller replaced it, or Serve's own 60 s wait ran out), keep waiting
    until Serve reports every proxy HEALTHY. Returns the seconds it took.

    Raises StartupError naming the proxy's state and which of its servers listen once
    ``bound_s`` passed, or at once when the proxy failed to start one (a port in use)."""
    import ray
    from ray import serve

    listeners = Listeners.of(http, grpc)
    start = time.monotonic()
    try:
        serve.start(http_options=http, grpc_options=grpc)
    except (ray.exceptions.RayActorError, TimeoutError) as exc:
        say(
            f"Serve's proxy not ready yet ({type(exc).__name__}); waiting for it, "
            f"at most {bound_s:.0f} s in all"
        )
    except ray.exceptions.RayTaskError as exc:
        raise StartupError(
            f"Serve's proxy failed to start ({listeners.describe()}): {exc}"
        ) from exc

    def pending() -> str | None:
        return proxies_pending(_proxy_statuses(), listeners)

    return poll_until(pending, "Serve's proxy", bound_s, since=start)


def deployments_line(deployments: Mapping[str, DeploymentStatusOverview]) -> str:
    """The deployments not HEALTHY, with their replica states and Serve's message."""
    parts = []
    for name, info in sorted(deployments.items()):
        if info.status == "HEALTHY":
            continue
        replicas = ", ".join(f"{n} {_value(s)}" for s, n in sorted(info.replica_states.items()))
        part = f"deployment {name!r} {_value(info.status)} (replicas: {replicas or 'none'})"
        parts.append(part + (f": {info.message}" if info.message else ""))
    return "; ".join(parts) or "every deployment HEALTHY"


def app_pending(name: str, status: ApplicationStatusOverview | None) -> str | None:
    """None when app ``name`` is RUNNING; else its state and the deployments not HEALTHY.

    Raises StartupError when Serve reports it DEPLOY_FAILED."""
    if status is None:
        return f"application {name!r} not known to Serve yet"
    if status.status == "RUNNING":
        return None
    line = f"application {name!r} {_value(status.status)}: {deployments_line(status.deployments)}"
    if status.status == "DEPLOY_FAILED":
        raise StartupError(f"{line}; Serve says: {status.message}")
    return line


def wait_running(name: str, bound_s: float = APP_START_S) -> float:
    """Block until Serve reports application ``name`` RUNNING; returns the seconds it took.

    Raises StartupError naming the deployments not HEALTHY when it reports DEPLOY_FAILED,
    or after ``bound_s``."""
    from ray import serve

    def pending() -> str | None:
        return app_pending(name, serve.status().applications.get(name))

    return poll_until(pending, f"application {name!r}", bound_s)


def deploy_app(
    app: Application, name: str, route_prefix: str, bound_s: float = APP_START_S
) -> float:
    """Deploy ``app`` as ``name`` and wait (``wait_running``) until it runs."""
    from ray import serve

    serve.run_many(
        [serve.RunTarget(target=app, name=name, route_prefix=route_prefix)],
        wait_for_applications_running=False,
    )
    return wait_running(name, bound_s)
