"""Prefill/decode disaggregation in the scheduler: page reservations for incoming KV,
admission of sequences whose prompt KV arrived, and the pages a finished prefill-only
sequence keeps until the decode side has pulled them (pure Python)."""

from __future__ import annotations

from dsv3serve.engine.sched_state import SchedState
from dsv3serve.engine.sequence import Sequence, SequenceStatus


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

    def release_reservation(self, pages: list[int]) -> None:
        """Give back reserved pages that will not be used (e.g. transfer failed)."""
        self._take_reserved(pages)
        self.state.kv.free(pages)

    def add_prefilled(self, seq: Sequence, pages: list[int]) -> None:
        """Decode side: queue ``seq`` whose prompt KV already sits in reserved ``pages``.

        ``seq.output_ids`` must hold exactly the first token sampled by the prefill side.
        """
        st = self.state
        if len(seq.output_ids) != 1:
            raise ValueError(
                f"sequence {seq.seq_id}: expected 1 output token (the first token), "
                f"got {len(seq.output_ids)}"
            )
        needed = st.kv.pages_for_tokens(len(seq.prompt_ids))
        if len(pages) < needed:
            raise ValueError(
                f"sequence {seq.seq_id}: prompt of {len(seq.prompt_ids)} tokens needs "
                f"{needed} pages, got {len(pages)}"
            )
        st.check_new(seq)
        self._take_reserved(pages)
        seq.page_table = list(pages)
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
