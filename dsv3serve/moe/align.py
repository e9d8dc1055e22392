"""Token -> expert sorting into blocks of ``block_m`` rows that each belong to one expert.

The router's choices ``topk_ids`` [T, k] are read as ``M = T * k`` assignments; assignment
``a = t * k + j`` is token ``t``'s ``j``-th expert. :class:`ExpertBlocks` lists them grouped by
expert, each expert's run padded to a multiple of ``block_m`` with the sentinel ``M``, so a GEMM
program can take one block and one expert's weights. A negative id marks an assignment this
rank does not compute (an expert held by another EP rank): it is in no block. Nothing here
reads a device value on the host: buffer sizes follow from ``M``, ``E`` and ``block_m`` alone
(at most ``min(M, E)`` experts are hit, each wasting at most ``block_m - 1`` rows), which
keeps the path CUDA-graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv3serve.kernels.fp8_quant import HAS_TRITON, JitKernel

if HAS_TRITON:
    import triton
    import triton.language as tl


@dataclass(frozen=True)
class ExpertBlocks:
    """Assignments sorted by expert and padded per expert to multiples of ``block_m``.

    - ``sorted_ids`` int32 [max_blocks * block_m]: assignment indices (``t * k + j``); padding
      holds ``num_assign``; entries at or past ``num_padded`` are unspecified;
    - ``expert_ids`` int32 [max_blocks]: the expert of each block, -1 past ``num_padded``;
    - ``num_padded`` int32 [1] (on the device): rows in use, a multiple of ``block_m``.

    Within an expert the order of its assignments is unspecified (the kernel uses atomics).
    """

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_assign: int

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.numel()


def max_blocks(num_assign: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing of ``num_assign`` assignments over ``num_experts``."""
    rows = num_assign + min(num_assign, num_experts) * (block_m - 1)
    return -(-rows // block_m)


def _count_body(ids_ptr, counts_ptr, num_assign, BLOCK: tl.constexpr):
    """counts[e] += number of assignments to expert e (counts int32 [E], zeroed before)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < num_assign, other=-1).to(tl.int32)
    tl.atomic_add(counts_ptr + e, 1, mask=e >= 0)


def _plan_body(
    counts_ptr, cursor_ptr, expert_ids_ptr, sorted_ptr, padded_ptr, num_assign, n_blocks,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Pad each expert's count to BLOCK_M and lay the experts out in order; program p handles
    blocks [p * CHUNK, (p + 1) * CHUNK) and every program recomputes the (cheap) prefix sum.

    Writes expert_ids[b] = the expert owning rows [b * BLOCK_M, (b + 1) * BLOCK_M) (-1 past the
    total) and the sentinel ``num_assign`` into its sorted rows below the total (the scatter
    overwrites the real ones); program 0 also writes cursor[e] = first row of expert e and
    padded = total rows.
    """
    pid = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(cursor_ptr + e, ends - padded, mask=(e < E) & (pid == 0))
    tl.store(padded_ptr, total, mask=pid == 0)
    blocks = pid * CHUNK + tl.arange(0, CHUNK)
    first_row = blocks * BLOCK_M
    # the owner is the number of experts that end at or before the block's first row
    owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
    owner = tl.where(first_row < total, owner, -1)
    tl.store(expert_ids_ptr + blocks, owner, mask=blocks < n_blocks)
    rows = pid * CHUNK * BLOCK_M + tl.arange(0, CHUNK * BLOCK_M)
    sentinel = tl.zeros((CHUNK * BLOCK_M,), dtype=tl.int32) + num_assign
    tl.store(sorted_ptr + rows, sentinel, mask=rows < total)


def _scatter_body(ids_ptr, cursor_ptr, sorted_ptr, num_assign, BLOCK: tl.constexpr):
    """sorted[cursor[e]++] = a for every assignment a to expert e >= 0 (atomic, any order)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < num_assign, other=-1).to(tl.int32)
    ok = e >= 0
    slot = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
    tl.store(sorted_ptr + slot, offs, mask=ok)


_count_kernel: JitKernel = triton.jit(_count_body) if HAS_TRITON else None
_plan_kernel: JitKernel = triton.jit(_plan_body) if HAS_TRITON else None
_scatter_kernel: JitKernel = triton.jit(_scatter_body) if HAS_TRITON else None
_ASSIGN_BLOCK = 1024


@torch.compiler.disable  # opaque to torch.compile: Inductor fails to re-emit our Triton kernels
def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort assignments by expert with the Triton kernels (count, plan, scatter).

    topk_ids [T, k] int32 or int64 with values in [0, num_experts), or negative to skip.
    """
    m = topk_ids.numel()
    flat = topk_ids.reshape(-1)
    dev = topk_ids.device
    n_blocks = max_blocks(m, num_experts, block_m)
    sorted_ids = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.zeros(1, dtype=torch.int32, device=dev)
    blocks = ExpertBlocks(sorted_ids, expert_ids, num_padded, block_m, m)
    if m == 0:
        expert_ids.fill_(-1)
        return blocks
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(m, _ASSIGN_BLOCK),)
    _count_kernel[grid](flat, counts, m, BLOCK=_ASSIGN_BLOCK)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(1, min(64, 8192 // e_pad))  # [chunk, E_PAD] owner comparisons per program
    _plan_kernel[(triton.cdiv(n_blocks, chunk),)](
        counts, cursor, expert_ids, sorted_ids, num_padded, m, n_blocks,
        E=num_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, num_warps=4,
    )  # fmt: skip
    _scatter_kernel[grid](flat, cursor, sorted_ids, m, BLOCK=_ASSIGN_BLOCK)
    return blocks


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> ExpertBlocks:
    """Torch oracle of :func:`moe_align_block_size` (any device, no host sync); within an
    expert, assignments keep ascending order; negative ids are skipped."""
    m = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    dev = topk_ids.device
    n_blocks = max_blocks(m, num_experts, block_m)
    valid = flat >= 0
    bucket = torch.where(valid, flat, num_experts)  # skipped assignments: a bucket past the end
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = torch.cat([ends - padded, ends[-1:] if num_experts else padded.new_zeros(1)])
    order = torch.sort(bucket, stable=True).indices
    by_expert = bucket[order]
    rank = torch.arange(m, device=dev) - (counts.cumsum(0) - counts)[by_expert]
    dest = torch.where(by_expert < num_experts, starts[by_expert] + rank, n_blocks * block_m)
    sorted_ids = torch.full((n_blocks * block_m + 1,), m, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.int()  # skipped ones land in the dropped last slot
    first_rows = torch.arange(n_blocks, device=dev) * block_m
    owner = torch.searchsorted(ends, first_rows, right=True)
    total = ends[-1:] if num_experts else torch.zeros(1, dtype=torch.long, device=dev)
    expert_ids = torch.where(first_rows < total, owner, -1).int()
    return ExpertBlocks(sorted_ids[:-1], expert_ids, total.int(), block_m, m)
