"""Prefill/decode disaggregation in the scheduler: page reservations for incoming KV,
admission of sequences whose prompt KV arrived, and the pages a finished prefill-only
sequence keeps until the decode side has pulled them (pure Python).

Decode-side prefix reuse: a reservation for a known prompt first matches it against this
side's prefix cache and locks the hit, so only the pages after it are reserved (and
pulled); eviction cannot take the locked pages until the reservation is imported or
released.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv3serve.engine.scheduler.sequence import Sequence, SequenceStatus
from dsv3serve.engine.scheduler.state import SchedState
from dsv3serve.kvcache.radix_cache import PrefixMatch

NO_PREFIX = PrefixMatch([], 0, None)


@dataclass(frozen=True)
class KVReservation:
    """Decode side of PD: where an incoming prompt's KV will sit.

    The prompt's first ``num_cached_pages`` pages are prefix-cache pages held here already
    (``prefix``, locked until the reservation is imported or released); the pulled KV
    lands in ``pages``, the prompt's pages from ``num_cached_pages`` on. Under DP attention
    ``pages`` are global page ids of one rank and ``prefix.pages`` that rank's own.
    """

    pages: list[int]
    prefix: PrefixMatch = NO_PREFIX

    @property
    def num_cached_pages(self) -> int:
        """Leading prompt pages not pulled: this side's prefix cache holds them."""
        return len(self.prefix.pages)

    @property
    def num_cached_tokens(self) -> int:
        """Leading prompt tokens whose KV this side holds already."""
        return self.prefix.num_tokens


class PDPages:
    """Reserved and exported pages over a :class:`SchedState`."""

    def __init__(self, state: SchedState) -> None:
        self.state = state

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Decode side: reserve pages for ``num_tokens`` tokens of incoming KV."""
        kv = self.state.kv
        pages = kv.allocate(kv.pages_for_tokens(num_tokens))
        if pages is not None:
            self.state.reserved.update(pages)
        return pages

    def reserve_prompt(self, prompt: list[int], salt: str = "") -> KVReservation | None:
        """Decode side: lock the cached prefix of ``prompt`` and reserve pages for the rest.

        At most ``len(prompt) - 1`` tokens are matched, so at least one page is pulled.
        None (nothing held) when the pages do not fit.
        """
        kv = self.state.kv
        prefix = kv.match_prefix(prompt, salt, limit=len(prompt) - 1, record_stats=False)
        pages = self.reserve(len(prompt) - prefix.num_tokens)
        if pages is None:
            kv.release(prefix.handle, [])
            return None
        kv.record_prefix_query(len(prompt), prefix.num_tokens, prefix.host_tokens)
        return KVReservation(pages, prefix)

    def release_reservation(self, pages: list[int]) -> None:
        """Give back reserved pages that will not be used (e.g. transfer failed)."""
        self._take_reserved(pages)
        self.state.kv.free(pages)

    def release_prompt(self, reservation: KVReservation) -> None:
        """Give back an unused :meth:`reserve_prompt` reservation: its pages and its lock."""
        self.release_reservation(reservation.pages)
        self.state.kv.release(reservation.prefix.handle, [])

    def add_prefilled(
        self, seq: Sequence, pages: list[int], prefix: PrefixMatch = NO_PREFIX
    ) -> None:
        """Decode side: queue ``seq`` whose prompt KV sits in ``prefix.pages`` (locked
        prefix-cache pages, see :meth:`reserve_prompt`) followed by reserved ``pages``.

        ``seq.output_ids`` must hold exactly the first token sampled by the prefill side.
        The sequence takes over the prefix lock.
        """
        st = self.state
        if len(seq.output_ids) != 1:
            raise ValueError(
                f"sequence {seq.seq_id}: expected 1 output token (the first token), "
                f"got {len(seq.output_ids)}"
            )
        needed = st.kv.pages_for_tokens(len(seq.prompt_ids))
        if len(prefix.pages) + len(pages) < needed:
            raise ValueError(
                f"sequence {seq.seq_id}: prompt of {len(seq.prompt_ids)} tokens needs "
                f"{needed} pages, got {len(prefix.pages)} cached + {len(pages)} reserved"
            )
        st.check_new(seq)
        self._take_reserved(pages)
        seq.page_table = [*prefix.pages, *pages]
        seq.num_tree_pages = len(prefix.pages)
        seq.cache_handle = prefix.handle
        seq.num_computed_tokens = len(seq.prompt_ids)
        st.enqueue(seq)
        st.commit_prefix(seq)
        st.prefilled.append(seq)

    def export(self, seq: Sequence) -> None:
        """Prefill side: finish ``seq`` (reason ``"prefilled"``), keeping its pages."""
        st = self.state
        st.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "prefilled"
        st.exported[seq.seq_id] = seq
        st.finished_here.append(seq)

    def release_exported(self, seq: Sequence) -> None:
        """Free the pages a finished prefill-only sequence kept for KV transfer."""
        st = self.state
        if st.exported.pop(seq.seq_id, None) is not seq:
            raise ValueError(f"sequence {seq.seq_id} has no exported pages")
        st.release_pages(seq)
        del st.live[seq.seq_id]

    def _take_reserved(self, pages: list[int]) -> None:
        stray = [page for page in pages if page not in self.state.reserved]
        if stray:
            raise ValueError(f"pages {stray} are not reserved")
        self.state.reserved.difference_update(pages)
