"""Host-side metadata for the flashinfer backend: KV index tables and prefix chunks.

Pure torch on the CPU (no flashinfer import), so it is tested without a GPU. flashinfer
wants int32 index arrays; ``indptr``/``lens`` stay on the host (its ``plan()`` reads them
there), ``indices`` go to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv3serve.forward_batch import ForwardBatch, KVPages


@dataclass(frozen=True)
class KVIndex:
    """Each sequence's cached tokens as flashinfer's paged-KV arrays.

    ``indices[indptr[b]:indptr[b+1]]`` are sequence ``b``'s pages, in order, each of
    ``page_size`` token rows; its first ``lens[b]`` rows are its tokens. With
    ``page_size == 1`` a page is one token slot.
    """

    page_size: int
    indptr: torch.Tensor  # [B+1] int32, host, in pages
    lens: torch.Tensor  # [B] int32, host, in tokens
    indices: torch.Tensor  # [indptr[-1]] int32 page ids (host or device)


def int32_host(values: list[int] | torch.Tensor) -> torch.Tensor:
    """An int32 CPU tensor of ``values``."""
    return torch.as_tensor(values, dtype=torch.int32, device="cpu")


def seq_lens_list(indptr: list[int]) -> list[int]:
    """Per-sequence lengths from a host indptr list."""
    return [b - a for a, b in zip(indptr[:-1], indptr[1:], strict=True)]


def seq_lens(indptr: list[int]) -> torch.Tensor:
    """Per-sequence lengths [B] (int64, host) from a host indptr list."""
    bounds = torch.tensor(indptr, dtype=torch.int64)
    return bounds[1:] - bounds[:-1]


def token_kv_index(kv_indptr: list[int], kv_slots: torch.Tensor) -> KVIndex:
    """Token-granular index: every slot is its own page (``page_size=1``).

    Always valid, whatever the slots; ``kv_slots`` may live on the device.
    """
    return KVIndex(1, int32_host(kv_indptr), seq_lens(kv_indptr).int(), kv_slots.int())


def paged_kv_index(kv_indptr: list[int], kv_slots_host: torch.Tensor, page_size: int) -> KVIndex:
    """Page-granular index, or ValueError when a sequence's slots do not fill its pages
    in order (position ``p`` of a sequence must sit at row ``p % page_size`` of its page
    ``p // page_size``, as :class:`~dsv3serve.kvcache.allocator.PageAllocator` pages are
    used by the engine). ``kv_slots_host`` is the batch's ``kv_slots`` on the CPU.
    """
    lens = seq_lens(kv_indptr)
    flat = torch.arange(int(lens.sum()))
    pos = flat - torch.repeat_interleave(torch.tensor(kv_indptr[:-1]), lens)
    offset = pos % page_size
    page_first = kv_slots_host[flat - offset]  # slot of row 0 of each token's page
    aligned = bool((page_first % page_size == 0).all())
    if not (aligned and torch.equal(kv_slots_host, page_first + offset)):
        raise ValueError(
            f"kv_slots are not page-aligned for page_size {page_size}: expected each "
            f"sequence's position p at row p % {page_size} of one page per {page_size} tokens"
        )
    pages = kv_slots_host[offset == 0] // page_size
    num_pages = -(-lens // page_size)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    torch.cumsum(num_pages, 0, out=indptr[1:])
    return KVIndex(page_size, indptr.int(), lens.int(), pages.int())


def pages_kv_index(kv_pages: KVPages) -> KVIndex:
    """Page-granular index straight from the batch's page tables: O(batch + pages), no
    per-slot check (page tables are aligned by construction)."""
    return KVIndex(
        kv_pages.page_size,
        kv_pages.page_indptr.int(),
        kv_pages.kv_lens.int(),
        kv_pages.pages.int(),
    )


def batch_kv_index(batch: ForwardBatch, page_size: int, paged: bool) -> tuple[KVIndex, str]:
    """The batch's KV index, page-granular where possible: from its page tables, else from
    page-aligned slot lists, else token-granular. Returns the index and, when a paged
    backend had to fall back to tokens, why (empty otherwise)."""
    pages = batch.kv_pages
    if paged and pages is not None and pages.page_size == page_size:
        return pages_kv_index(pages), ""
    reason = ""
    if paged and batch.kv_slots_host is not None:
        try:
            return paged_kv_index(batch.kv_indptr, batch.kv_slots_host, page_size), ""
        except ValueError as err:
            reason = str(err)
    return token_kv_index(batch.kv_indptr, batch.kv_slots), reason


class PlanStage:
    """A reused host buffer for a backend's plan arrays (pinned on CUDA), so a plan does
    not allocate one. The caller must have waited for the copies of its previous plan,
    which read the same memory (``FlashInferMLAAttention._wait_previous_plan``).
    ``owner``: the backend instance (``id``) it belongs to: attention forks are shallow
    copies and must not share one."""

    def __init__(self, owner: int, pin: bool) -> None:
        self.owner, self._pin = owner, pin
        with torch.inference_mode(False):
            self._buffer = torch.empty(0, dtype=torch.int32)

    def stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Int32 copies of ``tensors`` as views of the buffer (grown when too small)."""
        sizes = [t.numel() for t in tensors]
        total = sum(sizes)
        if self._buffer.numel() < total:
            with torch.inference_mode(False):  # a plan inside inference mode, the next not
                grown = torch.empty(max(total, 2 * self._buffer.numel()), dtype=torch.int32)
                self._buffer = grown.pin_memory() if self._pin else grown
        views = list(self._buffer[:total].split(sizes))
        for view, t in zip(views, tensors, strict=True):
            view.copy_(t.flatten())
        return views


