"""The scheduler's shared bookkeeping: its queues, which sequence holds which pages, and the
page operations every part of the scheduler uses (pure Python).

Invariants (checked by ``Scheduler.check_invariants``): a live sequence is in exactly one of
``waiting``, ``running``, ``prefilled`` and ``exported``; a waiting sequence holds no pages;
the pages held by sequences past their prefix-cache pages, plus the reserved pages, are
exactly the pool's used pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dsv3serve.engine.scheduler.sequence import (
    ContextLengthError,
    ScheduledItem,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)
from dsv3serve.kvcache.host_tier import HostTier, PageCopier
from dsv3serve.kvcache.manager import KVCacheManager


@dataclass
class SchedState:
    """Queues, page ownership and counters shared by the scheduler's parts."""

    config: SchedulerConfig
    kv: KVCacheManager
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    prefilled: deque[Sequence] = field(default_factory=deque)
    exported: dict[str, Sequence] = field(default_factory=dict)
    live: dict[str, Sequence] = field(default_factory=dict)
    reserved: set[int] = field(default_factory=set)
    finished_here: list[Sequence] = field(default_factory=list)
    arrivals: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0  # tokens scheduled as prefill (recomputes count again)
    # called on the step thread before a sequence's pages go back or are swapped for the
    # prefix cache's copies (see ``Scheduler.set_pages_dropped_hook``)
    on_pages_dropped: Callable[[Sequence], None] = field(default=lambda _seq: None)

    @classmethod
    def empty(cls, config: SchedulerConfig, copier: PageCopier | None = None) -> SchedState:
        """No sequences, every page of ``config.num_pages`` free; ``copier`` moves the
        host tier's pages (needed when ``config.num_host_pages`` > 0)."""
        host = None
        if config.num_host_pages and config.enable_prefix_cache:
            if copier is None:
                raise ValueError(
                    f"num_host_pages {config.num_host_pages}: the host tier needs a page "
                    f"copier, found none"
                )
            host = HostTier(config.num_host_pages, copier)
        kv = KVCacheManager(config.num_pages, config.page_size, config.enable_prefix_cache, host)
        return cls(config, kv)

    # ---- queues ----------------------------------------------------------------------
    def check_new(self, seq: Sequence) -> None:
        """Raise unless ``seq`` is fresh, not live here, and can ever fit."""
        if seq.seq_id in self.live:
            raise ValueError(f"sequence id {seq.seq_id!r} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.page_table:
            raise ValueError(f"sequence {seq.seq_id} is not fresh (status {seq.status.value})")
        prompt, limit = len(seq.prompt_ids), self.config.max_context_len
        if prompt + seq.max_new_tokens > limit:
            raise ContextLengthError(
                f"request {seq.request_id}: prompt of {prompt} tokens plus max_new_tokens "
                f"{seq.max_new_tokens} is {prompt + seq.max_new_tokens} tokens, over the "
                f"context limit of {limit} tokens"
            )
        pages = self.kv.pages_for_tokens(seq.num_tokens)
        if pages > self.config.num_pages:
            raise ContextLengthError(
                f"request {seq.request_id}: prompt of {seq.num_tokens} tokens needs {pages} "
                f"KV pages but the pool has {self.config.num_pages}"
            )

    def enqueue(self, seq: Sequence) -> None:
        """Make ``seq`` live and give it the next arrival number."""
        seq.arrival = self.arrivals
        self.arrivals += 1
        self.live[seq.seq_id] = seq

    def unqueue(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever of running / prefilled / waiting holds it."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.prefilled:
            self.prefilled.remove(seq)
        else:
            self.waiting.remove(seq)

    def finish(self, seq: Sequence, reason: str) -> bool:
        """End ``seq`` in any state, caching its full pages and freeing the rest.

        Returns False (a no-op) when ``seq`` is not live here, e.g. already finished.
        """
        if seq.is_finished or self.live.get(seq.seq_id) is not seq:
            return False
        self.unqueue(seq)
        self.release_pages(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.live[seq.seq_id]
        return True

    def finish_here(self, seq: Sequence, reason: str) -> None:
        """Finish ``seq`` on the scheduler's own decision (reported by ``pop_finished``)."""
        self.finish(seq, reason)
        self.finished_here.append(seq)

    def outgrows_pool(self, seq: Sequence) -> bool:
        """Whether ``seq``'s context needs more pages than the whole pool has."""
        return self.kv.pages_for_tokens(seq.num_tokens) > self.config.num_pages

    # ---- pages -----------------------------------------------------------------------
    def tokens_that_fit(self, seq: Sequence, num_tokens: int) -> int:
        """How many of ``num_tokens`` new tokens of ``seq`` the free pages can hold."""
        capacity = (len(seq.page_table) + self.kv.available_pages) * self.config.page_size
        return max(0, min(num_tokens, capacity - seq.num_computed_tokens))

    def take_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.page_table`` to hold ``num_tokens`` tokens (the pages must fit)."""
        needed = self.kv.pages_for_tokens(num_tokens) - len(seq.page_table)
        if needed > 0:
            pages = self.kv.allocate(needed)
            assert pages is not None, "available_pages promised more than allocate gave"
            seq.page_table.extend(pages)

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of positions ``start .. end-1`` of ``seq``."""
        page_size, table = self.config.page_size, seq.page_table
        return [table[pos // page_size] * page_size + pos % page_size for pos in range(start, end)]

    def commit_prefix(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Hand the computed full pages (of the first ``num_tokens``) to the prefix cache."""
        computed = seq.num_computed_tokens
        full = (
            computed if num_tokens is None else min(num_tokens, computed)
        ) // self.config.page_size
        if not self.kv.prefix_cache_enabled or full <= seq.num_tree_pages:
            return
        tokens = seq.token_ids(0, full * self.config.page_size)
        handle, pages = self.kv.insert_prefix(
            tokens, seq.page_table[:full], seq.salt, seq.cache_handle
        )
        if pages != seq.page_table[:full]:  # its copies were freed; none is reused before
            self.on_pages_dropped(seq)  # the hook returns (allocation is this thread's)
        seq.page_table[:full] = pages
        seq.num_tree_pages = full
        seq.cache_handle = handle

    def release_pages(self, seq: Sequence) -> None:
        """Cache ``seq``'s full pages, free the rest and clear its page table."""
        if seq.page_table:
            self.on_pages_dropped(seq)
        self.commit_prefix(seq)
        self.kv.release(seq.cache_handle, seq.page_table[seq.num_tree_pages :])
        seq.page_table = []
        seq.num_tree_pages = 0
        seq.cache_handle = None


def check_start(item: ScheduledItem) -> None:
    """Raise unless ``item`` starts where its sequence's computed tokens end."""
    seq = item.seq
    if seq.num_computed_tokens != item.start:
        raise RuntimeError(
            f"sequence {seq.seq_id}: item starts at {item.start} but "
            f"{seq.num_computed_tokens} tokens are computed (step reported twice?)"
        )
