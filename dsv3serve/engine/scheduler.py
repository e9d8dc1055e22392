"""Continuous-batching scheduler over a paged KV cache (pure Python).

Each ``schedule()`` builds one step: a decode token for every running sequence that
has finished its prefill, then prefill chunks of running sequences, then newly admitted
waiting sequences, within the step's token budgets. When pages run out for a running
sequence, the most recently arrived running sequence not yet in the step is preempted
in recompute mode: its pages go back (full ones through the prefix cache) and it waits
at the front of the queue to recompute its prompt and output so far.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import replace

from dsv3serve.engine.sequence import (
    ContextLengthError,
    ScheduledBatch,
    ScheduledItem,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    StepPlan,
)
from dsv3serve.kvcache.manager import KVCacheManager

# Longest-prefix-match ordering looks up every waiting sequence; past this queue length
# the scheduler falls back to arrival order.
_LPM_MAX_WAITING = 256


class Scheduler:
    """Decides which tokens of which sequences run in each step and owns their pages.

    Drive it with ``add`` / ``schedule`` / ``on_step_done`` / ``finish``; see the module
    docstring for the policy. ``abort`` works in every state.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_pages, config.page_size, config.enable_prefix_cache)
        self.num_preemptions = 0
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._prefilled: deque[Sequence] = deque()
        self._exported: dict[str, Sequence] = {}
        self._live: dict[str, Sequence] = {}
        self._reserved: set[int] = set()
        self._finished_here: list[Sequence] = []
        self._arrivals = 0

    @property
    def num_running(self) -> int:
        """Sequences in the running set."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Queued sequences, including prefilled ones waiting for a running slot."""
        return len(self._waiting) + len(self._prefilled)

    @property
    def num_exported(self) -> int:
        """Finished prefill-only sequences whose pages await ``release_exported``."""
        return len(self._exported)

    @property
    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self._running or self._waiting or self._prefilled)

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
        self._check_new(seq)
        self._enqueue(seq)
        self._waiting.append(seq)

    def schedule(self) -> ScheduledBatch | None:
        """Build the next step, or return None when nothing can run."""
        self._admit_prefilled()
        plan = StepPlan.start(self.config)
        running = sorted(self._running, key=lambda seq: seq.arrival)
        for seq in running:
            if seq.num_computed_tokens == seq.num_tokens - 1:
                self._schedule_decode(seq, plan)
        if self.config.num_lookahead_tokens:
            self._grant_lookahead(plan)
        for seq in running:
            if seq.num_computed_tokens < seq.num_tokens - 1:
                self._schedule_prefill(seq, plan)
        self._admit_waiting(plan)
        return plan.to_batch()

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
            self._check_start(item)
            tokens = self._sampled_tokens(item, sampled) if item.sample else []
            seq.num_computed_tokens = item.start + item.num_tokens + max(0, len(tokens) - 1)
            if item.sample:
                self._on_sampled(item, tokens)

    def on_step_launched(self, batch: ScheduledBatch, placeholders: Mapping[str, int]) -> None:
        """Overlap mode: ``batch`` is queued on the device, its sampled tokens unknown yet.

        Advances KV progress as ``on_step_done`` does and appends ``placeholders[seq_id]``
        (a negative id, see ``engine/overlap.py``) for each sampled item, so the next
        ``schedule()`` can already give the sequence its decode. A prefill-only sequence
        is exported now; other prefix-cache inserts wait for ``resolve_token``. Lookahead
        (speculative) items are not supported here.
        """
        for item in batch.items:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self._check_start(item)
            if item.num_lookahead:
                raise ValueError(f"sequence {seq.seq_id}: lookahead items cannot overlap")
            seq.num_computed_tokens = item.start + item.num_tokens
            if item.sample:
                seq.append_token(placeholders[seq.seq_id])
                if seq.prefill_only:
                    self._commit_prefix(seq)
                    self._export_prefilled(seq)

    def resolve_token(self, item: ScheduledItem, placeholder: int, token: int) -> bool:
        """Overlap mode: put ``token`` where ``item``'s launch appended ``placeholder``.

        Returns False (a no-op) when the placeholder is gone: the launch was rolled back.
        A finished prefill chunk of a running sequence then enters the prefix cache.
        """
        seq = item.seq
        index = item.start + item.num_tokens - len(seq.prompt_ids)
        if index >= len(seq.output_ids) or seq.output_ids[index] != placeholder:
            return False
        seq.output_ids[index] = token
        if seq.status is SequenceStatus.RUNNING and not item.is_decode:
            self._commit_prefix(seq, item.start + item.num_tokens)
        return True

    def rollback_launch(self, item: ScheduledItem) -> None:
        """Overlap mode: undo ``on_step_launched`` for ``item`` (its sequence ends now)."""
        seq = item.seq
        seq.num_computed_tokens = min(seq.num_computed_tokens, item.start)
        if item.sample:
            del seq.output_ids[item.start + item.num_tokens - len(seq.prompt_ids) :]

    def finish(self, seq: Sequence, reason: str) -> bool:
        """End ``seq`` in any state, caching its full pages and freeing the rest.

        Returns False (a no-op) when ``seq`` is not live here, e.g. already finished; an
        exported prefill-only sequence is released with ``release_exported`` instead.
        """
        if seq.is_finished or self._live.get(seq.seq_id) is not seq:
            return False
        self._unqueue(seq)
        self._release_pages(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._live[seq.seq_id]
        return True

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of ``request_id`` (reason ``"abort"``), exported ones too.

        Returns False when the id is unknown or already finished. Call it between steps.
        """
        seqs = [seq for seq in self._live.values() if seq.request_id == request_id]
        for seq in seqs:
            if seq.seq_id in self._exported:
                self.release_exported(seq)
            else:
                self.finish(seq, "abort")
        return bool(seqs)

    def pop_finished(self) -> list[Sequence]:
        """Sequences the scheduler finished by itself since the last call.

        Reasons: ``"prefilled"`` (prefill-only, pages kept) and ``"length"`` (the context
        outgrew the whole KV pool).
        """
        finished, self._finished_here = self._finished_here, []
        return finished

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Decode side of PD: reserve pages for ``num_tokens`` tokens of incoming KV."""
        pages = self.kv.allocate(self.kv.pages_for_tokens(num_tokens))
        if pages is not None:
            self._reserved.update(pages)
        return pages

    def release_reservation(self, pages: list[int]) -> None:
        """Give back reserved pages that will not be used (e.g. transfer failed)."""
        self._take_reserved(pages)
        self.kv.free(pages)

    def add_prefilled(self, seq: Sequence, pages: list[int]) -> None:
        """Decode side of PD: queue ``seq`` whose prompt KV already sits in reserved ``pages``.

        ``seq.output_ids`` must hold exactly the first token sampled by the prefill side.
        """
        if len(seq.output_ids) != 1:
            raise ValueError(
                f"sequence {seq.seq_id}: expected 1 output token (the first token), "
                f"got {len(seq.output_ids)}"
            )
        needed = self.kv.pages_for_tokens(len(seq.prompt_ids))
        if len(pages) < needed:
            raise ValueError(
                f"sequence {seq.seq_id}: prompt of {len(seq.prompt_ids)} tokens needs "
                f"{needed} pages, got {len(pages)}"
            )
        self._check_new(seq)
        self._take_reserved(pages)
        seq.page_table = list(pages)
        seq.num_computed_tokens = len(seq.prompt_ids)
        self._enqueue(seq)
        self._commit_prefix(seq)
        self._prefilled.append(seq)

    def release_exported(self, seq: Sequence) -> None:
        """Free the pages a finished prefill-only sequence kept for KV transfer."""
        if self._exported.pop(seq.seq_id, None) is not seq:
            raise ValueError(f"sequence {seq.seq_id} has no exported pages")
        self._release_pages(seq)
        del self._live[seq.seq_id]

    def check_invariants(self) -> None:
        """Assert queue membership, page ownership and KV accounting are consistent."""
        self.kv.check_invariants()
        holders = [*self._running, *self._prefilled, *self._exported.values()]
        queued = [*self._waiting, *holders]
        assert len({id(seq) for seq in queued}) == len(queued), "sequence queued twice"
        assert {seq.seq_id for seq in queued} == set(self._live), "live set out of sync"
        for seq in self._waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.page_table, seq.seq_id
            assert seq.num_computed_tokens == 0 and seq.cache_handle is None, seq.seq_id
        assert all(seq.status is SequenceStatus.RUNNING for seq in self._running)
        owned = list(self._reserved)
        for seq in holders:
            assert len(seq.page_table) * self.config.page_size >= seq.num_computed_tokens
            assert seq.num_tree_pages * self.config.page_size <= seq.num_computed_tokens
            owned.extend(seq.page_table[seq.num_tree_pages :])
        assert len(set(owned)) == len(owned) == self.kv.used_pages, "used pages out of sync"
        assert all(self.kv.is_used(page) for page in owned), "a sequence holds a foreign page"

    def _check_new(self, seq: Sequence) -> None:
        if seq.seq_id in self._live:
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

    def _enqueue(self, seq: Sequence) -> None:
        seq.arrival = self._arrivals
        self._arrivals += 1
        self._live[seq.seq_id] = seq

    def _admit_prefilled(self) -> None:
        while self._prefilled and len(self._running) < self.config.max_running_requests:
            seq = self._prefilled.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_admissions += 1
            self._running.append(seq)

    def _schedule_decode(self, seq: Sequence, plan: StepPlan) -> None:
        if seq.status is not SequenceStatus.RUNNING or plan.tokens_left < 1:
            return
        if seq.num_generation_slots_left <= 0:
            return  # overlap mode: its last token is in flight and will finish it
        if self._outgrows_pool(seq):
            self._finish_here(seq, "length")
        elif self._grow(seq, 1, plan, preempt=True):
            self._emit(seq, 1, plan, is_decode=True)

    def _grant_lookahead(self, plan: StepPlan) -> None:
        """Give decode items slots for draft tokens, as far as pages fit without preempting.

        A decode never drafts past its ``max_new_tokens``: a step commits at most
        ``1 + num_lookahead`` tokens.
        """
        for seq_id, item in list(plan.items.items()):
            seq = item.seq
            wanted = min(
                self.config.num_lookahead_tokens,
                plan.tokens_left,
                seq.max_new_tokens - len(seq.output_ids) - 1,
            )
            if not item.is_decode or wanted <= 0:
                continue
            extra = self._tokens_that_fit(seq, 1 + wanted) - 1
            if extra <= 0:
                continue
            self._take_pages(seq, seq.num_computed_tokens + 1 + extra)
            slots = self._slots(seq, item.start, item.start + 1 + extra)
            plan.items[seq_id] = replace(item, slots=slots, num_lookahead=extra)
            plan.tokens_left -= extra

    def _schedule_prefill(self, seq: Sequence, plan: StepPlan) -> None:
        if seq.status is not SequenceStatus.RUNNING:
            return
        wanted = plan.grant_prefill(seq.num_tokens - seq.num_computed_tokens)
        granted = self._grow(seq, wanted, plan, preempt=True) if wanted else 0
        if granted:
            self._emit(seq, granted, plan, is_decode=False)

    def _admit_waiting(self, plan: StepPlan) -> None:
        if plan.preempted and plan.items:
            return  # pages are short: admitting now would only thrash
        self._order_waiting()
        while self._waiting and len(self._running) < self.config.max_running_requests:
            seq = self._waiting[0]
            if self._outgrows_pool(seq):
                self._finish_here(seq, "length")
            elif not self._admit(seq, plan):
                return

    def _admit(self, seq: Sequence, plan: StepPlan) -> bool:
        tokens = seq.token_ids(0, seq.num_tokens)
        match = self.kv.match_prefix(tokens, seq.salt, limit=seq.num_tokens - 1, record_stats=False)
        seq.page_table = list(match.pages)
        seq.num_tree_pages = len(match.pages)
        seq.cache_handle = match.handle
        seq.num_computed_tokens = match.num_tokens
        wanted = plan.grant_prefill(seq.num_tokens - match.num_tokens)
        granted = self._grow(seq, wanted, plan, preempt=False) if wanted else 0
        if not granted:
            self._release_pages(seq)
            seq.num_computed_tokens = 0
            return False
        self._waiting.popleft()
        self._running.append(seq)
        seq.status = SequenceStatus.RUNNING
        self.kv.record_prefix_query(len(tokens), match.num_tokens)
        if seq.num_admissions == 0:
            seq.num_cached_tokens = match.num_tokens
        seq.num_admissions += 1
        self._emit(seq, granted, plan, is_decode=False)
        return True

    def _order_waiting(self) -> None:
        lpm = self.config.policy == "lpm" and self.kv.prefix_cache_enabled
        if not lpm or len(self._waiting) > _LPM_MAX_WAITING:
            return

        def cached_tokens(seq: Sequence) -> int:
            tokens = seq.token_ids(0, seq.num_tokens)
            return self.kv.peek_prefix(tokens, seq.salt, seq.num_tokens - 1)

        self._waiting = deque(sorted(self._waiting, key=lambda seq: -cached_tokens(seq)))

    def _grow(self, seq: Sequence, num_tokens: int, plan: StepPlan, preempt: bool) -> int:
        """Give ``seq`` pages for up to ``num_tokens`` new tokens; return how many fit."""
        while True:
            fit = self._tokens_that_fit(seq, num_tokens)
            if fit == num_tokens or (fit > 0 and self.config.chunking):
                break
            if not preempt:
                return 0
            self._preempt_latest(plan)
            if seq.status is not SequenceStatus.RUNNING:
                return 0
        self._take_pages(seq, seq.num_computed_tokens + fit)
        return fit

    def _take_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.page_table`` to hold ``num_tokens`` tokens (the pages must fit)."""
        needed = self.kv.pages_for_tokens(num_tokens) - len(seq.page_table)
        if needed > 0:
            pages = self.kv.allocate(needed)
            assert pages is not None, "available_pages promised more than allocate gave"
            seq.page_table.extend(pages)

    def _tokens_that_fit(self, seq: Sequence, num_tokens: int) -> int:
        capacity = (len(seq.page_table) + self.kv.available_pages) * self.config.page_size
        return max(0, min(num_tokens, capacity - seq.num_computed_tokens))

    def _preempt_latest(self, plan: StepPlan) -> None:
        candidates = [seq for seq in self._running if seq.seq_id not in plan.items]
        victim = max(candidates, key=lambda seq: seq.arrival)
        self._running.remove(victim)
        self._release_pages(victim)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        self._waiting.appendleft(victim)
        self.num_preemptions += 1
        plan.preempted = True

    def _emit(self, seq: Sequence, num_tokens: int, plan: StepPlan, is_decode: bool) -> None:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
        slots = self._slots(seq, start, end)
        sample = end == seq.num_tokens
        plan.add(
            ScheduledItem(
                seq, start, num_tokens, seq.token_ids(start, end), slots, sample, is_decode
            )
        )

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        page_size, table = self.config.page_size, seq.page_table
        return [table[pos // page_size] * page_size + pos % page_size for pos in range(start, end)]

    @staticmethod
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

    @staticmethod
    def _check_start(item: ScheduledItem) -> None:
        seq = item.seq
        if seq.num_computed_tokens != item.start:
            raise RuntimeError(
                f"sequence {seq.seq_id}: item starts at {item.start} but "
                f"{seq.num_computed_tokens} tokens are computed (step reported twice?)"
            )

    def _on_sampled(self, item: ScheduledItem, tokens: list[int]) -> None:
        seq = item.seq
        for token in tokens:
            seq.append_token(token)
        if not item.is_decode:
            self._commit_prefix(seq)
        if seq.prefill_only:
            self._export_prefilled(seq)

    def _export_prefilled(self, seq: Sequence) -> None:
        self._running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "prefilled"
        self._exported[seq.seq_id] = seq
        self._finished_here.append(seq)

    def _commit_prefix(self, seq: Sequence, num_tokens: int | None = None) -> None:
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
        seq.page_table[:full] = pages
        seq.num_tree_pages = full
        seq.cache_handle = handle

    def _release_pages(self, seq: Sequence) -> None:
        self._commit_prefix(seq)
        self.kv.release(seq.cache_handle, seq.page_table[seq.num_tree_pages :])
        seq.page_table = []
        seq.num_tree_pages = 0
        seq.cache_handle = None

    def _unqueue(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq in self._prefilled:
            self._prefilled.remove(seq)
        else:
            self._waiting.remove(seq)

    def _outgrows_pool(self, seq: Sequence) -> bool:
        return self.kv.pages_for_tokens(seq.num_tokens) > self.config.num_pages

    def _finish_here(self, seq: Sequence, reason: str) -> None:
        self.finish(seq, reason)
        self._finished_here.append(seq)

    def _take_reserved(self, pages: list[int]) -> None:
        stray = [page for page in pages if page not in self._reserved]
        if stray:
            raise ValueError(f"pages {stray} are not reserved")
        self._reserved.difference_update(pages)
