"""Planning a CUDA-graph MLA wrapper with one copy and flashinfer's C++ scheduler alone.

``BatchMLAPagedAttentionWrapper.plan`` (flashinfer 0.6.18) in ``use_cuda_graph`` mode does
three things: copies ``qo_indptr``, ``kv_indptr``, ``kv_indices`` and ``kv_len`` into the
wrapper's fixed device buffers (four copies), records what it was planned for (dtypes, page
size, scale, causal), and runs the C++ work scheduler on the host arrays, whose result
(``_plan_info``) the next ``run`` reads. On an H200 the Python around the scheduler cost as
much as the scheduler (`docs/perf/latency_h200.md`).

Here the four device buffers of a slot are views of ONE device buffer mirrored by one pinned
host buffer (:class:`GraphIndexBuffers`): the host writes the arrays, one copy moves them,
and a wrapper planned before for the same shape of problem only reruns the scheduler
(:func:`replan`). The first plan of a wrapper, or one for anything else (causality, page
size, dtypes), goes through ``plan`` as before. SGLang plans its MLA decode wrappers the
same way for the same reason.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_PLANNED = ("_cached_module", "_plan_info", "_causal", "_page_size", "_sm_scale", "_q_data_type")


class GraphIndexBuffers:
    """The fixed index arrays CUDA-graph wrappers of one slot plan into, as views of one
    device buffer, and a pinned host mirror of it (unpinned off CUDA).

    The mirror is rewritten by every :meth:`upload`; the caller must have waited for the
    copy of the previous upload (the backend waits for its previous plan).
    """

    def __init__(self, max_batch_size: int, max_kv_indices: int, device: torch.device) -> None:
        n = max_batch_size
        self._offsets = [0, n + 1, 2 * n + 2, 3 * n + 2, 3 * n + 2 + max_kv_indices]
        with torch.inference_mode(False):  # filled later, maybe outside inference mode
            self.device_flat = torch.zeros(self._offsets[-1], dtype=torch.int32, device=device)
            host = torch.zeros(self._offsets[-1], dtype=torch.int32)
            self.host_flat = host.pin_memory() if device.type == "cuda" else host
        self.qo, self.kv_indptr, self.kv_lens, self.kv_indices = self._views(self.device_flat)
        self._host = self._views(self.host_flat)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        o = self._offsets
        return [flat[o[i] : o[i + 1]] for i in range(4)]

    def upload(
        self, qo: np.ndarray, indptr: np.ndarray, lens: np.ndarray, indices: np.ndarray
    ) -> list[torch.Tensor]:
        """The arrays into the device buffers in one copy; returns the host views of
        ``qo``, ``indptr`` and ``lens`` (what the scheduler reads)."""
        b, used = len(lens), self._offsets[3] + len(indices)
        host = [t.numpy() for t in self._host]
        host[0][: b + 1], host[1][: b + 1], host[2][:b] = qo, indptr, lens
        host[3][: len(indices)] = indices
        self.device_flat[:used].copy_(self.host_flat[:used], non_blocking=True)
        return [self._host[0][: b + 1], self._host[1][: b + 1], self._host[2][:b]]


def can_replan(wrapper: Any, causal: bool, page_size: int, sm_scale: float, dtype: Any) -> bool:
    """Whether ``wrapper`` was planned before for this kind of problem (then only the
    scheduler must run again)."""
    if not all(hasattr(wrapper, name) for name in _PLANNED):
        return False
    return (
        wrapper._plan_info is not None
        and wrapper._causal == causal
        and wrapper._page_size == page_size
        and wrapper._sm_scale == sm_scale
        and wrapper._q_data_type == dtype
        and getattr(wrapper, "_kv_data_type", dtype) == dtype
    )


def replan(wrapper: Any, host: list[torch.Tensor], num_heads: int, head_dim_ckv: int) -> None:
    """Rerun the wrapper's C++ scheduler on the host arrays ``[qo, kv_indptr, kv_lens]``
    (already copied to its device buffers by :meth:`GraphIndexBuffers.upload`)."""
    qo, indptr, lens = host
    wrapper._plan_info = wrapper._cached_module.plan(
        wrapper._float_workspace_buffer,
        wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer,
        qo,
        indptr,
        lens,
        num_heads,
        head_dim_ckv,
        wrapper._causal,
    )
