"""A fake of the part of DeepEP's Python API that ``dispatch_deepep`` uses, over gloo.

DeepEP needs GPUs with NVLink / NVSHMEM; this fake has the same call signatures and return
tuples (``deep_ep.Buffer``: ``get_dispatch_layout``, ``dispatch``, ``combine``,
``clean_low_latency_buffer``, ``low_latency_dispatch``, ``low_latency_combine``; the static
size hints; ``topk_idx_t``) and moves the data with ``torch.distributed.all_to_all_single``
between real processes. What it keeps of DeepEP's behaviour:

* normal mode: rows arrive grouped by source rank in token order, with local top-k ids
  (``-1`` and weight 0 for experts elsewhere); ``combine`` sums without weights; e4m3 input
  is a tuple ``(x, scales)`` and comes back as one.
* low-latency mode: [E_local, max_tokens * W, H] per expert, only ``recv_count[e]`` rows
  valid, padding filled with NaN (DeepEP leaves stale data there), FP8 scales with the
  column-major strides DeepEP gives them; ``low_latency_combine`` applies the weights.

``make_module(corrupt=True)`` gives a fake whose combine returns wrong sums, for the
self-check refusal path. Handles are opaque tuples of the real arity; their contents are
the fake's own.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import Tensor

from dsv3serve.kernels.fp8_ref import quant_per_token_group

topk_idx_t = torch.int64


class FakeConfig:
    """Stands for ``deep_ep.Config``; only the NVLink size hint is asked of it."""

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * 4096


class FakeEvent:
    """Stands for ``deep_ep.EventOverlap`` (everything here finishes synchronously)."""

    def current_stream_wait(self) -> None:
        return None


def _bytes(t: Tensor) -> Tensor:
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)


def _exchange(rows: Tensor, counts: list[int], group: dist.ProcessGroup) -> tuple[Tensor, list]:
    """Send ``rows`` [S, ...] split by ``counts`` per rank; returns received rows and counts."""
    w = dist.get_world_size(group)
    recv_counts = torch.empty(w, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, torch.tensor(counts, dtype=torch.int64), group=group)
    rc = recv_counts.tolist()
    payload = _bytes(rows)
    out = payload.new_empty(sum(rc), payload.shape[1])
    dist.all_to_all_single(out, payload, rc, counts, group=group)
    return out.view(rows.dtype).reshape(sum(rc), *rows.shape[1:]), rc


def _a2a(parts: list[Tensor], group: dist.ProcessGroup) -> tuple[Tensor, list[int]]:
    """Send ``parts[r]`` to rank r; all parts share trailing shape and dtype."""
    return _exchange(torch.cat(parts), [p.shape[0] for p in parts], group)


class FakeBuffer:
    """``deep_ep.Buffer`` over gloo: the same methods and returns, CPU tensors."""

    corrupt = False

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        explicitly_destroy: bool = False,
        **_: object,
    ) -> None:
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.explicitly_destroy, self.destroyed = explicitly_destroy, False
        self.low_latency_mode = low_latency_mode
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.cleans = 0
        if low_latency_mode:
            self.nvshmem_qp_depth = 1024  # DeepEP's default NVSHMEM_QP_DEPTH

    def destroy(self) -> None:
        """As DeepEP's: only for a buffer made with ``explicitly_destroy``, once, and a
        barrier with every rank of the group (a rank that skips it hangs the others)."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        assert not self.destroyed, "destroyed twice"
        dist.barrier(group=self.group)
        self.destroyed = True

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> FakeConfig:
        return FakeConfig()

    @staticmethod
    def get_combine_config(num_ranks: int) -> FakeConfig:
        return FakeConfig()

    @staticmethod
    def get_low_latency_rdma_size_hint(
        max_tokens: int, hidden: int, ranks: int, experts: int
    ) -> int:
        return 2 * max_tokens * hidden * 2 * experts

    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, **_: object) -> tuple:
        assert topk_idx.dtype == topk_idx_t
        local = num_experts // self.group_size
        rank_of = torch.where(topk_idx >= 0, topk_idx // local, -1)
        in_rank = torch.stack([(rank_of == r).any(1) for r in range(self.group_size)], 1)
        per_rank = in_rank.sum(0).int()
        valid = topk_idx[topk_idx >= 0]
        per_expert = torch.bincount(valid, minlength=num_experts).int()
        return per_rank, None, per_expert, in_rank, FakeEvent()

    def dispatch(self, x: Tensor | tuple[Tensor, Tensor], *, num_tokens_per_rank: Tensor,
                 num_tokens_per_rdma_rank: Tensor | None, is_token_in_rank: Tensor,
                 num_tokens_per_expert: Tensor, topk_idx: Tensor, topk_weights: Tensor,
                 **_: object) -> tuple:  # fmt: skip
        q, scales = x if isinstance(x, tuple) else (x, None)
        assert q.dtype in (torch.bfloat16, torch.float8_e4m3fn), q.dtype
        local = num_tokens_per_expert.shape[0] // self.group_size
        tok = [is_token_in_rank[:, r].nonzero()[:, 0] for r in range(self.group_size)]
        recv_x, counts = _a2a([q[t] for t in tok], self.group)
        recv_s = _a2a([scales[t] for t in tok], self.group)[0] if scales is not None else None
        local_ids = [self._local_ids(topk_idx[t], r, local) for r, t in enumerate(tok)]
        ids = _a2a(local_ids, self.group)[0]
        w = _a2a([topk_weights[t] for t in tok], self.group)[0]
        w = torch.where(ids >= 0, w, 0.0)
        per_expert = [int((ids == e).sum()) for e in range(local)]
        handle = (counts, None, None, tok, is_token_in_rank, q.shape[0])
        out = (recv_x, recv_s) if scales is not None else recv_x
        return out, ids, w, per_expert, handle, FakeEvent()

    @staticmethod
    def _local_ids(ids: Tensor, rank: int, local: int) -> Tensor:
        mine = (ids >= rank * local) & (ids < (rank + 1) * local)
        return torch.where(mine, ids - rank * local, -1)

    def combine(self, x: Tensor, handle: tuple, topk_weights: Tensor | None = None,
                **_: object) -> tuple:  # fmt: skip
        recv_counts, _, _, tok, _, num_tokens = handle
        back, _ = _exchange(x.float(), recv_counts, self.group)
        out = torch.zeros(num_tokens, x.shape[1])
        out.index_add_(0, torch.cat(tok), back)
        if self.corrupt:
            out = out * 2 + 1
        return out.to(x.dtype), None, FakeEvent()

    def clean_low_latency_buffer(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        self.cleans += 1

    # -- low-latency mode --------------------------------------------------------------

    def _ll_send(self, x: Tensor, topk_idx: Tensor, local: int, use_fp8: bool) -> tuple:
        """Per destination rank: rows, scales and (token, local expert) of each (t, k)."""
        q, s = quant_per_token_group(x) if use_fp8 else (x, x.new_zeros(x.shape[0], 1).float())
        rows, scales, meta = [], [], []
        for r in range(self.group_size):
            t, k = ((topk_idx >= r * local) & (topk_idx < (r + 1) * local)).nonzero(as_tuple=True)
            rows.append(q[t])
            scales.append(s[t])
            meta.append(torch.stack([t, topk_idx[t, k] - r * local], 1))
        return rows, scales, meta

    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             use_fp8: bool = True, **_: object) -> tuple:  # fmt: skip
        assert self.low_latency_mode, "the buffer was not made with low_latency_mode"
        assert x.dtype == torch.bfloat16 and topk_idx.dtype == topk_idx_t
        m, w = num_max_dispatch_tokens_per_rank, self.group_size
        assert x.shape[0] <= m, f"{x.shape[0]} tokens > num_max_dispatch_tokens_per_rank {m}"
        local = num_experts // w
        rows, scales, meta = self._ll_send(x, topk_idx, local, use_fp8)
        recv_rows, counts = _a2a(rows, self.group)
        recv_scales, recv_meta = _a2a(scales, self.group)[0], _a2a(meta, self.group)[0]
        src_rank = torch.repeat_interleave(torch.arange(w), torch.tensor(counts))
        q = torch.full((local, w * m, x.shape[1]), float("nan"), dtype=torch.bfloat16)
        q = q.to(torch.float8_e4m3fn) if use_fp8 else q
        s = torch.full((local, w * m, recv_scales.shape[1]), float("nan"))
        src_info = torch.full((local, w * m), -1, dtype=torch.int32)
        layout = torch.zeros(local, w, dtype=torch.int64)
        recv_count = torch.zeros(local, dtype=torch.int32)
        for e in range(local):
            pick = (recv_meta[:, 1] == e).nonzero()[:, 0]  # by source rank, then token
            n = pick.numel()
            q[e, :n], s[e, :n], src_info[e, :n] = (
                recv_rows[pick],
                recv_scales[pick],
                recv_meta[pick, 0].int(),
            )
            per_src = torch.bincount(src_rank[pick], minlength=w)
            begin = torch.cumsum(per_src, 0) - per_src
            layout[e] = (begin << 32) | per_src
            recv_count[e] = n
        handle = (src_info, layout, m, x.shape[1], num_experts)
        s_col_major = s.transpose(1, 2).contiguous().transpose(1, 2)
        out = (q, s_col_major) if use_fp8 else q
        return out, recv_count, handle, FakeEvent(), lambda: None

    def low_latency_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
                            handle: tuple, **_: object) -> tuple:  # fmt: skip
        assert x.dtype == torch.bfloat16, x.dtype
        src_info, layout, m, hidden, num_experts = handle
        local, w = layout.shape
        assert x.shape == (local, w * m, hidden), (tuple(x.shape), (local, w * m, hidden))
        rows, meta = [], []
        for r in range(w):
            r_rows, r_meta = [], []
            for e in range(local):
                begin, n = int(layout[e, r] >> 32), int(layout[e, r] & 0xFFFFFFFF)
                r_rows.append(x[e, begin : begin + n].float())
                tok = src_info[e, begin : begin + n].long()
                r_meta.append(torch.stack([tok, torch.full_like(tok, self.rank * local + e)], 1))
            rows.append(torch.cat(r_rows))
            meta.append(torch.cat(r_meta))
        back, _ = _a2a(rows, self.group)
        back_meta = _a2a(meta, self.group)[0]
        tok, expert = back_meta[:, 0], back_meta[:, 1]
        hit = topk_idx[tok] == expert[:, None]
        weight = (topk_weights[tok].float() * hit).sum(1, keepdim=True)
        out = torch.zeros(topk_idx.shape[0], hidden)
        out.index_add_(0, tok, back * weight)
        if self.corrupt:
            out = out * 2 + 1
        return out.to(torch.bfloat16), FakeEvent(), lambda: None


class CorruptFakeBuffer(FakeBuffer):
    """A fake that returns wrong combine sums (the self-check must refuse it)."""

    corrupt = True


def make_module(corrupt: bool = False) -> SimpleNamespace:
    """A stand-in for the ``deep_ep`` module: ``Buffer``, ``Config``, ``topk_idx_t``."""
    buffer = CorruptFakeBuffer if corrupt else FakeBuffer
    return SimpleNamespace(
        Buffer=buffer, Config=FakeConfig, topk_idx_t=topk_idx_t, __name__="fake_deep_ep"
    )
