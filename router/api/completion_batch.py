"""A list of prompts to ``/v1/completions``, with OpenAI's semantics.

Each prompt runs as its own request (its own id on the backend, its own admission slot),
all at once; the answer is one response whose choices are ordered by prompt, then by
sample: prompt ``i``'s ``n`` choices have ``index`` ``i * n`` to ``i * n + n - 1``, and the
usage is summed over the prompts. Streaming a list is refused (400): each prompt can be
streamed as its own request; so is a list longer than ``max_in_flight``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from router.api.errors import bad_request

Body = dict[str, Any]
_SUMMED = ("prompt_tokens", "completion_tokens", "total_tokens")
Item = TypeVar("Item")


def batch_prompts(body: Body, max_in_flight: int) -> list[Any] | None:
    """The prompts of a body that holds a list of two or more, else None (one prompt:
    the ordinary path). Raises a 400 for a streamed list, and for more prompts than the
    router admits at once (``max_in_flight``): a 429 there could never end."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2 or isinstance(prompt[0], int):
        return None
    if len(prompt) > max_in_flight:
        raise bad_request(
            f"a list of {len(prompt)} prompts is more than this router admits at once "
            f"(router.max_in_flight, {max_in_flight}): send it in parts",
            "prompt",
        )
    if body.get("stream") is True:
        raise bad_request(
            f"a list of {len(prompt)} prompts is answered whole: stream each prompt as its "
            "own request, or leave stream unset",
            "stream",
        )
    return list(prompt)


def split_batch(body: Body, prompts: Sequence[Any]) -> list[Body]:
    """One completions body per prompt, every other field the same."""
    return [body | {"prompt": prompt} for prompt in prompts]


async def run_batch(items: Sequence[Item], run_one: Callable[[Item], Awaitable[Body]]) -> Body:
    """Every item through ``run_one`` (a whole completions response) at once, merged in
    order by :func:`merge_responses`. The first failure (or a cancel) cancels the rest,
    whose cleanup aborts them, and is raised."""
    tasks = [asyncio.ensure_future(run_one(item)) for item in items]
    try:
        return merge_responses(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        raise


def merge_responses(responses: Sequence[Body]) -> Body:
    """One completions response from one response per prompt (see the module docstring)."""
    first = responses[0]
    choices = []
    for i, response in enumerate(responses):
        per_prompt = len(response["choices"])
        for choice in response["choices"]:
            choices.append(choice | {"index": i * per_prompt + choice["index"]})
    usage = {name: sum(r["usage"][name] for r in responses) for name in _SUMMED}
    details = [r["usage"].get("prompt_tokens_details") or {} for r in responses]
    usage["prompt_tokens_details"] = {
        "cached_tokens": sum(d.get("cached_tokens", 0) for d in details)
    }
    return first | {"choices": choices, "usage": usage}
