"""MTP speculative decoding's break-even from measured step costs (issue 7).

A round with ``k`` draft steps costs ``k`` NextN steps (the ``k - 1`` chained proposals plus
the extend over the committed tokens, which leaves the next round's first draft) and one
target verify over ``k + 1`` tokens per sequence. It commits ``a`` tokens per sequence on
average (the accept length, ``1 <= a <= k + 1``), where plain decoding commits one per step:

    speedup(a) = a * t_decode / (k * t_draft + t_verify(k)),   break-even a = cost / t_decode.

Through CUDA graphs (:class:`GraphSpecCosts`) the ``k - 1`` chained proposals are one
graph replay (``t_chain(k)``), the verify a graph (``t_verify_graph(k)``), the extend a
graph over all ``k + 1`` positions per sequence (``t_extend_graph(k)``; where it was not
measured, one eager draft step stands for it) and plain decoding a graph too:

    round(k) = t_chain(k) + t_extend_graph(k) + t_verify_graph(k).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ACCEPT_LENGTHS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)


@dataclass(frozen=True)
class SpecCosts:
    """Milliseconds of one decode step, one draft step and verify by draft steps ``k``."""

    decode_ms: float
    draft_ms: float
    verify_ms: dict[int, float]

    def round_ms(self, k: int) -> float:
        """One speculative round with ``k`` draft steps."""
        return k * self.draft_ms + self.verify_ms[k]

    def break_even(self, k: int) -> float:
        """The accept length at which the round is as fast as plain decoding."""
        return self.round_ms(k) / self.decode_ms

    def speedup(self, k: int, accept_length: float) -> float | None:
        """Tokens per ms against plain decoding; None past the ``k + 1`` a round can commit."""
        if accept_length > k + 1:
            return None
        return accept_length * self.decode_ms / self.round_ms(k)


@dataclass(frozen=True)
class GraphSpecCosts(SpecCosts):
    """:class:`SpecCosts` through CUDA graphs: ``decode_ms`` and ``verify_ms`` graphed,
    ``draft_ms`` the eager draft step, ``chain_ms[k]`` the graphed ``k - 1`` chained steps
    (absent, i.e. 0, for ``k = 1``), ``extend_ms[k]`` the graphed extend (absent: the
    eager draft step stands for it)."""

    chain_ms: dict[int, float] = field(default_factory=dict)
    extend_ms: dict[int, float] = field(default_factory=dict)

    def round_ms(self, k: int) -> float:
        extend = self.extend_ms.get(k, self.draft_ms)
        return self.chain_ms.get(k, 0.0) + extend + self.verify_ms[k]


def speedup_rows(
    costs: Mapping[int, SpecCosts], accept_lengths: tuple[float, ...] = ACCEPT_LENGTHS
) -> list[dict[str, Any]]:
    """One row per (batch size, k): round cost, break-even and speedup per accept length."""
    rows = []
    for bs, c in sorted(costs.items()):
        for k in sorted(c.verify_ms):
            rows.append(
                {
                    "batch_size": bs,
                    "num_steps": k,
                    "round_ms": c.round_ms(k),
                    "break_even_accept_length": c.break_even(k),
                    "speedup": {f"{a:.1f}": c.speedup(k, a) for a in accept_lengths},
                }
            )
    return rows
