"""The scheduler's side of overlap scheduling: a launched step's placeholders, their
resolution to real tokens, and the rollback of a launch whose sequence ends (pure Python).

See ``engine/overlap_loop.py`` for the placeholders (negative ids of a device ring's slots).
"""

from __future__ import annotations

from collections.abc import Mapping

from dsv3serve.engine.scheduler.pd import PDPages
from dsv3serve.engine.scheduler.sequence import ScheduledBatch, ScheduledItem, SequenceStatus
from dsv3serve.engine.scheduler.state import SchedState, check_start


class LaunchBook:
    """Launch / resolve / rollback bookkeeping over a :class:`SchedState`."""

    def __init__(self, state: SchedState, pd: PDPages) -> None:
        self.state, self.pd = state, pd

    def on_step_launched(self, batch: ScheduledBatch, placeholders: Mapping[str, int]) -> None:
        """``batch`` is queued on the device: advance KV progress, append placeholders.

        A prefill-only sequence is exported now; other prefix-cache inserts wait for
        :meth:`resolve_token`. Lookahead (speculative) items are refused.
        """
        for item in batch.items:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            check_start(item)
            if item.num_lookahead:
                raise ValueError(f"sequence {seq.seq_id}: lookahead items cannot overlap")
            seq.num_computed_tokens = item.start + item.num_tokens
            if item.sample:
                seq.append_token(placeholders[seq.seq_id])
                if seq.prefill_only:
                    self.state.commit_prefix(seq)
                    self.pd.export(seq)

    def resolve_token(self, item: ScheduledItem, placeholder: int, token: int) -> bool:
        """Put ``token`` where ``item``'s launch appended ``placeholder``; False (a no-op)
        when the placeholder is gone because the launch was rolled back."""
        seq = item.seq
        index = item.start + item.num_tokens - len(seq.prompt_ids)
        if index >= len(seq.output_ids) or seq.output_ids[index] != placeholder:
            return False
        seq.output_ids[index] = token
        if seq.status is SequenceStatus.RUNNING and not item.is_decode:
            self.state.commit_prefix(seq, item.start + item.num_tokens)
        return True

    @staticmethod
    def rollback_launch(item: ScheduledItem) -> None:
        """Undo :meth:`on_step_launched` for ``item`` (its sequence ends now)."""
        seq = item.seq
        seq.num_computed_tokens = min(seq.num_computed_tokens, item.start)
        if item.sample:
            del seq.output_ids[item.start + item.num_tokens - len(seq.prompt_ids) :]
