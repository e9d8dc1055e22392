"""Admission policy: the router's budget, and what Serve's proxy is told of it (and
how fast Serve stops its replicas).

A full router refuses before reading a body (``tests/router/test_openai_api.py`` checks
it live); Serve's proxy routes around a full router because the router deployment's
``max_ongoing_requests`` is the budget plus refusal headroom, not a fixed 4096.
"""

from __future__ import annotations

import pytest

from router.api.admission import MIN_REFUSAL_HEADROOM, Admission, router_max_ongoing
from router.app import DRAIN_POLL_S, bind_app
from router.config import ServingConfig


def test_full_is_exactly_when_try_acquire_refuses() -> None:
    admission = Admission(2)
    first, second = admission.try_acquire(), admission.try_acquire()
    assert first is not None and second is not None and admission.full
    assert admission.try_acquire() is None
    first.release()
    first.release()  # idempotent
    assert not admission.full and admission.in_flight == 1


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(1, 1 + MIN_REFUSAL_HEADROOM), (256, 256 + 64), (1024, 1024 + 256)],
)
def test_router_max_ongoing_is_the_budget_plus_headroom(budget: int, expected: int) -> None:
    assert router_max_ongoing(budget) == expected


def _config(max_in_flight: int) -> ServingConfig:
    return ServingConfig.parse(
        {
            "mode": "pd",
            "engine": {"model": "tiny", "device": "cpu"},
            "router": {"num_replicas": 2, "max_in_flight": max_in_flight},
        }
    )


def test_the_router_deployment_carries_its_admission_budget_to_serve() -> None:
    app = bind_app(_config(100))
    assert app._bound_deployment.max_ongoing_requests == router_max_ongoing(100)
    assert app._bound_deployment.num_replicas == 2


def test_a_deploy_files_router_option_still_wins() -> None:
    app = bind_app(_config(100), {"max_ongoing_requests": 7})
    assert app._bound_deployment.max_ongoing_requests == 7


def test_router_and_worker_replicas_stop_without_serves_two_second_first_wait() -> None:
    """Serve checks a stopping replica's requests first after one wait loop (2 s by
    default); the graceful stop's bound leaves about 3 s for Serve and Ray to stop."""
    router = bind_app(_config(100))._bound_deployment
    workers = [w._bound_deployment for ws in router.init_args[1].values() for w in ws]
    assert len(workers) == 2
    loops = {d._deployment_config.graceful_shutdown_wait_loop_s for d in [router, *workers]}
    assert loops == {DRAIN_POLL_S} and DRAIN_POLL_S <= 0.5, loops
