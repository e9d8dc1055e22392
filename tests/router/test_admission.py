"""Admission policy: the router's budget, and what Serve's proxy is told of it (and
how fast Serve stops its replicas).

Serve's proxy enforces the budget: the router deployment's ``max_ongoing_requests`` is
the budget, the proxy holds ``router.max_queued_requests`` while every router is full and
refuses the rest with 429 and ``Retry-After`` (tests/e2e/test_proxy_refusals_live.py checks it
through a real proxy). A full router still refuses before reading a body
(``tests/router/test_openai_api.py`` checks it live).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from router.api.admission import REFUSAL_RETRY_AFTER_S, Admission, router_max_ongoing
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


@pytest.mark.parametrize("budget", [1, 256, 1024])
def test_router_max_ongoing_is_the_budget(budget: int) -> None:
    assert router_max_ongoing(budget) == budget


def _config(max_in_flight: int, **router: int) -> ServingConfig:
    return ServingConfig.parse(
        {
            "mode": "pd",
            "engine": {"model": "tiny", "device": "cpu"},
            "router": {"num_replicas": 2, "max_in_flight": max_in_flight, **router},
        }
    )


def test_the_router_deployment_carries_its_admission_budget_to_serve() -> None:
    deployment = bind_app(_config(100, max_queued_requests=7))._bound_deployment
    assert deployment.max_ongoing_requests == 100
    assert deployment.num_replicas == 2
    serve_config = deployment._deployment_config
    assert serve_config.max_queued_requests == 7
    refusal = serve_config.backpressure_config
    assert refusal.status_code == 429 and refusal.retry_after_s == REFUSAL_RETRY_AFTER_S


@pytest.mark.parametrize(("queued", "ok"), [(-1, True), (1, True), (0, False), (-2, False)])
def test_the_proxy_queue_takes_serves_values_only(queued: int, ok: bool) -> None:
    if ok:
        assert _config(10, max_queued_requests=queued).router.max_queued_requests == queued
    else:
        with pytest.raises((ValidationError, ValueError), match="max_queued_requests"):
            _config(10, max_queued_requests=queued)


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
