"""The engine core: the per-sequence output state and the stages every step loop is built
from (schedule, launch, resolve, emit). The loops (``engine/loops.py``: plain and
speculative, ``engine/overlap_loop.py``: overlapped) use only this public surface."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv3serve.engine.grammar import GrammarCompiler, GrammarState, full_bitmask
from dsv3serve.engine.intake import InvalidRequestError, check_logit_bias, prompt_ids
from dsv3serve.engine.model_runner import StepResult
from dsv3serve.engine.protocols import StepRunner, StepScheduler
from dsv3serve.engine.request import Request, TokenOutput
from dsv3serve.engine.sampler import SampleOutput, Sampler, SamplingBatch, make_generator
from dsv3serve.engine.scheduler.sequence import ScheduledBatch, ScheduledItem, Sequence
from dsv3serve.engine.speculative.accept import mask_early_stop
from dsv3serve.metrics import Metrics
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.sampling.stop import StopStringMatcher, check_stop_token
from dsv3serve.tokenizer.detokenizer import IncrementalDetokenizer
from dsv3serve.tokenizer.tokenizer import Tokenizer

TopLists = tuple[list[list[float]], list[list[int]]]  # top logprobs, their token ids; per row


@dataclass
class SeqState:
    """Per-sequence output state the scheduler does not know about."""

    seq: Sequence
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    stop: StopStringMatcher
    emitted: int = 0  # output tokens already reported
    grammar: GrammarState | None = None  # structured output: the sequence's matcher


def top_logprobs(state: SeqState, tops: TopLists, row: int) -> dict[int, float]:
    """Row ``row`` of a step's top logprobs, cut to what ``state``'s request asked for."""
    k = state.params.logprobs or 0
    return dict(zip(tops[1][row][:k], tops[0][row][:k], strict=True))


def ended_output(state: SeqState, reason: str | None) -> TokenOutput:
    """The last, empty output of a sequence that ends without a new token."""
    seq = state.seq
    return TokenOutput(
        seq.request_id,
        state.index,
        [],
        "",
        True,
        reason,
        prompt_tokens=len(seq.prompt_ids),
        completion_tokens=len(seq.output_ids),
    )


class EngineCore:
    """The stages of a step, over one scheduler, runner and sampler.

    Contract (what each stage may touch):

    - ``schedule()``: the scheduler only (queues, pages); returns the step's batch.
    - ``observe(items)``: step metrics and ``first_scheduled_time`` only.
    - launch (the loop's): ``runner.run(items)`` then ``sample(result)``, which reads the
      sampled sequences' states (parameters, generators, token history) and queues device
      work; neither changes a sequence. The loop then records the step with the scheduler
      (``on_step_done``, or ``on_step_launched`` and later ``resolve_token``).
    - ``emit(state, ...)``: the only stage that ends sequences. It detokenizes, checks
      stops, and on a stop rolls back the in-flight work (``in_flight_rollback``), ends
      the sequence in the scheduler and drops its state; a prefill-only sequence that
      did not stop goes to ``on_prefilled``.
    - ``take_pending()`` / ``finished_by_scheduler()``: outputs made between steps
      (aborts, imported first tokens) and for sequences the scheduler ended itself.
    """

    def __init__(
        self,
        scheduler: StepScheduler,
        runner: StepRunner,
        sampler: Sampler,
        tokenizer: Tokenizer,
        vocab_size: int,
        any_whitespace: bool = False,
    ) -> None:
        """``any_whitespace``: structured JSON output may hold free whitespace
        (``GrammarCompiler``); off, it is compact."""
        self.scheduler, self.runner, self.sampler = scheduler, runner, sampler
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.grammars = GrammarCompiler(tokenizer, vocab_size, any_whitespace=any_whitespace)
        self.metrics: Metrics | None = None
        self.states: dict[str, SeqState] = {}
        self.on_prefilled: Callable[[Sequence], None] = _ignore
        self.in_flight_rollback: Callable[[str], None] | None = None
        self._pending: list[TokenOutput] = []

    # ---- requests -------------------------------------------------------------------
    def prompt_ids(self, req: Request) -> list[int]:
        """``req``'s validated prompt ids (tokenized when given as text); also checks the
        parameters that depend on the model (``logit_bias`` ids, the constraint compiles)."""
        ids = prompt_ids(req, self.tokenizer, self.vocab_size)
        check_logit_bias(req.params, self.vocab_size)
        if req.params.constraint is not None:
            self.grammars.compile(req.params.constraint)
        return ids

    def check_new_id(self, request_id: str) -> None:
        """Raise InvalidRequestError when ``request_id`` is already running here."""
        if any(s.seq.request_id == request_id for s in self.states.values()):
            raise InvalidRequestError(f"request id {request_id!r} is already running")

    def track(
        self, seq: Sequence, index: int, params: SamplingParams, context: list[int]
    ) -> SeqState:
        """Start ``seq``'s output state; ``context`` primes its detokenizer."""
        seed = params.seed
        gen = None if seed is None else make_generator(seed + index, self.runner.device)
        detok = IncrementalDetokenizer(self.tokenizer, context, params.skip_special_tokens)
        state = SeqState(seq, index, params, gen, detok, StopStringMatcher(params.stop))
        if params.constraint is not None:
            state.grammar = self.grammars.new_state(params.constraint)
        self.states[seq.seq_id] = state
        return state

    def state(self, seq_id: str) -> SeqState | None:
        """The output state of a live sequence (None once it ended)."""
        return self.states.get(seq_id)

    def drop_state(self, seq_id: str) -> SeqState | None:
        """Forget ``seq_id``'s output state; returns it (None when unknown)."""
        return self.states.pop(seq_id, None)

    def has_unfinished(self) -> bool:
        """Whether outputs wait or a tracked sequence is not finished."""
        return bool(self._pending) or any(not s.seq.is_finished for s in self.states.values())

    def abort(self, request_id: str) -> bool:
        """End every sequence of ``request_id``; their last outputs wait in the pending list."""
        states = [s for s in self.states.values() if s.seq.request_id == request_id]
        for s in states:
            self._rollback(s.seq)
        found = self.scheduler.abort(request_id)
        for s in states:
            del self.states[s.seq.seq_id]
            self._pending.append(ended_output(s, "abort"))
        return found or bool(states)

    # ---- step stages ------------------------------------------------------------------
    def take_pending(self) -> list[TokenOutput]:
        """The outputs made between steps, in order; the list starts empty again."""
        outputs, self._pending = self._pending, []
        return outputs

    def push_pending(self, output: TokenOutput) -> None:
        """Queue an output made between steps for the next ``step()``."""
        self._pending.append(output)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (None when nothing can run)."""
        return self.scheduler.schedule()

    def observe(self, items: list[ScheduledItem]) -> None:
        """Step metrics: batch size, tokens, and queue time of first-scheduled sequences."""
        now = time.monotonic()
        for item in items:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
                if self.metrics is not None:
                    self.metrics.queue_time.observe(now - item.seq.arrival_time)
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(items))
            self.metrics.step_tokens.observe(sum(item.num_tokens for item in items))

    def sample(self, result: StepResult) -> SampleOutput:
        """Sample one token per row of ``result`` with each sequence's parameters."""
        states = [self.states[item.seq.seq_id] for item in result.sampled_items]
        params = [s.params for s in states]
        num_outputs = [len(s.seq.output_ids) for s in states]
        eos = self.tokenizer.eos_token_id
        logits = mask_early_stop(result.logits, params, num_outputs, eos)
        batch = SamplingBatch.build(
            params,
            [s.generator for s in states],
            [s.seq.prompt_ids for s in states],
            [s.seq.output_ids for s in states],
            self.vocab_size,
            self.runner.device,
            self.grammar_bitmask(states),
        )
        return self.sampler.sample(logits, batch)

    def grammar_bitmask(self, states: list[SeqState]) -> torch.Tensor | None:
        """Host int32 [B, W] allowed-token bitmask of the next token of each of ``states``
        (all ones on unconstrained rows), or None when none is constrained. Each matcher
        first accepts its sequence's committed outputs (they must all be real ids)."""
        if all(s.grammar is None for s in states):
            return None
        bitmask = full_bitmask(len(states), self.vocab_size)
        for row, s in enumerate(states):
            if s.grammar is not None:
                s.grammar.sync(s.seq.output_ids)
                s.grammar.fill(bitmask, row)
        return bitmask

    def emit(
        self,
        state: SeqState,
        logprobs: list[float],
        tops: list[dict[int, float]],
        end: int | None = None,
    ) -> TokenOutput:
        """Report the ``len(logprobs)`` output tokens before ``end`` (default: the last
        ones), up to the first that stops; a stop ends the sequence."""
        seq, params = state.seq, state.params
        end = len(seq.output_ids) if end is None else end
        done = end - len(logprobs)
        text, reason, kept = self._scan(state, done, end)
        out = TokenOutput(
            seq.request_id,
            state.index,
            seq.output_ids[done : done + kept],
            text,
            reason is not None,
            reason,
            logprobs[:kept] if params.logprobs is not None else [],
            tops[:kept] if params.logprobs else [],
            len(seq.prompt_ids),
            done + kept,
            seq.num_cached_tokens,
        )
        if reason is not None:
            self._finish(state, reason)
        elif seq.prefill_only:
            self.on_prefilled(seq)
        return out

    def finished_by_scheduler(self) -> list[TokenOutput]:
        """Outputs for sequences the scheduler ended itself (context outgrew the pool)."""
        outputs = []
        for seq in self.scheduler.pop_finished():
            state = self.states.get(seq.seq_id)
            if seq.finish_reason == "prefilled" or state is None:
                continue
            self.states.pop(seq.seq_id)
            outputs.append(ended_output(state, seq.finish_reason))
        return outputs

    # ---- internals --------------------------------------------------------------------
    def _scan(self, state: SeqState, done: int, end: int) -> tuple[str, str | None, int]:
        """Detokenize output tokens ``done .. end-1`` up to the first that stops: the
        text, the finish reason (None: no stop) and how many tokens were kept."""
        seq, params, eos = state.seq, state.params, self.tokenizer.eos_token_id
        text, reason, kept = "", None, 0
        while reason is None and done + kept < end:
            token = seq.output_ids[done + kept]
            kept += 1
            reason = check_stop_token(token, done + kept, params, eos)
            if reason != "stop":
                piece, hit = state.stop.feed(state.detok.add(token))
                text, reason = text + piece, "stop" if hit else reason
        if reason is not None and not state.stop.stopped:
            text += state.stop.feed(state.detok.flush())[0] + state.stop.flush()
        return text, reason, kept

    def _finish(self, state: SeqState, reason: str) -> None:
        seq = state.seq
        self._rollback(seq)
        if seq.prefill_only and seq.finish_reason == "prefilled":
            self.scheduler.release_exported(seq)
        else:
            self.scheduler.finish(seq, reason)
        self.states.pop(seq.seq_id, None)

    def _rollback(self, seq: Sequence) -> None:
        """Drop the in-flight step's work for ``seq`` before it ends (overlap mode)."""
        if self.in_flight_rollback is not None:
            self.in_flight_rollback(seq.seq_id)


def _ignore(_seq: Sequence) -> None:
    """The default ``on_prefilled``: nothing records exports."""
