"""Continuous-batching scheduler over a paged KV cache (pure Python): the facade.

Its parts, each over one :class:`~dsv3serve.engine.scheduler.state.SchedState`:

- ``policy``: which tokens run in each step (admission, ordering, growth,
  preemption, speculative lookahead); the policy is described there.
- ``pd``: PD reservations, prefilled admission and exported pages.
- ``launch``: overlap launch / resolve / rollback bookkeeping.

This module records finished steps and ends sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dsv3serve.engine.scheduler.launch import LaunchBook
from dsv3serve.engine.scheduler.pd import NO_PREFIX, KVReservation, PDPages
from dsv3serve.engine.scheduler.policy import StepPolicy
from dsv3serve.engine.scheduler.sequence import (
    ContextLengthError,
    ScheduledBatch,
    ScheduledItem,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)
from dsv3serve.engine.scheduler.state import SchedState, check_start
from dsv3serve.kvcache.host_tier import PageCopier
from dsv3serve.kvcache.manager import KVCacheManager
from dsv3serve.kvcache.radix_cache import PrefixMatch

# the sequence types tests and callers use beside the scheduler
__all__ = [
    "ContextLengthError",
    "KVReservation",
    "ScheduledBatch",
    "ScheduledItem",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
]


class Scheduler:
    """Decides which tokens of which sequences run in each step and owns their pages.

    Drive it with ``add`` / ``schedule`` / ``on_step_done`` / ``finish``; see
    ``scheduler/policy.py`` for the policy. ``abort`` works in every state.
    ``copier`` carries out the host tier's page copies (``config.num_host_pages`` > 0).
    """

    def __init__(self, config: SchedulerConfig, copier: PageCopier | None = None) -> None:
        self.config = config
        self._state = SchedState.empty(config, copier)
        self._policy = StepPolicy(self._state)
        self._pd = PDPages(self._state)
        self._launches = LaunchBook(self._state, self._pd)

    @property
    def kv(self) -> KVCacheManager:
        """The KV page manager (allocator and prefix cache)."""
        return self._state.kv

    @property
    def num_preemptions(self) -> int:
        """Running sequences preempted so far."""
        return self._state.num_preemptions

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt (and recomputed) tokens scheduled as prefill so far: the prefill work the
        prefix cache did not save."""
        return self._state.num_prefill_tokens

    @property
    def num_running(self) -> int:
        """Sequences in the running set."""
        return len(self._state.running)

    @property
    def num_waiting(self) -> int:
        """Queued sequences, including prefilled ones waiting for a running slot."""
        return len(self._state.waiting) + len(self._state.prefilled)

    @property
    def num_exported(self) -> int:
        """Finished prefill-only sequences whose pages await ``release_exported``."""
        return len(self._state.exported)

    @property
    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        st = self._state
        return bool(st.running or st.waiting or st.prefilled)

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at admission."""
        return self.kv.hit_tokens

    @property
    def prefix_miss_tokens(self) -> int:
        """Prompt tokens that had to be computed at admission."""
        return self.kv.miss_tokens

    @property
    def kv_usage(self) -> float:
        """Fraction of KV pages that cannot be reclaimed now (0-1)."""
        return self.kv.usage

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raises ContextLengthError if it can never fit."""
        self._state.check_new(seq)
        self._state.enqueue(seq)
        self._state.waiting.append(seq)

    def set_pages_dropped_hook(self, hook: Callable[[Sequence], None]) -> None:
        """Call ``hook(seq)`` before any sequence's pages are freed (finish, abort,
        preemption) or swapped for the prefix cache's copies of the same tokens: whoever
        reads a sequence's pages outside the step (a KV connector staging them while the
        prefill runs on) must stop before ``hook`` returns."""
        self._state.on_pages_dropped = hook

    def schedule(self) -> ScheduledBatch | None:
        """Build the next step, or return None when nothing can run."""
        return self._policy.build()

    def on_step_done(self, batch: ScheduledBatch, sampled: Mapping[str, int | list[int]]) -> None:
        """Record that ``batch`` ran: advance KV progress, append ``sampled[seq_id]`` tokens.

        ``sampled[seq_id]`` is one token, or for a decode item with lookahead the tokens
        the step commits: 1 to ``1 + num_lookahead`` of them, the accepted draft tokens
        then the target's own. The KV of the decode token and of the accepted drafts is
        kept; the rest of the lookahead slots are free to be overwritten (their pages stay
        with the sequence for its next steps). Items of sequences finished or aborted
        since ``schedule()`` are skipped. A finished prefill is inserted into the prefix
        cache; a prefill-only sequence then finishes (reason ``"prefilled"``) and keeps
        its pages until ``release_exported``.
        """
        for item in batch.items:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            check_start(item)
            tokens = _sampled_tokens(item, sampled) if item.sample else []
            seq.num_computed_tokens = item.start + item.num_tokens + max(0, len(tokens) - 1)
            if item.sample:
                self._on_sampled(item, tokens)

    def on_step_launched(self, batch: ScheduledBatch, placeholders: Mapping[str, int]) -> None:
        """Overlap mode: ``batch`` is queued on the device, its sampled tokens unknown yet.

        Advances KV progress as ``on_step_done`` does and appends ``placeholders[seq_id]``
        (a negative id, see ``engine/overlap_loop.py``) for each sampled item, so the next
        ``schedule()`` can already give the sequence its decode. A prefill-only sequence
        is exported now; other prefix-cache inserts wait for ``resolve_token``. Lookahead
        (speculative) items are not supported here.
        """
        self._launches.on_step_launched(batch, placeholders)

    def resolve_token(self, item: ScheduledItem, placeholder: int, token: int) -> bool:
        """Overlap mode: put ``token`` where ``item``'s launch appended ``placeholder``.

        Returns False (a no-op) when the placeholder is gone: the launch was rolled back.
        A finished prefill chunk of a running sequence then enters the prefix cache.
        """
        return self._launches.resolve_token(item, placeholder, token)

    def rollback_launch(self, item: ScheduledItem) -> None:
        """Overlap mode: undo ``on_step_launched`` for ``item`` (its sequence ends now)."""
        self._launches.rollback_launch(item)

    def finish(self, seq: Sequence, reason: str) -> bool:
        """End ``seq`` in any state, caching its full pages and freeing the rest.

        Returns False (a no-op) when ``seq`` is not live here, e.g. already finished; an
        exported prefill-only sequence is released with ``release_exported`` instead.
        """
        return self._state.finish(seq, reason)

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of ``request_id`` (reason ``"abort"``), exported ones too.

        Returns False when the id is unknown or already finished. Call it between steps.
        """
        st = self._state
        seqs = [seq for seq in st.live.values() if seq.request_id == request_id]
        for seq in seqs:
            if seq.seq_id in st.exported:
                self.release_exported(seq)
            else:
                self.finish(seq, "abort")
        return bool(seqs)

    def pop_finished(self) -> list[Sequence]:
        """Sequences the scheduler finished by itself since the last call.

        Reasons: ``"prefilled"`` (prefill-only, pages kept) and ``"length"`` (the context
        outgrew the whole KV pool).
        """
        finished, self._state.finished_here = self._state.finished_here, []
        return finished

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Decode side of PD: reserve pages for ``num_tokens`` tokens of incoming KV."""
        return self._pd.reserve(num_tokens)

    def reserve_prompt(self, prompt: list[int], salt: str = "") -> KVReservation | None:
        """Decode side of PD: lock ``prompt``'s cached prefix, reserve pages for the rest."""
        return self._pd.reserve_prompt(prompt, salt)

    def release_reservation(self, pages: list[int]) -> None:
        """Give back reserved pages that will not be used (e.g. transfer failed)."""
        self._pd.release_reservation(pages)

    def release_prompt(self, reservation: KVReservation) -> None:
        """Give back an unused ``reserve_prompt`` reservation: its pages and prefix lock."""
        self._pd.release_prompt(reservation)

    def add_prefilled(
        self, seq: Sequence, pages: list[int], prefix: PrefixMatch = NO_PREFIX
    ) -> None:
        """Decode side of PD: queue ``seq`` whose prompt KV sits in the locked ``prefix``
        pages followed by reserved ``pages``.

        ``seq.output_ids`` must hold exactly the first token sampled by the prefill side.
        """
        self._pd.add_prefilled(seq, pages, prefix)

    def release_exported(self, seq: Sequence) -> None:
        """Free the pages a finished prefill-only sequence kept for KV transfer."""
        self._pd.release_exported(seq)

    def check_invariants(self) -> None:
        """Assert queue membership, page ownership and KV accounting are consistent."""
        st = self._state
        self.kv.check_invariants()
        holders = [*st.running, *st.prefilled, *st.exported.values()]
        queued = [*st.waiting, *holders]
        assert len({id(seq) for seq in queued}) == len(queued), "sequence queued twice"
        assert {seq.seq_id for seq in queued} == set(st.live), "live set out of sync"
        for seq in st.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.page_table, seq.seq_id
            assert seq.num_computed_tokens == 0 and seq.cache_handle is None, seq.seq_id
        assert all(seq.status is SequenceStatus.RUNNING for seq in st.running)
        owned = list(st.reserved)
        for seq in holders:
            assert len(seq.page_table) * self.config.page_size >= seq.num_computed_tokens
            assert seq.num_tree_pages * self.config.page_size <= seq.num_computed_tokens
            owned.extend(seq.page_table[seq.num_tree_pages :])
        assert len(set(owned)) == len(owned) == self.kv.used_pages, "used pages out of sync"
        assert all(self.kv.is_used(page) for page in owned), "a sequence holds a foreign page"

    def _on_sampled(self, item: ScheduledItem, tokens: list[int]) -> None:
        seq = item.seq
        for token in tokens:
            seq.append_token(token)
        if not item.is_decode:
            self._state.commit_prefix(seq)
        if seq.prefill_only:
            self._pd.export(seq)


def _sampled_tokens(item: ScheduledItem, sampled: Mapping[str, int | list[int]]) -> list[int]:
    seq_id = item.seq.seq_id
    if seq_id not in sampled:
        raise KeyError(f"no sampled token for sequence {seq_id} (item has sample=True)")
    value = sampled[seq_id]
    tokens = [value] if isinstance(value, int) else list(value)
    if not 1 <= len(tokens) <= 1 + item.num_lookahead:
        raise ValueError(
            f"sequence {seq_id}: expected 1 to {1 + item.num_lookahead} sampled tokens "
            f"(1 + lookahead), got {len(tokens)}"
        )
    return tokens
