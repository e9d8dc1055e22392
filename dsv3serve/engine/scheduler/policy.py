"""Step building: which tokens of which sequences run next (admission, ordering, page growth,
preemption and speculative lookahead), pure Python.

Each step gets a decode token for every running sequence that has finished its prefill, then
(with lookahead) draft slots for those decodes, then prefill chunks of running sequences,
then newly admitted waiting sequences, within the step's token budgets. When pages run out
for a running sequence, the most recently arrived running sequence not yet in the step is
preempted in recompute mode: its pages go back (full ones through the prefix cache) and it
waits at the front of the queue to recompute its prompt and output so far.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from dsv3serve.engine.scheduler.sequence import (
    ScheduledBatch,
    ScheduledItem,
    Sequence,
    SequenceStatus,
    StepPlan,
)
from dsv3serve.engine.scheduler.state import SchedState

# Longest-prefix-match ordering looks up every waiting sequence; past this queue length
# the scheduler falls back to arrival order.
_LPM_MAX_WAITING = 256


class StepPolicy:
    """Builds one step over a :class:`SchedState`; it changes queues and pages only."""

    def __init__(self, state: SchedState) -> None:
        self.state = state

    def build(self) -> ScheduledBatch | None:
        """The next step, or None when nothing can run."""
        st = self.state
        self._admit_prefilled()
        plan = StepPlan.start(st.config)
        running = sorted(st.running, key=lambda seq: seq.arrival)
        for seq in running:
            if seq.num_computed_tokens == seq.num_tokens - 1:
                self._schedule_decode(seq, plan)
        if st.config.num_lookahead_tokens:
            self._grant_lookahead(plan)
        for seq in running:
            if seq.num_computed_tokens < seq.num_tokens - 1:
                self._schedule_prefill(seq, plan)
        self._admit_waiting(plan)
        return plan.to_batch()

    def _admit_prefilled(self) -> None:
        st = self.state
        while st.prefilled and len(st.running) < st.config.max_running_requests:
            seq = st.prefilled.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_admissions += 1
            st.running.append(seq)

    def _schedule_decode(self, seq: Sequence, plan: StepPlan) -> None:
        if seq.status is not SequenceStatus.RUNNING or plan.tokens_left < 1:
            return
        if seq.num_generation_slots_left <= 0:
            return  # overlap mode: its last token is in flight and will finish it
        if self.state.outgrows_pool(seq):
            self.state.finish_here(seq, "length")
        elif self._grow(seq, 1, plan, preempt=True):
            self._add_item(seq, 1, plan, is_decode=True)

    def _grant_lookahead(self, plan: StepPlan) -> None:
        """Give decode items slots for draft tokens, as far as pages fit without preempting.

        A decode never drafts past its ``max_new_tokens``: a step commits at most
        ``1 + num_lookahead`` tokens.
        """
        st = self.state
        for seq_id, item in list(plan.items.items()):
            seq = item.seq
            wanted = min(
                st.config.num_lookahead_tokens,
                plan.tokens_left,
                seq.max_new_tokens - len(seq.output_ids) - 1,
            )
            if not item.is_decode or wanted <= 0:
                continue
            extra = st.tokens_that_fit(seq, 1 + wanted) - 1
            if extra <= 0:
                continue
            st.take_pages(seq, seq.num_computed_tokens + 1 + extra)
            slots = st.slots(seq, item.start, item.start + 1 + extra)
            plan.items[seq_id] = replace(item, slots=slots, num_lookahead=extra)
            plan.tokens_left -= extra

    def _schedule_prefill(self, seq: Sequence, plan: StepPlan) -> None:
        if seq.status is not SequenceStatus.RUNNING:
            return
        wanted = plan.grant_prefill(seq.num_tokens - seq.num_computed_tokens)
        granted = self._grow(seq, wanted, plan, preempt=True) if wanted else 0
        if granted:
            self._add_item(seq, granted, plan, is_decode=False)

    def _admit_waiting(self, plan: StepPlan) -> None:
        st = self.state
        if plan.preempted and plan.items:
            return  # pages are short: admitting now would only thrash
        self._order_waiting()
        while st.waiting and len(st.running) < st.config.max_running_requests:
            seq = st.waiting[0]
            if st.outgrows_pool(seq):
                st.finish_here(seq, "length")
            elif not self._admit(seq, plan):
                return

    def _admit(self, seq: Sequence, plan: StepPlan) -> bool:
        st = self.state
        tokens = seq.token_ids(0, seq.num_tokens)
        match = st.kv.match_prefix(tokens, seq.salt, limit=seq.num_tokens - 1, record_stats=False)
        seq.page_table = list(match.pages)
        seq.num_tree_pages = len(match.pages)
        seq.cache_handle = match.handle
        seq.num_computed_tokens = match.num_tokens
        wanted = plan.grant_prefill(seq.num_tokens - match.num_tokens)
        granted = self._grow(seq, wanted, plan, preempt=False) if wanted else 0
        if not granted:
            st.release_pages(seq)
            seq.num_computed_tokens = 0
            return False
        st.waiting.popleft()
        st.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        st.kv.record_prefix_query(len(tokens), match.num_tokens, match.host_tokens)
        if seq.num_admissions == 0:
            seq.num_cached_tokens = match.num_tokens
        seq.num_admissions += 1
        self._add_item(seq, granted, plan, is_decode=False)
        return True

    def _order_waiting(self) -> None:
        st = self.state
        lpm = st.config.policy == "lpm" and st.kv.prefix_cache_enabled
        if not lpm or len(st.waiting) > _LPM_MAX_WAITING:
            return

        def cached_tokens(seq: Sequence) -> int:
            tokens = seq.token_ids(0, seq.num_tokens)
            return st.kv.peek_prefix(tokens, seq.salt, seq.num_tokens - 1)

        st.waiting = deque(sorted(st.waiting, key=lambda seq: -cached_tokens(seq)))

    def _grow(self, seq: Sequence, num_tokens: int, plan: StepPlan, preempt: bool) -> int:
        """Give ``seq`` pages for up to ``num_tokens`` new tokens; return how many fit."""
        st = self.state
        while True:
            fit = st.tokens_that_fit(seq, num_tokens)
            if fit == num_tokens or (fit > 0 and st.config.chunking):
                break
            if not preempt:
                return 0
            self._preempt_latest(plan)
            if seq.status is not SequenceStatus.RUNNING:
                return 0
        st.take_pages(seq, seq.num_computed_tokens + fit)
        return fit

    def _preempt_latest(self, plan: StepPlan) -> None:
        st = self.state
        candidates = [seq for seq in st.running if seq.seq_id not in plan.items]
        victim = max(candidates, key=lambda seq: seq.arrival)
        st.running.remove(victim)
        st.release_pages(victim)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        st.waiting.appendleft(victim)
        st.num_preemptions += 1
        plan.preempted = True

    def _add_item(self, seq: Sequence, num_tokens: int, plan: StepPlan, is_decode: bool) -> None:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
        slots = self.state.slots(seq, start, end)
        if not is_decode:
            self.state.num_prefill_tokens += num_tokens
        sample = end == seq.num_tokens
        plan.add(
            ScheduledItem(
                seq, start, num_tokens, seq.token_ids(start, end), slots, sample, is_decode
            )
        )