@dataclass(frozen=True)
class PrefixChunk:
    """One chunk of the cached prefixes for the MHA extend path.

    Every sequence of the batch takes part (``kv_indptr`` over the batch, some lengths
    zero); ``kv_positions`` index the batch's flattened ``kv_slots``. ``merge_rows`` is
    None when every query row has keys in this chunk, else a [T * groups] uint8 mask of
    the rows that do, repeated per head group (see ``merge_groups``).
    """

    kv_indptr: torch.Tensor  # [B+1] int32, host
    kv_positions: torch.Tensor  # [sum of chunk lengths] int64, host
    merge_rows: torch.Tensor | None  # uint8, host


def prefix_chunks(
    qo_indptr: list[int], kv_indptr: list[int], max_tokens: int, groups: int = 1
) -> list[PrefixChunk]:
    """Split each sequence's cached prefix (its KV before its new tokens) into chunks of
    at most ``max_tokens`` keys in all, in order; no chunks when nothing is cached.

    Chunk ``c`` holds, for each sequence, a contiguous range of that sequence's prefix.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    q_lens, kv_lens = seq_lens(qo_indptr), seq_lens(kv_indptr)
    prefix = (kv_lens - q_lens).tolist()
    if min(prefix) < 0:
        raise ValueError(f"a sequence has more new tokens than KV: q {q_lens}, kv {kv_lens}")
    chunks, taken = [], [0] * len(prefix)
    while any(t < p for t, p in zip(taken, prefix, strict=True)):
        budget, spans = max_tokens, []
        for b, (t, p) in enumerate(zip(taken, prefix, strict=True)):
            n = min(p - t, budget)
            spans.append((kv_indptr[b] + t, n))
            taken[b] += n
            budget -= n
        chunks.append(_chunk(spans, q_lens, groups))
    return chunks


def _chunk(spans: list[tuple[int, int]], q_lens: torch.Tensor, groups: int) -> PrefixChunk:
    lens = torch.tensor([n for _, n in spans], dtype=torch.int64)
    indptr = torch.zeros(len(spans) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=indptr[1:])
    positions = torch.cat([torch.arange(s, s + n) for s, n in spans])
    has_keys = lens > 0
    rows = None
    if not bool(has_keys.all()):
        rows = torch.repeat_interleave(has_keys, q_lens).to(torch.uint8)
        rows = rows.repeat_interleave(groups)
    return PrefixChunk(indptr.int(), positions, rows)
