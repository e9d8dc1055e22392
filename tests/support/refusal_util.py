"""Getting Serve's proxy to refuse a call, in tests, without racing its queue count.

Serve's proxy counts a request as queued only once it starts placing it, so calls sent
together can all pass its ``max_queued_requests`` check before any of them is counted.
:func:`first_refusal` sends one call at a time instead, each once the one before has had
``settle_s`` to be refused: with the budget held, one call waits in the queue and the next
is refused."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import TypeVar

T = TypeVar("T")


def first_refusal(
    submit: Callable[[], Future[T]],
    refused: Callable[[Future[T]], bool],
    attempts: int = 4,
    settle_s: float = 1.5,
) -> tuple[Future[T], list[Future[T]]]:
    """The first call ``refused`` says was refused, and the calls sent before it that are
    still waiting (queued). A call that completes otherwise fails the test: the budget
    was meant to be held."""
    pending: list[Future[T]] = []
    for _ in range(attempts):
        call = submit()
        done, _ = wait([call], timeout=settle_s)
        if not done:
            pending.append(call)
        elif refused(call):
            return call, pending
        else:
            raise AssertionError(f"a call past the held budget was answered: {call.exception()!r}")
    raise AssertionError(f"none of {attempts} calls past the held budget was refused")
