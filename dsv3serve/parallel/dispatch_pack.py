"""Routing plan and wire format shared by the dispatch backends (no collectives here).

A token goes once to every rank that owns at least one of its top-k experts (global expert
``e`` lives on rank ``e // num_local_experts``). :func:`plan_routes` lists those (token, rank)
copies sorted by destination rank, all vectorised (no Python loop over tokens or experts).

Each copy travels as one row of a ``uint8`` buffer, so a single ``all_to_all_single`` moves
the hidden state and its routing together, whatever the hidden dtype::

    [ weights f32 x K | local ids i32 x K | scales f32 x G (fp8 only) | hidden H x itemsize | pad ]

The 4-byte fields come first so every field is aligned; the row is padded to 16 bytes. Local
ids are ``-1`` (weight 0) in the slots whose expert lives on another rank. With an fp8
payload the hidden state is quantised per token per 128 channels (``kernels.fp8_ref``) and
its ``G = ceil(H / 128)`` float32 scales ride in the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, dequant_per_token_group
from dsv3serve.kernels.fp8_ref import quant_per_token_group as quant_group

_ROW_ALIGN = 16
PAYLOAD_DTYPES = (None, FP8_DTYPE)


def check_payload_dtype(payload_dtype: torch.dtype | None) -> torch.dtype | None:
    """``payload_dtype`` if it is one the wire format sends (None: rows as they are)."""
    if payload_dtype not in PAYLOAD_DTYPES:
        raise ValueError(f"payload_dtype: expected one of {PAYLOAD_DTYPES}, got {payload_dtype}")
    return payload_dtype


def check_routing(x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> None:
    """Refuse inputs whose shapes do not agree (shapes only: no host sync)."""
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"expected x [T, H], topk_ids [T, K] and topk_weights [T, K], got x "
            f"{list(x.shape)}, topk_ids {list(topk_ids.shape)}, "
            f"topk_weights {list(topk_weights.shape)}"
        )
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"expected one routing row per token ({x.shape[0]}), got {topk_ids.shape[0]}"
        )


@dataclass(frozen=True)
class RoutePlan:
    """The copies one rank sends, sorted by destination rank (then by token).

    ``src_token`` [S] int64: the source token of each copy; ``local_ids`` [S, K] int32 expert
    ids local to the destination (``-1`` elsewhere); ``weights`` [S, K] float32 (0 where the
    id is ``-1``).
    """

    src_token: Tensor
    local_ids: Tensor
    weights: Tensor


def _destinations(topk_ids: Tensor, num_local_experts: int) -> tuple[Tensor, Tensor]:
    """(destination rank [T, K], valid [T, K]); ids ``< 0`` are slots with no expert."""
    valid = topk_ids >= 0
    return torch.where(valid, topk_ids // num_local_experts, 0), valid


def copy_mask(topk_ids: Tensor, num_local_experts: int, world: int) -> Tensor:
    """[T, W] bool: token t has at least one of its experts on rank r (no host sync).
    ``copy_mask(...).sum(0)`` is the number of copies sent to each rank."""
    dest, valid = _destinations(topk_ids, num_local_experts)
    hits = torch.zeros(dest.shape[0], world, dtype=torch.int32, device=dest.device)
    hits.scatter_add_(1, dest, valid.to(torch.int32))
    return hits > 0


def _copies(mask: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """(dest rank [S], source token [S]) of the ``total`` True entries, rank-major: a stable
    sort puts the True entries of ``mask.T`` first, in rank-then-token order."""
    num_tokens = max(mask.shape[0], 1)
    flat = (~mask.t()).reshape(-1).to(torch.uint8)
    picked = torch.sort(flat, stable=True).indices[:total]
    return picked // num_tokens, picked % num_tokens


def plan_routes(
    topk_ids: Tensor, topk_weights: Tensor, num_local_experts: int, mask: Tensor, total: int
) -> RoutePlan:
    """Plan the copies of ``topk_ids`` [T, K] (global ids, ``< 0``: no expert) given their
    :func:`copy_mask` and its number of True entries ``total`` (the caller's host sync)."""
    dest, valid = _destinations(topk_ids, num_local_experts)
    dest_rank, src_token = _copies(mask, total)
    here = valid[src_token] & (dest[src_token] == dest_rank[:, None])
    local = topk_ids[src_token] - dest_rank[:, None] * num_local_experts
    local_ids = torch.where(here, local, -1).to(torch.int32)
    weights = torch.where(here, topk_weights[src_token].float(), 0.0)
    return RoutePlan(src_token, local_ids, weights)


@dataclass(frozen=True)
class WireFormat:
    """Byte layout of one dispatched row for hidden size ``hidden``, ``topk`` slots, hidden
    dtype ``dtype``, sent as ``payload_dtype`` (``None``: as is; ``float8_e4m3fn``)."""

    hidden: int
    topk: int
    dtype: torch.dtype
    payload_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        check_payload_dtype(self.payload_dtype)

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.dtype if self.payload_dtype is None else self.payload_dtype

    @property
    def num_scales(self) -> int:
        return 0 if self.payload_dtype is None else -(-self.hidden // BLOCK)

    @property
    def hidden_offset(self) -> int:
        return 4 * (2 * self.topk + self.num_scales)

    @property
    def row_bytes(self) -> int:
        used = self.hidden_offset + self.hidden * self.wire_dtype.itemsize
        return -(-used // _ROW_ALIGN) * _ROW_ALIGN

    def empty(self, rows: int, device: torch.device) -> Tensor:
        """An uninitialised buffer of ``rows`` rows, [rows, row_bytes] uint8."""
        return torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=device)

    def _words(self, buf: Tensor, first: int, count: int, dtype: torch.dtype) -> Tensor:
        return buf[:, 4 * first : 4 * (first + count)].view(dtype)

    def _hidden(self, buf: Tensor) -> Tensor:
        end = self.hidden_offset + self.hidden * self.wire_dtype.itemsize
        return buf[:, self.hidden_offset : end].view(self.wire_dtype)

    def pack(self, x: Tensor, plan: RoutePlan, first: int = 0, rows: int | None = None) -> Tensor:
        """Rows ``first:first + rows`` of the plan's copies of ``x`` [T, H] -> [rows, row_bytes]
        uint8 (all copies when ``rows`` is None)."""
        end = plan.src_token.shape[0] if rows is None else first + rows
        src = plan.src_token[first:end]
        buf = self.empty(src.shape[0], x.device)
        k = self.topk
        self._words(buf, 0, k, torch.float32).copy_(plan.weights[first:end])
        self._words(buf, k, k, torch.int32).copy_(plan.local_ids[first:end])
        if self.payload_dtype is None:
            self._hidden(buf).copy_(x[src])
        elif src.shape[0]:  # quantise once per token, before the copies
            q, scale = quant_group(x)
            self._words(buf, 2 * k, self.num_scales, torch.float32).copy_(scale[src])
            self._hidden(buf).copy_(q[src])
        return buf

    def unpack(self, buf: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[R, row_bytes] uint8 -> (x [R, H] ``dtype``, local ids [R, K] int64, weights
        [R, K] float32), each contiguous."""
        k = self.topk
        weights = self._words(buf, 0, k, torch.float32).contiguous()
        ids = self._words(buf, k, k, torch.int32).long()
        return self._unpack_hidden(buf), ids, weights

    def _unpack_hidden(self, buf: Tensor) -> Tensor:
        if self.payload_dtype is None:
            return self._hidden(buf).contiguous()
        if buf.shape[0] == 0:
            return torch.empty(0, self.hidden, dtype=self.dtype, device=buf.device)
        scale = self._words(buf, 2 * self.topk, self.num_scales, torch.float32).contiguous()
        return dequant_per_token_group(self._hidden(buf), scale).to(self.dtype)


def sum_back(rows: Tensor, src_token: Tensor, num_tokens: int) -> Tensor:
    """Add the returned rows [S, H] into their source tokens: [num_tokens, H], in ``rows``'
    dtype, accumulated in float32 (a token has at most one row per rank)."""
    out = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    out.index_add_(0, src_token, rows.float())
    return out.to(rows.dtype)
