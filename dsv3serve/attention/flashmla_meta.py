"""Host-side planning for the FlashMLA backend: block tables, sequence lengths and query
groups, and the fixed device buffers of its CUDA-graph path. Pure torch and numpy (no
``flash_mla`` import), so it is tested on the CPU.

FlashMLA's dense decode takes the batch as ``q`` [B, s_q, H, 576], one block table
[B, W] (int32 page ids, row ``b`` lists sequence ``b``'s pages in order; entries past its
pages are never read) and ``cache_seqlens`` [B] (int32, tokens in the cache including the
new ones). Every sequence of one call has the same ``s_q``: a decode step (1) or a
speculative verify (``k + 1``) is one call; a batch whose sequences add different numbers
of tokens is split into one :class:`QueryGroup` per count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsv3serve.attention.flashinfer_meta import KVIndex, batch_kv_index
from dsv3serve.forward_batch import ForwardBatch


@dataclass(frozen=True)
class QueryGroup:
    """The sequences of a batch that add ``s_q`` tokens each, as one kernel call's inputs.

    ``rows``: the batch's token rows of the group, sequence by sequence ([n * s_q] int64,
    host); None when the group is the whole batch in order. ``block_table`` [n, width] and
    ``seq_lens`` [n] are int32 host arrays.
    """

    s_q: int
    rows: np.ndarray | None
    block_table: np.ndarray
    seq_lens: np.ndarray

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def block_table(index: KVIndex, width: int = 0) -> np.ndarray:
    """[B, max(width, most pages of a sequence)] int32: row ``b`` holds sequence ``b``'s
    pages from ``index`` in order, then zeros (page 0 is a valid id; never read)."""
    indptr = index.indptr.numpy().astype(np.int64)
    counts = np.diff(indptr)
    need = int(counts.max(initial=0))
    if width and need > width:
        raise ValueError(f"a sequence needs {need} pages, over the block table width {width}")
    table = np.zeros((len(counts), max(width, need, 1)), dtype=np.int32)
    rows = np.repeat(np.arange(len(counts)), counts)
    cols = np.arange(int(indptr[-1])) - np.repeat(indptr[:-1], counts)
    table[rows, cols] = index.indices.numpy()
    return table


def paged_index(batch: ForwardBatch, page_size: int) -> KVIndex:
    """The batch's page-granular KV index; ValueError when its slots do not fill pages of
    ``page_size`` in order (FlashMLA has no token-granular addressing)."""
    index, fallback = batch_kv_index(batch, page_size, paged=True)
    if fallback or index.page_size != page_size:
        raise ValueError(
            f"attention backend 'flashmla' reads whole pages of {page_size} tokens: {fallback}"
        )
    return index


def query_groups(batch: ForwardBatch, page_size: int, width: int = 0) -> list[QueryGroup]:
    """The batch as kernel calls: one group for a uniform batch (``rows`` None), else one
    per distinct number of new tokens, in increasing order."""
    index = paged_index(batch, page_size)
    table, lens = block_table(index, width), index.lens.numpy().astype(np.int32)
    qo = np.asarray(batch.qo_indptr, dtype=np.int64)
    q_lens = np.diff(qo)
    counts = np.unique(q_lens)
    if len(counts) == 1:
        return [QueryGroup(int(counts[0]), None, table, lens)]
    groups = []
    for s_q in counts.tolist():
        seqs = np.flatnonzero(q_lens == s_q)
        rows = (np.repeat(qo[seqs], s_q) + np.tile(np.arange(s_q), len(seqs))).astype(np.int64)
        groups.append(QueryGroup(s_q, rows, table[seqs], lens[seqs]))
    return groups


class GraphTables:
    """Fixed device buffers of the CUDA-graph path, so a graph captured after one plan
    replays correctly after a later plan of the same shape.

    Per slot (a layout planned while others stay planned: decode, verify, draft steps):
    one int32 buffer holding a block table [max_batch_size, width] and the sequence
    lengths [max_batch_size]; a batch of ``B`` uses the first ``B`` rows. Per (slot, B,
    s_q): the scheduler metadata's two tensors, allocated at the first plan of that key
    (their shapes depend only on the key) and overwritten by every later plan.
    """

    def __init__(self, max_batch_size: int, width: int, device: torch.device) -> None:
        self.max_batch_size, self.width, self.device = max_batch_size, width, device
        self._tables: dict[str, torch.Tensor] = {}
        self._meta: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch_size

    def load(self, slot: str, group: QueryGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the group's block table (padded to ``width``) and lengths into the slot's
        buffer in one copy (stream-ordered: after earlier replays read it); returns the
        [B, width] and [B] views."""
        b, w = group.num_seqs, self.width
        table = group.block_table
        if table.shape[1] < w:
            table = np.pad(table, ((0, 0), (0, w - table.shape[1])))
        if table.shape[1] != w:
            raise ValueError(f"expected a block table of width <= {w}, got {table.shape[1]}")
        host = torch.from_numpy(np.concatenate([table.reshape(-1), group.seq_lens]))
        flat = self._flat(slot)
        if self.device.type == "cuda":
            host = host.pin_memory()
        flat[: host.numel()].copy_(host, non_blocking=True)
        return flat[: b * w].view(b, w), flat[b * w : b * w + b]

    def _flat(self, slot: str) -> torch.Tensor:
        if slot not in self._tables:
            n = self.max_batch_size * (self.width + 1)
            with torch.inference_mode(False):  # filled later, maybe outside inference mode
                self._tables[slot] = torch.zeros(n, dtype=torch.int32, device=self.device)
        return self._tables[slot]

    def keep_metadata(
        self, key: tuple[str, int, int], metadata: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy freshly computed scheduler metadata into the fixed tensors of ``key``
        (slot, batch size, s_q); returns those."""
        if key not in self._meta:
            with torch.inference_mode(False):
                self._meta[key] = (torch.empty_like(metadata[0]), torch.empty_like(metadata[1]))
        kept = self._meta[key]
        for fixed, fresh in zip(kept, metadata, strict=True):
            if fixed.shape != fresh.shape:
                raise RuntimeError(
                    f"FlashMLA scheduler metadata of {key}: expected shape {list(fixed.shape)} "
                    f"(captured), got {list(fresh.shape)}"
                )
            fixed.copy_(fresh)
        return kept
