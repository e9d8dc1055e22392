"""Per-step forward metadata, built once per scheduler step and shared by every layer.

Two ways to give a sequence's cache: a page table (what the engine does; the step's host
work is then O(batch + pages), with no per-token Python loop) or an explicit slot list
(any layout; O(tokens)). :meth:`ForwardBatch.build` flattens a batch of spans with numpy
and moves the per-token inputs to the device in one copy from one (pinned) buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from dsv3serve.page_table import flat_positions, pages_needed, pages_of_slots, slots_of

# moves a batch's per-token host arrays (ids, positions, out slots, logits rows; int64)
# to the device: ``_to_device`` by default, a graph's static buffers for CUDA graphs
Upload = Callable[[Sequence[np.ndarray]], list[torch.Tensor]]


class SeqSpan:
    """One sequence's part of a step: tokens ``start .. start+len(token_ids)`` of it.

    Its cache is either ``kv_slots`` (slots of positions ``0 .. num_kv-1``) or
    ``page_table`` + ``page_size`` (position ``p`` at row ``p % page_size`` of page
    ``page_table[p // page_size]``). ``kv_slots`` of a paged span is derived on first use.
    """

    __slots__ = ("token_ids", "start", "sample", "page_table", "page_size", "_slots", "_pages")

    def __init__(
        self,
        token_ids: list[int],
        start: int,
        kv_slots: list[int] | None = None,
        sample: bool = True,
        *,
        page_table: list[int] | None = None,
        page_size: int = 0,
    ) -> None:
        if (kv_slots is None) == (page_table is None):
            raise ValueError("SeqSpan needs exactly one of kv_slots and page_table")
        self.token_ids, self.start, self.sample = token_ids, start, sample
        self.page_table, self.page_size = page_table, page_size
        self._slots = kv_slots
        self._pages: tuple[int, list[int] | None] | None = None
        if page_table is not None:
            self._check_pages(page_table, page_size)

    def _check_pages(self, page_table: list[int], page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"a paged SeqSpan needs page_size >= 1, got {page_size}")
        need = pages_needed(self.num_kv, page_size)
        if len(page_table) < need:
            raise ValueError(
                f"span of {self.num_kv} positions needs {need} pages of {page_size}, "
                f"page table has {len(page_table)}"
            )

    @classmethod
    def from_pages(
        cls,
        token_ids: list[int],
        start: int,
        page_table: list[int],
        page_size: int,
        sample: bool = True,
    ) -> SeqSpan:
        """A paged span over a snapshot of the pages it uses (``page_table`` may be longer)."""
        need = pages_needed(start + len(token_ids), page_size)
        return cls(
            token_ids, start, None, sample, page_table=page_table[:need], page_size=page_size
        )

    @property
    def num_kv(self) -> int:
        """Positions with KV after this step: ``start + len(token_ids)``."""
        return self.start + len(self.token_ids)

    @property
    def kv_slots(self) -> list[int]:
        """Slots of positions ``0 .. num_kv-1`` (O(num_kv): for code that needs tokens)."""
        if self._slots is None:
            assert self.page_table is not None
            self._slots = slots_of(self.page_table, self.page_size, 0, self.num_kv).tolist()
        return self._slots

    def pages(self, page_size: int) -> list[int] | None:
        """The span's pages of ``page_size`` tokens, or None when its cache is not laid
        out that way (a slot list that does not fill pages in order)."""
        if self.page_table is not None and self.page_size == page_size:
            return self.page_table
        if self._pages is None or self._pages[0] != page_size:  # cached: padding spans
            self._pages = (page_size, pages_of_slots(self.kv_slots, page_size))
        return self._pages[1]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SeqSpan):
            return NotImplemented
        mine = (self.token_ids, self.start, self.sample, self.kv_slots)
        return mine == (other.token_ids, other.start, other.sample, other.kv_slots)

    def __repr__(self) -> str:
        cache = (
            f"page_table={self.page_table}, page_size={self.page_size}"
            if self.page_table is not None
            else f"kv_slots={self._slots}"
        )
        return f"SeqSpan({self.token_ids}, start={self.start}, {cache}, sample={self.sample})"


@dataclass(frozen=True)
class KVPages:
    """The batch's KV as page tables (all on the host, int64).

    Sequence ``b`` has ``kv_lens[b]`` positions in pages
    ``pages[page_indptr[b]:page_indptr[b+1]]``, position ``p`` at row ``p % page_size``
    of its page ``p // page_size``.
    """

    page_size: int
    page_indptr: torch.Tensor  # [B+1]
    pages: torch.Tensor  # [page_indptr[-1]]
    kv_lens: torch.Tensor  # [B]

    def host_slots(self, seqs: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slots (int64, host) of position ``positions[i]`` of sequence ``seqs[i]``."""
        ps = self.page_size
        page = self.page_indptr.numpy()[seqs] + positions // ps
        return self.pages.numpy()[page] * ps + positions % ps

    def slots(self, device: torch.device | str) -> torch.Tensor:
        """Every sequence's KV slots, concatenated: [sum(kv_lens)] int64 on ``device``,
        computed there from the page ids (no per-token host work)."""
        first_row, lens, pages = _to_device(
            [
                (self.page_indptr[:-1] * self.page_size).numpy(),
                self.kv_lens.numpy(),
                self.pages.numpy(),
            ],
            device,
        )  # one pinned, non-blocking copy: no stream sync
        total = int(self.kv_lens.sum())
        seq = torch.repeat_interleave(
            torch.arange(len(lens), device=device), lens, output_size=total
        )
        starts = torch.cumsum(lens, 0) - lens
        row = torch.arange(total, device=device) - starts[seq] + first_row[seq]
        return pages[row // self.page_size] * self.page_size + row % self.page_size


@dataclass
class ForwardBatch:
    """Flattened tokens of a batch of sequences plus their paged-cache addressing.

    ``qo_indptr`` / ``kv_indptr`` are host lists (length B+1) delimiting each sequence's
    new tokens in the T-long token arrays and its KV slots in ``kv_slots``. The cache is
    given by ``kv_pages`` (page tables; ``kv_slots`` is then derived on the device when
    first read) or by slot lists (``kv_slots_host`` and ``slot_tensor``).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64, cache slot written for each new token
    qo_indptr: list[int]
    kv_indptr: list[int]
    logits_indices: torch.Tensor  # [N] rows of T whose logits are computed
    is_decode: bool
    kv_slots_host: torch.Tensor | None = None  # slot lists: kv_slots on the CPU
    kv_pages: KVPages | None = None  # page tables (then kv_slots_host is None)
    slot_tensor: torch.Tensor | None = None  # slot lists: kv_slots on the device
    _derived: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.qo_indptr) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def kv_slots(self) -> torch.Tensor:
        """[sum(seq_lens)] int64 on the batch's device: each sequence's KV slots in order."""
        if self.slot_tensor is not None:
            return self.slot_tensor
        if "kv_slots" not in self._derived:
            assert self.kv_pages is not None
            self._derived["kv_slots"] = self.kv_pages.slots(self.input_ids.device)
        return self._derived["kv_slots"]

    @classmethod
    def build(
        cls,
        spans: list[SeqSpan],
        device: torch.device | str,
        decode: bool | None = None,
        upload: Upload | None = None,
    ) -> ForwardBatch:
        """Flatten ``spans``: per-token inputs go to the device in one copy.

        ``is_decode`` is ``decode``, or when None whether every span has one token. A
        speculative verify (a few tokens per sequence over its cache) passes True. When a
        span has a page table, the batch is paged (slot-list spans join it if their slots
        fill pages of that size, else the whole batch uses slot lists). ``upload``: how
        the per-token arrays reach the device (a CUDA graph's static buffers:
        :meth:`~dsv3serve.engine.static_inputs.StaticInputs.upload`); one pinned copy to
        new tensors when None.
        """
        small = _small_decode(spans) if decode is not False else None
        if small is not None:
            return cls._from_small_decode(small, device, upload)
        q_lens = np.fromiter((len(s.token_ids) for s in spans), np.int64, len(spans))
        starts = np.fromiter((s.start for s in spans), np.int64, len(spans))
        kv_lens = starts + q_lens
        _check_slot_lists(spans)
        rows, pos = flat_positions(starts, q_lens)
        pages = _batch_pages(spans)
        kv_pages, slot_lists = None, None
        if pages is not None:
            kv_pages = _kv_pages(pages, kv_lens)
            out = kv_pages.host_slots(rows, pos)
        else:
            slot_lists = _all_slots(spans, kv_lens)
            out = slot_lists.numpy()[_indptr(kv_lens)[:-1][rows] + pos]
        ids = np.fromiter(chain.from_iterable(s.token_ids for s in spans), np.int64)
        qo_indptr = _indptr(q_lens)
        sample = np.fromiter((s.sample for s in spans), bool, len(spans))
        logits_rows = qo_indptr[1:][sample] - 1
        arrays = [ids, pos, out, logits_rows]
        moved = _to_device(arrays, device) if upload is None else upload(arrays)
        ids_t, pos_t, out_t, logits_t = moved
        return cls(
            input_ids=ids_t,
            positions=pos_t,
            out_slots=out_t,
            qo_indptr=qo_indptr.tolist(),
            kv_indptr=_indptr(kv_lens).tolist(),
            logits_indices=logits_t,
            is_decode=bool((q_lens == 1).all()) if decode is None else decode,
            kv_slots_host=slot_lists,
            kv_pages=kv_pages,
            slot_tensor=None if slot_lists is None else _to_device([slot_lists.numpy()], device)[0],
        )

    @classmethod
    def _from_small_decode(
        cls, small: _SmallDecode, device: torch.device | str, upload: Upload | None
    ) -> ForwardBatch:
        """The batch of :func:`_small_decode`'s lists (what :meth:`build` gives for them)."""
        arrays = [np.array(a, dtype=np.int64) for a in (small.ids, small.pos, small.out)]
        arrays.append(np.array(small.rows, dtype=np.int64))
        moved = _to_device(arrays, device) if upload is None else upload(arrays)
        ids_t, pos_t, out_t, logits_t = moved
        b = len(small.ids)
        host = (
            np.array(a, dtype=np.int64) for a in (small.page_indptr, small.pages, small.kv_lens)
        )
        pages = KVPages(small.page_size, *map(torch.from_numpy, host))
        kv_indptr = [0] * (b + 1)
        for i, n in enumerate(small.kv_lens):
            kv_indptr[i + 1] = kv_indptr[i] + n
        return cls(
            input_ids=ids_t,
            positions=pos_t,
            out_slots=out_t,
            qo_indptr=list(range(b + 1)),
            kv_indptr=kv_indptr,
            logits_indices=logits_t,
            is_decode=True,
            kv_pages=pages,
        )


SMALL_DECODE = 16  # up to this many one-token paged spans, build() runs plain Python


@dataclass
class _SmallDecode:
    """A small decode batch's host arrays as lists (see :func:`_small_decode`)."""

    page_size: int
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)
    page_indptr: list[int] = field(default_factory=lambda: [0])
    pages: list[int] = field(default_factory=list)


def _small_decode(spans: list[SeqSpan]) -> _SmallDecode | None:
    """A batch of at most ``SMALL_DECODE`` spans of one token each, paged as
    :func:`_batch_pages` pages them, flattened in plain Python: at batch 1 a dozen numpy
    calls cost more than the arithmetic (the graphed decode and draft steps). None for
    anything else, which the general path handles."""
    if not spans or len(spans) > SMALL_DECODE or any(len(s.token_ids) != 1 for s in spans):
        return None
    paged = _batch_pages(spans)
    if paged is None:
        return None
    _check_slot_lists(spans)  # as the general path checks them
    size, tables = paged
    b = _SmallDecode(size)
    for i, (s, table) in enumerate(zip(spans, tables, strict=True)):
        p = s.start
        n = -(-(p + 1) // size)
        b.ids.append(s.token_ids[0])
        b.pos.append(p)
        b.out.append(table[p // size] * size + p % size)
        if s.sample:
            b.rows.append(i)
        b.kv_lens.append(p + 1)
        b.pages.extend(table[:n])
        b.page_indptr.append(b.page_indptr[-1] + n)
    return b


def _indptr(lens: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def _batch_pages(spans: list[SeqSpan]) -> tuple[int, list[list[int]]] | None:
    """(page size, each span's pages) when some span is paged and all can be, else None."""
    page_size = next((s.page_size for s in spans if s.page_table is not None), 0)
    if page_size == 0:
        return None
    tables = [s.pages(page_size) for s in spans]
    if any(t is None for t in tables):
        return None
    return page_size, tables  # type: ignore[return-value]


def _check_slot_lists(spans: list[SeqSpan]) -> None:
    """Each slot-list span must give one slot per position."""
    for span in spans:
        if span.page_table is None and len(span.kv_slots) != span.num_kv:
            raise ValueError(f"span needs {span.num_kv} kv slots, got {len(span.kv_slots)}")


def _kv_pages(pages: tuple[int, list[list[int]]], kv_lens: np.ndarray) -> KVPages:
    """The batch's :class:`KVPages`: the pages each sequence uses, concatenated."""
    page_size, tables = pages
    n_pages = -(-kv_lens // page_size)
    page_indptr = _indptr(n_pages)
    used = (t if len(t) == n else t[:n] for t, n in zip(tables, n_pages.tolist(), strict=True))
    flat = np.fromiter(chain.from_iterable(used), np.int64, int(page_indptr[-1]))
    return KVPages(
        page_size,
        torch.from_numpy(page_indptr),
        torch.from_numpy(flat),
        torch.from_numpy(kv_lens.copy()),
    )


def _all_slots(spans: list[SeqSpan], kv_lens: np.ndarray) -> torch.Tensor:
    """Every span's slot list, concatenated (int64, host)."""
    flat = np.fromiter(chain.from_iterable(s.kv_slots for s in spans), np.int64, int(kv_lens.sum()))
    return torch.from_numpy(flat)


def _to_device(arrays: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """int64 host arrays as device tensors through one host buffer (pinned for CUDA) and
    one non-blocking copy."""
    sizes = [len(a) for a in arrays]
    host = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False))
    if torch.device(device).type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    else:
        host = host.to(device)
    return list(host.split(sizes))
