"""``router.launch_start``: the start waits of ``dsv3serve serve`` (issue 45 part 4).

The bound and the messages on a scripted clock; ``start_serve`` past a ``serve.start`` that
fails as Serve's does when its controller replaced a slow proxy (a stand-in: a real one is
in tests/e2e/test_slow_proxy_start.py); the port probe on a real socket.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import ray
from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview

import router.launch_start as launch_start
from router.launch_start import (
    REPORT_EVERY_S,
    Listeners,
    StartupError,
    app_pending,
    poll_until,
    port_accepting,
    proxies_pending,
)

NODE = "0870b94fca5396343586185e323af2b82c55d37d"


@dataclass
class ScriptedClock:
    """A clock that moves only when the code under test sleeps."""

    now: float = 100.0
    reports: list[str] = field(default_factory=list)

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def poll(self, pending: Callable[[], str | None], bound_s: float) -> float:
        return poll_until(
            pending,
            "the thing",
            bound_s,
            clock=lambda: self.now,
            sleep=self.sleep,
            report=self.reports.append,
        )


def answers(*replies: str | None) -> Callable[[], str | None]:
    """``pending`` that returns ``replies`` in turn, then the last one forever."""
    it: Iterator[str | None] = iter(replies)
    last: list[str | None] = [None]

    def pending() -> str | None:
        last[0] = next(it, last[0])
        return last[0]

    return pending


def test_poll_until_returns_once_up_and_says_how_long_it_took() -> None:
    clock = ScriptedClock()
    took = clock.poll(answers("proxy STARTING", "proxy STARTING", None), bound_s=60)
    assert took == 2.0
    assert clock.reports == []


def test_poll_until_fails_after_the_bound_naming_what_is_missing() -> None:
    clock = ScriptedClock()
    with pytest.raises(StartupError) as info:
        clock.poll(answers("deployment 'decode' UPDATING"), bound_s=90)
    assert str(info.value) == "the thing did not start within 90 s: deployment 'decode' UPDATING"
    assert clock.now - 100.0 == 90.0
    assert len(clock.reports) == 90 // REPORT_EVERY_S - 1  # one line per 30 s waited
    assert clock.reports[0].startswith("waiting for the thing (30 of 90 s): deployment")


def test_proxies_pending_names_the_node_its_state_and_the_servers_not_listening() -> None:
    listeners = Listeners("0.0.0.0", 8000, 9000)
    seen: list[tuple[str, int]] = []

    def accepting(host: str, port: int) -> bool:
        seen.append((host, port))
        return port == 8000

    line = proxies_pending({NODE: "STARTING"}, listeners, accepting)
    assert line == (
        "Serve's proxy node 0870b94fca53 STARTING (HTTP proxy on 127.0.0.1:8000 listening; "
        "gRPC proxy on port 9000 not listening)"
    )
    assert seen == [("127.0.0.1", 8000), ("127.0.0.1", 9000)]
    assert proxies_pending({NODE: "HEALTHY"}, listeners, accepting) is None
    assert proxies_pending({}, listeners, accepting).startswith("no proxy reported")


def _deployment(status: str, message: str = "", **replicas: int) -> DeploymentStatusOverview:
    return DeploymentStatusOverview(
        status=status,
        status_trigger="CONFIG_UPDATE_STARTED",
        replica_states=replicas,
        message=message,
    )


def _app(status: str, message: str = "") -> ApplicationStatusOverview:
    deployments = {
        "router": _deployment("HEALTHY", RUNNING=2),
        "decode": _deployment("UPDATING", "Deploying: 1 replica starting.", STARTING=1),
    }
    return ApplicationStatusOverview(
        status=status, message=message, last_deployed_time_s=0.0, deployments=deployments
    )


def test_app_pending_names_the_deployments_not_up() -> None:
    assert app_pending("dsv3serve", _app("RUNNING")) is None
    assert app_pending("dsv3serve", None) == "application 'dsv3serve' not known to Serve yet"
    assert app_pending("dsv3serve", _app("DEPLOYING")) == (
        "application 'dsv3serve' DEPLOYING: deployment 'decode' UPDATING (replicas: 1 "
        "STARTING): Deploying: 1 replica starting."
    )


def test_app_pending_fails_at_once_when_serve_says_deploy_failed() -> None:
    with pytest.raises(StartupError, match=r"deployment 'decode'.*Serve says: boom"):
        app_pending("dsv3serve", _app("DEPLOY_FAILED", "boom"))


def test_start_serve_waits_past_a_proxy_the_controller_replaced(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Serve's ``serve.start`` raises ActorDiedError when its controller replaced a proxy
    that failed three readiness checks (stand-in here); the launcher waits for the next."""

    def replaced_proxy_start(**options: object) -> None:
        raise ray.exceptions.ActorDiedError()

    statuses = iter([{}, {NODE: "STARTING"}, {NODE: "HEALTHY"}])
    monkeypatch.setattr(launch_start, "_proxy_statuses", lambda: next(statuses))
    monkeypatch.setattr(ray.serve, "start", replaced_proxy_start)
    monkeypatch.setattr(launch_start, "poll_until", _no_sleep(launch_start.poll_until))
    took = launch_start.start_serve({"host": "127.0.0.1", "port": 1}, None, bound_s=60)
    assert took < 60
    assert next(statuses, "drained") == "drained"
    assert "Serve's proxy not ready yet (ActorDiedError)" in capsys.readouterr().err


def _no_sleep(poll: Callable[..., float]) -> Callable[..., float]:
    return lambda *args, **kw: poll(*args, **kw, sleep=lambda s: None)


def test_start_serve_fails_at_once_when_the_proxy_could_not_start_a_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def port_taken_start(**options: object) -> None:
        raise ray.exceptions.RayTaskError("ready", "OSError: address in use", OSError())

    monkeypatch.setattr(ray.serve, "start", port_taken_start)
    with pytest.raises(StartupError, match=r"Serve's proxy failed to start \(HTTP proxy on"):
        launch_start.start_serve({"host": "127.0.0.1", "port": 1}, None, bound_s=60)


def test_port_accepting_sees_a_listening_socket() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port_accepting("127.0.0.1", port)
    assert not port_accepting("127.0.0.1", port)
