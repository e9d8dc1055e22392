"""What a DP group's ranks agree on per step (``StepShape``): the leader's choice of graph
size and phase, its trip through the step header, and the MoE dispatcher's use of the phase.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dsv3serve.engine.group.dp import StepShape, decode_part, encode_parts, step_shape
from dsv3serve.forward_batch import SeqSpan
from dsv3serve.moe.sharded import run_dispatched
from dsv3serve.parallel.dispatch_base import (
    Dispatched,
    Dispatcher,
    MaskedDispatched,
    MaskedDispatcher,
)

GRAPHS = SimpleNamespace(sizes=[1, 2, 4, 8], max_batch_size=8)


def _decode(n: int) -> list[SeqSpan]:
    return [SeqSpan([7], 5, [0, 1, 2, 3, 4, 5], True) for _ in range(n)]


def _extend(tokens: int) -> list[SeqSpan]:
    return [SeqSpan(list(range(tokens)), 0, list(range(tokens)), True)]


@pytest.mark.parametrize(
    ("parts", "graphs", "want"),
    [
        ([_decode(3), _decode(1)], GRAPHS, StepShape(4, True, 3)),  # the larger rank's size
        ([_decode(2), []], GRAPHS, StepShape(2, True, 2)),  # an empty rank replays dummies
        ([[], _decode(8)], GRAPHS, StepShape(8, True, 8)),
        ([_decode(9), _decode(1)], GRAPHS, StepShape(0, True, 9)),  # over the largest graph
        ([_decode(2), _extend(3)], GRAPHS, StepShape(0, False, 3)),  # one rank prefills
        ([_decode(2), _decode(2)], None, StepShape(0, True, 2)),  # no graphs: eager decode
        ([[SeqSpan([7], 5, [0] * 6, False)], []], GRAPHS, StepShape(0, False, 1)),  # no sample
    ],
)
def test_leader_choice(parts: list[list[SeqSpan]], graphs: Any, want: StepShape) -> None:
    assert step_shape(parts, graphs) == want


def test_the_shape_travels_with_the_spans() -> None:
    parts = [_decode(3), [], _extend(4)]
    data = encode_parts(parts, StepShape(4, True, 4))
    for rank, part in enumerate(parts):
        spans, rows, shape = decode_part(data, rank)
        assert [s.token_ids for s in spans] == [s.token_ids for s in part]
        assert rows == [3, 0, 1] and shape == StepShape(4, True, 4)


class RecordingMaskedFake(Dispatcher, MaskedDispatcher):
    """FAKE dispatcher (one rank, nothing moves) that records which path each call took."""

    num_local_experts = 2
    max_tokens_per_rank = 8

    def __init__(self) -> None:
        self.calls: list[str] = []

    def use_masked(self, decode: bool) -> bool:
        return decode  # DeepEP ``auto``: masked for decode steps only

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor) -> Dispatched:
        self.calls.append("flat")
        return Dispatched(x, topk_ids, w)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return y

    def dispatch_masked(
        self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, num_tokens: Any = None
    ) -> Any:
        self.calls.append("masked")
        raise StopIteration  # the path is all this test needs

    def combine_masked(self, y: torch.Tensor, dispatched: MaskedDispatched) -> torch.Tensor:
        return y


def test_moe_takes_the_groups_phase() -> None:
    fake = RecordingMaskedFake()
    x, ids, w = torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    run_dispatched(fake, None, x, w, ids, None)  # type: ignore[arg-type]
    fake.step_is_decode = True  # what forward_local sets from the step header
    with pytest.raises(StopIteration):
        run_dispatched(fake, None, x, w, ids, None)  # type: ignore[arg-type]
    assert fake.calls == ["flat", "masked"]


class RecordingRunnerFake:
    """FAKE runner: records the phases forward_local sets; its model runs idle steps."""

    def __init__(self) -> None:
        self.phases: list[tuple[bool, int]] = []
        self.graphs = None
        self.eplb = None  # no EPLB: forward_local ticks nothing
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.model = SimpleNamespace(
            cfg=SimpleNamespace(hidden_size=4),
            forward_idle=lambda: None,
            compute_logits=lambda h: torch.zeros(h.shape[0], 8),
        )

    def set_step_phase(self, decode: bool, max_tokens: int = 0) -> None:
        self.phases.append((decode, max_tokens))


def test_forward_local_sets_the_headers_phase_then_clears_it() -> None:
    """What each rank does with the header: the phase is set for the forward (an idle rank
    too) and cleared after it, so a later speculative forward never inherits it."""
    from dsv3serve.engine.group.dp import forward_local

    runner = RecordingRunnerFake()
    logits = forward_local(runner, [], StepShape(0, True, 5))  # type: ignore[arg-type]
    assert logits.shape == (0, 8) and runner.phases == [(True, 5), (False, 0)]
