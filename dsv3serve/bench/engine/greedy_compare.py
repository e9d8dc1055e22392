"""Greedy tokens of one run against a reference run, judged against the engine's own spread.

Two bf16 runs of the same model part where it is nearly tied: their logits move by a few
rounding steps when sums are reordered (another batch split, a TP all-reduce, another GPU).
Where they part, every position up to and including the first difference still had
identical inputs on both sides, so their top log-probabilities there are comparable. The
reference engine's own spread is measured in the same run (the same engine under another
batching), and a divergence counts as rounding when its gap stays within
:data:`SPREAD_FACTOR` times that spread; a wrong shard, page or expert moves
log-probabilities by whole nats at the first positions.

Tokens are any hashable key (ids, or the token strings an HTTP API returns), the same kind on
both sides.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

SPREAD_FACTOR = 2.0

T = TypeVar("T", bound=Hashable)
Tops = Mapping[str, Sequence[Mapping[T, float]]]


def same_input_gap(
    got_top: Sequence[Mapping[T, float]], ref_top: Sequence[Mapping[T, float]], n: int
) -> float:
    """The largest log-probability difference of a token both runs list, over the first
    ``n`` positions (those whose inputs were identical)."""
    gaps = [
        abs(mine[tok] - theirs[tok])
        for mine, theirs in zip(got_top[:n], ref_top[:n], strict=False)
        for tok in mine.keys() & theirs.keys()
    ]
    return max(gaps, default=0.0)


def first_difference(got: Sequence[T], want: Sequence[T]) -> int | None:
    """The first position where ``got`` and ``want`` differ (a missing token counts)."""
    pos = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if pos is None and len(got) != len(want):
        return min(len(got), len(want))
    return pos


def spread(
    ref_tokens: Mapping[str, Sequence[T]],
    ref_top: Tops,
    runs: Sequence[tuple[Mapping[str, Sequence[T]], Tops]],
) -> float:
    """The engine's own spread: the largest same-input gap between the reference and each
    of ``runs`` (``(tokens, top)`` of the same engine under other batchings)."""
    gaps = [compare(toks, top, ref_tokens, ref_top)["same_input_logprob_gap"] for toks, top in runs]
    return max(gaps, default=0.0)


def compare(
    tokens: Mapping[str, Sequence[T]],
    top: Tops,
    ref_tokens: Mapping[str, Sequence[T]],
    ref_top: Tops,
    ref_spread: float | None = None,
) -> dict[str, Any]:
    """A run's tokens and top log-probabilities against the reference's: equal, or where
    each request parted, and (with ``ref_spread``) whether the gap is within the spread."""
    same, gap, diverged = 0, 0.0, []
    for rid, want in ref_tokens.items():
        got = tokens.get(rid, [])
        same += sum(1 for a, b in zip(got, want, strict=False) if a == b)
        pos = first_difference(got, want)
        n = len(want) if pos is None else pos + 1
        gap = max(gap, same_input_gap(top.get(rid, []), ref_top.get(rid, []), n))
        if pos is not None:
            diverged.append({"request": rid, "position": pos})
    verdict = "equal"
    if diverged:
        verdict = "diverged"
        if ref_spread is not None:
            within = gap <= SPREAD_FACTOR * ref_spread
            verdict += " within the engine's spread" if within else " beyond the engine's spread"
    return {
        "equal": not diverged,
        "verdict": verdict,
        "same_input_logprob_gap": round(gap, 5),
        "engine_spread": ref_spread,
        "matching_tokens": same,
        "reference_tokens": sum(len(v) for v in ref_tokens.values()),
        "divergences": diverged,
    }
