"""StaticInputs: a graph's inputs filled from the host in one copy (CPU: unpinned stages)."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.engine.static_inputs import StaticInputs
from dsv3serve.forward_batch import ForwardBatch, SeqSpan

PAGE = 4
FILL = 99


def _spans() -> list[SeqSpan]:
    return [
        SeqSpan([7], 5, sample=True, page_table=[3, 1], page_size=PAGE),
        SeqSpan([8], 2, sample=True, page_table=[2], page_size=PAGE),
        SeqSpan([9], 0, sample=True, page_table=[0], page_size=PAGE),
    ]


def test_build_matches_the_plain_batch_and_points_into_the_buffers() -> None:
    static = StaticInputs(8, FILL, torch.device("cpu"))
    spans = _spans()
    plain = ForwardBatch.build(spans, "cpu", decode=True)
    built = static.build(spans, real=2)
    for name in ("input_ids", "positions", "out_slots", "logits_indices"):
        assert torch.equal(getattr(built, name), getattr(plain, name)), name
    assert built.kv_indptr == plain.kv_indptr and built.qo_indptr == plain.qo_indptr
    assert built.input_ids.data_ptr() == static.ids.data_ptr()
    assert built.out_slots.data_ptr() == static.out.data_ptr()
    assert int(static.real) == 2


def test_a_shorter_batch_resets_the_tail_to_the_defaults() -> None:
    static = StaticInputs(8, FILL, torch.device("cpu"))
    static.build(_spans())
    short = static.build(_spans()[:1])
    assert short.num_tokens == 1 and int(static.real) == 1
    assert static.ids[1:].eq(0).all() and static.pos[1:].eq(0).all()
    assert static.out[1:].eq(FILL).all()
    assert int(static.out[0]) == 1 * PAGE + 1  # position 5: row 1 of its second page (1)


def test_more_tokens_than_the_buffers_hold_are_refused() -> None:
    static = StaticInputs(2, FILL, torch.device("cpu"))
    with pytest.raises(ValueError, match="at most 2 graph tokens, got 3"):
        static.build(_spans())


def test_buffers_made_in_inference_mode_fill_outside_it() -> None:
    with torch.inference_mode():
        static = StaticInputs(8, FILL, torch.device("cpu"))
    static.build(_spans())  # an inference tensor would refuse this in-place fill
    assert int(static.real) == 3
