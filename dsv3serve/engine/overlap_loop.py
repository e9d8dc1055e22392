"""Overlap scheduling: the host schedules step n+1 and processes step n-1 while the device
runs step n (SGLang's overlap scheduler, vLLM's async scheduling).

A step is launched, not awaited: the forward and the sampler are queued on the device, the
sampled ids (with their logprobs) are copied to pinned host memory with ``non_blocking=True``
and an event is recorded. The sampler also writes the ids into :class:`FutureTokens`, a small
device ring buffer, and the scheduler appends a *placeholder* to each sampled sequence: the
negative id ``-(slot + 1)`` of the ring slot that will hold the token. The next step's decode
items carry those placeholders as input ids; an embedding pre-hook swaps them for the ring's
values on the device, so nothing waits for the host between steps.

Step ``n`` is resolved during the next ``Engine.step()``, after step ``n+1`` is launched: the
host waits for step ``n``'s event, replaces the placeholders with the real ids, runs the stop
checks and detokenizer, and emits. A sequence that turns out finished (stop token or string,
``max_new_tokens``) may already be in step ``n+1``: that step's work for it is rolled back
(its placeholder is dropped, its computed-token count restored) before its pages are freed,
and its extra token is never emitted. Aborts between steps roll back the same way.

Rows with repetition / frequency / presence penalties need their whole token history on the
host, and structured-output rows need their grammar matcher to have accepted the previous
token, so a step that samples such a row after a step still in flight resolves that one
first. The row's bitmask is then built on the host after the step's forward is queued, so
on CUDA it overlaps with that forward.
In a group, rank 0 (which samples) sends each step's ids to every rank, which writes them
into its own ring (``share_sampled``), so the followers' placeholders resolve on their devices
too. Speculative decoding runs without overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv3serve.engine.core import EngineCore, top_logprobs
from dsv3serve.engine.future_tokens import FutureTokens
from dsv3serve.engine.request import TokenOutput
from dsv3serve.engine.sampler import SampleOutput
from dsv3serve.engine.scheduler.sequence import ScheduledBatch, ScheduledItem, SequenceStatus


@dataclass
class HostSample:
    """A step's sampled ids, logprobs and top logprobs on their way to host memory."""

    token_ids: Tensor
    logprobs: Tensor
    top_logprobs: tuple[Tensor, Tensor] | None
    event: torch.Event | None = None

    @classmethod
    def start(cls, out: SampleOutput) -> HostSample:
        """Queue the device-to-host copies (pinned, non-blocking) and record an event."""
        if out.token_ids.device.type != "cuda":
            return cls(out.token_ids, out.logprobs, out.top_logprobs)
        top = out.top_logprobs
        event = torch.Event(device=out.token_ids.device)  # records in C++: see StaticInputs
        host = cls(_to_host(out.token_ids), _to_host(out.logprobs), None, event)
        if top is not None:
            host.top_logprobs = (_to_host(top[0]), _to_host(top[1]))
        assert host.event is not None
        host.event.record()
        return host

    def wait(self) -> tuple[list[int], list[float], tuple[list, list] | None]:
        """Block until the copies landed; the ids, logprobs and top logprobs as lists."""
        if self.event is not None:
            self.event.synchronize()
        top = self.top_logprobs
        tops = None if top is None else (top[0].tolist(), top[1].tolist())
        return self.token_ids.tolist(), self.logprobs.tolist(), tops


def _to_host(t: Tensor) -> Tensor:
    dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return dst.copy_(t, non_blocking=True)


@dataclass
class LaunchedStep:
    """A step whose device work is queued but whose tokens the host has not read yet."""

    batch: ScheduledBatch
    sampled_items: list[ScheduledItem]
    placeholders: list[int]
    host: HostSample
    by_seq: dict[str, ScheduledItem] = field(default_factory=dict)

    @property
    def sampled_ids(self) -> set[str]:
        return {item.seq_id for item in self.sampled_items}


class OverlapLoop:
    """``Engine.step()`` in overlap mode over the core's public stages; see the module
    docstring. While attached it is the core's ``in_flight_rollback``."""

    def __init__(self, core: EngineCore, future: FutureTokens) -> None:
        self.core = core
        self.future = future
        self.launched: LaunchedStep | None = None
        core.in_flight_rollback = self.rollback

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's tokens are still unread."""
        return self.launched is not None

    def detach(self) -> None:
        """Stop rolling back for the core (before another loop takes over)."""
        if self.launched is not None:
            raise RuntimeError("use_runner: a step is in flight; call it before any step")
        self.core.in_flight_rollback = None

    def step(self) -> list[TokenOutput]:
        """Schedule and launch step n+1, then resolve step n; returns step n's outputs."""
        core = self.core
        outputs = core.take_pending()
        batch = core.schedule()
        prev, self.launched = self.launched, None
        if batch is not None and prev is not None and self._needs_history(batch, prev):
            outputs += self._resolve(prev)
            prev, batch = None, _running_only(batch)
        if batch is not None:
            core.observe(batch.items)
            self.launched = self._launch(batch)
        if prev is not None:
            outputs += self._resolve(prev)
        return outputs + core.finished_by_scheduler()

    def rollback(self, item_seq_id: str) -> None:
        """Undo the in-flight step's work for a sequence about to finish or abort."""
        item = None if self.launched is None else self.launched.by_seq.get(item_seq_id)
        if item is not None:
            self.core.scheduler.rollback_launch(item)

    def _needs_history(self, batch: ScheduledBatch, prev: LaunchedStep) -> bool:
        """Whether a penalised or grammar-constrained row of ``batch`` has an unresolved
        token of ``prev``."""
        pending = prev.sampled_ids
        for item in batch.sample_items:
            state = self.core.state(item.seq_id)
            if state is None or item.seq_id not in pending:
                continue
            if state.params.has_penalties or state.grammar is not None:
                return True
        return False

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        core = self.core
        result = core.runner.run(batch.items)
        sampled = core.sample(result)
        start = self.future.reserve(len(result.sampled_items))
        self.future.store(start, sampled.token_ids)
        core.runner.share_sampled(start, sampled.token_ids)  # a group's other ranks' rings
        placeholders = self.future.placeholders(start, len(result.sampled_items))
        core.scheduler.on_step_launched(
            batch,
            {item.seq_id: p for item, p in zip(result.sampled_items, placeholders, strict=True)},
        )
        host = HostSample.start(sampled)
        by_seq = {item.seq_id: item for item in batch.items}
        return LaunchedStep(batch, result.sampled_items, placeholders, host, by_seq)

    def _resolve(self, step: LaunchedStep) -> list[TokenOutput]:
        """Wait for ``step``'s tokens, put them in place of its placeholders and emit."""
        core = self.core
        tokens, logprobs, tops = step.host.wait()
        outputs = []
        for row, item in enumerate(step.sampled_items):
            if not core.scheduler.resolve_token(item, step.placeholders[row], tokens[row]):
                continue  # rolled back: finished or aborted after the launch
            state = core.state(item.seq_id)
            if state is None:
                continue
            top = {} if tops is None else top_logprobs(state, tops, row)
            end = item.start + item.num_tokens + 1 - len(item.seq.prompt_ids)
            outputs.append(core.emit(state, [logprobs[row]], [top], end=end))
        return outputs


def _running_only(batch: ScheduledBatch) -> ScheduledBatch | None:
    """``batch`` without the items of sequences that finished since it was scheduled."""
    items = [item for item in batch.items if item.seq.status is SequenceStatus.RUNNING]
    return ScheduledBatch(items) if items else None
