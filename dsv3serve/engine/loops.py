"""The step loops that finish each step before returning: plain and speculative.

Both are built from :class:`~dsv3serve.engine.core.EngineCore`'s stages only (the
overlapped loop is ``engine/overlap_loop.py``). Every loop has ``step()`` and ``in_flight``.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from dsv3serve.engine.core import EngineCore, top_logprobs
from dsv3serve.engine.model_runner import StepResult
from dsv3serve.engine.request import TokenOutput
from dsv3serve.engine.sampler import SampleOutput
from dsv3serve.engine.scheduler.sequence import ScheduledBatch, ScheduledItem
from dsv3serve.engine.speculative.accept import SpecVerifier, VerifyRequest
from dsv3serve.engine.speculative.loop import SpecDecoder
from dsv3serve.engine.speculative.stats import SpecStats


class StepLoop(Protocol):
    """What ``Engine.step()`` runs."""

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's tokens are still unread."""
        ...

    def step(self) -> list[TokenOutput]:
        """One scheduler iteration; the outputs it resolved."""
        ...


class PlainLoop:
    """Schedule, run, sample, record and emit, back to back."""

    in_flight = False

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def step(self) -> list[TokenOutput]:
        """Run one step to the end; returns its outputs and the pending ones."""
        core = self.core
        outputs, batch = _begin_step(core)
        if batch is not None:
            result = core.runner.run(batch.items)
            sampled = core.sample(result)
            tokens = sampled.token_ids.tolist()
            rows = zip(result.sampled_items, tokens, strict=True)
            by_seq = {item.seq.seq_id: int(t) for item, t in rows}
            core.scheduler.on_step_done(batch, by_seq)
            outputs += self._emit_all(result, sampled)
        return outputs + core.finished_by_scheduler()

    def _emit_all(self, result: StepResult, out: SampleOutput) -> list[TokenOutput]:
        outputs = []
        logprobs = out.logprobs.tolist()
        tops = None
        if out.top_logprobs is not None:
            tops = (out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist())
        for row, item in enumerate(result.sampled_items):
            state = self.core.state(item.seq.seq_id)
            if state is None or not item.seq.output_ids:
                continue
            top = {} if tops is None else top_logprobs(state, tops, row)
            outputs.append(self.core.emit(state, [logprobs[row]], [top]))
        return outputs


class SpecLoop:
    """Draft, verify and commit: a decode item gains 1 to 1 + lookahead tokens a step."""

    in_flight = False

    def __init__(self, core: EngineCore, spec: SpecDecoder, stats: SpecStats) -> None:
        self.core, self.spec, self.stats = core, spec, stats
        eos = core.tokenizer.eos_token_id
        self.verifier = SpecVerifier(core.vocab_size, eos, core.sampler.generator)

    def step(self) -> list[TokenOutput]:
        """Run one speculative step to the end; returns its outputs and the pending ones."""
        core = self.core
        outputs, batch = _begin_step(core)
        if batch is not None:
            outputs += self._spec_step(batch)
        outputs += core.finished_by_scheduler()
        self.spec.retain(core.states)
        return outputs

    def _spec_step(self, batch: ScheduledBatch) -> list[TokenOutput]:
        spec = self.spec
        drafts = spec.propose(batch.items)
        sampled = [item for item in batch.items if item.sample]
        masks = self._grammar_masks(sampled, drafts)
        target = spec.verify_forward(batch.items, drafts)
        requests = [
            self._verify_request(item, drafts.get(item.seq_id, []), masks.get(item.seq_id))
            for item in sampled
        ]
        verified = self.verifier.verify(target.logits, requests)
        committed = {item.seq_id: v.tokens for item, v in zip(sampled, verified, strict=True)}
        self.core.scheduler.on_step_done(batch, committed)
        spec.extend(batch.items, target)
        outputs = []
        for item, v in zip(sampled, verified, strict=True):
            self.stats.record(v.num_drafts, v.num_accepted, self.core.metrics)
            state = self.core.state(item.seq_id)
            if state is not None:
                outputs.append(self.core.emit(state, v.logprobs, v.top_logprobs))
        return outputs

    def _grammar_masks(
        self, sampled: list[ScheduledItem], drafts: dict[str, list[int]]
    ) -> dict[str, Tensor]:
        """Bitmask rows [1 + drafts, W] of each constrained item's verified positions; its
        drafts are cut (in ``drafts``) to the prefix its grammar allows."""
        masks = {}
        for item in sampled:
            grammar = self.core.states[item.seq_id].grammar
            if grammar is None:
                continue
            grammar.sync(item.seq.output_ids)
            kept, masks[item.seq_id] = grammar.draft_masks(drafts.get(item.seq_id, []))
            if item.seq_id in drafts:
                drafts[item.seq_id] = kept
        return masks

    def _verify_request(
        self, item: ScheduledItem, drafts: list[int], bitmask: Tensor | None
    ) -> VerifyRequest:
        state = self.core.states[item.seq_id]
        seq = state.seq
        return VerifyRequest(
            state.params, state.generator, seq.prompt_ids, seq.output_ids, drafts, bitmask
        )


def _begin_step(core: EngineCore) -> tuple[list[TokenOutput], ScheduledBatch | None]:
    """The pending outputs and the scheduled (and observed) batch of a step."""
    outputs = core.take_pending()
    batch = core.schedule()
    if batch is not None:
        core.observe(batch.items)
    return outputs, batch
