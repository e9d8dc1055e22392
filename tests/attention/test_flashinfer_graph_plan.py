"""GraphIndexBuffers and the replan condition, on the CPU (the replan itself: GPU tests)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from dsv3serve.attention.flashinfer_graph_plan import GraphIndexBuffers, can_replan


def test_upload_fills_the_four_device_views_in_one_buffer() -> None:
    bufs = GraphIndexBuffers(4, 16, torch.device("cpu"))
    host = bufs.upload(
        np.array([0, 1, 2], np.int32), np.array([0, 3, 5], np.int32),
        np.array([130, 70], np.int32), np.array([9, 4, 7, 2, 8], np.int32),
    )  # fmt: skip
    assert bufs.qo[:3].tolist() == [0, 1, 2] and bufs.kv_indptr[:3].tolist() == [0, 3, 5]
    assert bufs.kv_lens[:2].tolist() == [130, 70]
    assert bufs.kv_indices[:5].tolist() == [9, 4, 7, 2, 8]
    assert [t.tolist() for t in host] == [[0, 1, 2], [0, 3, 5], [130, 70]]
    views = (bufs.qo, bufs.kv_indptr, bufs.kv_lens, bufs.kv_indices)
    assert all(v.untyped_storage().data_ptr() == bufs.device_flat.data_ptr() for v in views)


def _planned(**over: object) -> SimpleNamespace:
    """A stand-in (fake) for a flashinfer wrapper after one full plan."""
    fields = dict(
        _cached_module=object(), _plan_info=[1], _causal=False, _page_size=64,
        _sm_scale=0.1, _q_data_type=torch.bfloat16, _kv_data_type=torch.bfloat16,
    )  # fmt: skip
    fields.update(over)
    return SimpleNamespace(**fields)


def test_replan_only_for_the_problem_the_wrapper_was_planned_for() -> None:
    bf16 = torch.bfloat16
    assert can_replan(_planned(), False, 64, 0.1, bf16)
    assert not can_replan(SimpleNamespace(), False, 64, 0.1, bf16)  # never planned
    assert not can_replan(_planned(_plan_info=None), False, 64, 0.1, bf16)
    assert not can_replan(_planned(), True, 64, 0.1, bf16)  # verify's causal mask
    assert not can_replan(_planned(), False, 1, 0.1, bf16)  # token-granular pages
    assert not can_replan(_planned(), False, 64, 0.2, bf16)
    assert not can_replan(_planned(), False, 64, 0.1, torch.float16)
