"""The engine: scheduler + model runner + sampler + detokenizer, one ``step()`` at a time.

A step is schedule (CPU), run (device: forward and sample), then process (CPU: stop checks,
detokenize). Without overlap they run back to back. With the overlap scheduler (on by default
on CUDA, ``disable_overlap_schedule`` turns it off, ``force_overlap_schedule`` turns it on off
CUDA) the host schedules and launches step n+1 before it processes step n, whose tokens the
new step reads through device-side placeholders: see ``engine/overlap.py``. Speculative
decoding and multi-rank groups (``use_runner``) always run without overlap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.model_runner import ModelRunner, StepResult
from dsv3serve.engine.overlap import OverlapLoop
from dsv3serve.engine.request import Request, TokenOutput
from dsv3serve.engine.sampler import SampleOutput, Sampler, SamplingBatch, make_generator
from dsv3serve.engine.sampling_params import SamplingParams
from dsv3serve.engine.scheduler import Scheduler
from dsv3serve.engine.sequence import ScheduledBatch, ScheduledItem, SchedulerConfig, Sequence
from dsv3serve.engine.spec.accept import SpecVerifier, VerifyRequest, mask_early_stop
from dsv3serve.engine.spec.loop import DraftState, SpecDecoder
from dsv3serve.engine.spec.stats import SpecStats
from dsv3serve.engine.stop import StopStringMatcher, check_stop_token
from dsv3serve.metrics import EngineState, Metrics
from dsv3serve.tokenizer.detokenizer import IncrementalDetokenizer
from dsv3serve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """A request that can never run (bad prompt, too long, duplicate id)."""


@dataclass
class _SeqState:
    """Per-sequence output state the scheduler does not know about."""

    seq: Sequence
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    stop: StopStringMatcher
    emitted: int = 0  # output tokens already reported


@dataclass(frozen=True)
class KVExport:
    """What a prefill-only request hands to the decode side.

    With speculative decoding the pages also hold the draft layer's KV, and ``draft``
    is where the decode side's first draft chain starts (see ``import_kv``).
    """

    request_id: str
    prompt_ids: list[int]
    first_token: int
    pages: list[int]
    page_size: int
    draft: DraftState | None = None


def resolve_model_dir(cfg: EngineConfig) -> Path:
    """``tiny``: the tiny checkpoint, made once; a preset name: config only (dummy loads)."""
    from dsv3serve.model.presets import PRESETS, preset_dir
    from dsv3serve.model.tiny import cached_tiny_checkpoint

    if cfg.model == "tiny":
        return cached_tiny_checkpoint()
    if cfg.model in PRESETS:
        if cfg.load_format != "dummy":
            raise ValueError(f"model {cfg.model!r} is a config preset: use load_format='dummy'")
        return preset_dir(cfg.model, cfg.hf_overrides)
    return Path(cfg.model)


class Engine:
    """Continuous-batching DeepSeek-V3 engine for one model replica."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        model_dir = resolve_model_dir(cfg)
        self.model_cfg = ModelConfig.from_hf(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.runner = ModelRunner(cfg, model_dir, self.model_cfg)
        max_len = cfg.max_model_len or self.model_cfg.max_position_embeddings
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=cfg.page_size,
                num_pages=self.runner.num_pages,
                max_running_requests=cfg.max_running_requests,
                chunked_prefill_size=cfg.chunked_prefill_size,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_context_len=max_len,
                policy=cfg.schedule_policy,
                enable_prefix_cache=cfg.enable_prefix_caching,
                num_lookahead_tokens=cfg.spec_num_steps,
            )
        )
        self.sampler = Sampler(make_generator(cfg.seed, self.runner.device))
        self.spec: SpecDecoder | None = None
        self.spec_stats = SpecStats(cfg.spec_num_steps)
        if cfg.spec_num_steps:
            quant = cfg.speculative_draft_model_quantization
            self.spec = SpecDecoder(self.runner, cfg.spec_num_steps, quant)
        eos = self.tokenizer.eos_token_id
        self._verifier = SpecVerifier(self.model_cfg.vocab_size, eos, self.sampler.generator)
        self._states: dict[str, _SeqState] = {}
        self._pending: list[TokenOutput] = []
        self._exports: dict[str, KVExport] = {}
        self.metrics: Metrics | None = None  # set by the serving layer
        self._overlap: OverlapLoop | None = None
        if self.runner.future is not None:
            self._overlap = OverlapLoop(self, self.runner.future)
        elif cfg.model_copy(update={"speculative_algorithm": None}).overlap_schedule:
            logger.info("overlap schedule off: speculative decoding runs without it")

    @property
    def overlap(self) -> bool:
        """Whether steps run with the overlap scheduler."""
        return self._overlap is not None

    def use_runner(self, runner: Any) -> None:
        """Run steps through ``runner`` (e.g. a group leader wrapping ``self.runner``)."""
        if self.spec is not None:
            raise ValueError(
                "speculative_algorithm: speculative decoding runs on one rank only; a "
                "multi-rank group does not replicate the draft steps yet"
            )
        if self._overlap is not None:
            if self._overlap.launched is not None:
                raise RuntimeError("use_runner: a step is in flight; call it before any step")
            logger.info("overlap schedule off: multi-rank groups run without it")
            self._overlap = None
        self.runner = runner

    # ---- requests -------------------------------------------------------------------
    def _prompt_ids(self, req: Request) -> list[int]:
        if (req.prompt is None) == (req.prompt_ids is None):
            raise InvalidRequestError("exactly one of prompt and prompt_ids must be given")
        ids = (
            req.prompt_ids
            if req.prompt_ids is not None
            else self.tokenizer.encode(req.prompt or "", add_bos=True)
        )
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        return list(ids)

    def add_request(self, req: Request, prefill_only: bool = False) -> None:
        """Queue ``req``; raises InvalidRequestError / ContextLengthError before any work."""
        self._check_new_id(req.request_id)
        if prefill_only and req.params.n != 1:
            raise InvalidRequestError("prefill-only requests take n=1")
        prompt = self._prompt_ids(req)
        for i in range(req.params.n):
            seq = self._new_sequence(req, i, prompt, prefill_only=prefill_only)
            self.scheduler.add(seq)  # the first may raise ContextLengthError; all share it
            self._track(seq, i, req.params, prompt)

    def _check_new_id(self, request_id: str) -> None:
        if any(s.seq.request_id == request_id for s in self._states.values()):
            raise InvalidRequestError(f"request id {request_id!r} is already running")

    @staticmethod
    def _new_sequence(req: Request, index: int, prompt: list[int], **extra: Any) -> Sequence:
        return Sequence(
            seq_id=f"{req.request_id}#{index}",
            prompt_ids=prompt,
            max_new_tokens=req.params.max_new_tokens,
            request_id=req.request_id,
            salt=req.salt,
            **extra,
        )

    def _track(self, seq: Sequence, index: int, params: SamplingParams, context: list[int]):
        seed = params.seed
        gen = None if seed is None else make_generator(seed + index, self.runner.device)
        detok = IncrementalDetokenizer(self.tokenizer, context, params.skip_special_tokens)
        state = _SeqState(seq, index, params, gen, detok, StopStringMatcher(params.stop))
        self._states[seq.seq_id] = state

    def abort(self, request_id: str) -> bool:
        """Abort every sequence of ``request_id`` in any state; frees all its pages."""
        states = [s for s in self._states.values() if s.seq.request_id == request_id]
        self._exports.pop(request_id, None)
        for s in states:
            self._rollback(s.seq)
        found = self.scheduler.abort(request_id)
        for s in states:
            del self._states[s.seq.seq_id]
            self._pending.append(
                TokenOutput(
                    request_id,
                    s.index,
                    [],
                    "",
                    True,
                    "abort",
                    prompt_tokens=len(s.seq.prompt_ids),
                    completion_tokens=len(s.seq.output_ids),
                )
            )
        return found or bool(states)

    def has_unfinished(self) -> bool:
        """Whether any sequence still needs steps (exported prefills do not)."""
        if self._pending or (self._overlap is not None and self._overlap.launched is not None):
            return True
        return any(not s.seq.is_finished for s in self._states.values())

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Run one scheduler iteration; returns the new outputs of every sequence.

        With the overlap scheduler the outputs are those of the previous step's tokens.
        """
        if self._overlap is not None:
            return self._overlap.step()
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch is not None and self.spec is not None:
            self._observe(batch.items)
            outputs += self._spec_step(self.spec, batch)
        elif batch is not None:
            self._observe(batch.items)
            result = self.runner.run(batch.items)
            sampled = self._sample(result)
            self.scheduler.on_step_done(
                batch,
                {
                    item.seq.seq_id: int(tok)
                    for item, tok in zip(
                        result.sampled_items, sampled.token_ids.tolist(), strict=True
                    )
                },
            )
            outputs += self._process(result, sampled)
        outputs += self._scheduler_finished()
        if self.spec is not None:
            self.spec.retain(self._states)
        return outputs

    def _spec_step(self, spec: SpecDecoder, batch: ScheduledBatch) -> list[TokenOutput]:
        """Draft, verify and commit: a decode item gains 1 to 1 + lookahead tokens."""
        drafts = spec.propose(batch.items)
        target = spec.verify_forward(batch.items, drafts)
        sampled = [item for item in batch.items if item.sample]
        requests = [self._verify_request(item, drafts.get(item.seq_id, [])) for item in sampled]
        verified = self._verifier.verify(target.logits, requests)
        committed = {item.seq_id: v.tokens for item, v in zip(sampled, verified, strict=True)}
        self.scheduler.on_step_done(batch, committed)
        spec.extend(batch.items, target)
        outputs = []
        for item, v in zip(sampled, verified, strict=True):
            self.spec_stats.record(v.num_drafts, v.num_accepted, self.metrics)
            state = self._states.get(item.seq_id)
            if state is not None:
                outputs.append(self._emit(state, v.logprobs, v.top_logprobs))
        return outputs

    def _verify_request(self, item: ScheduledItem, drafts: list[int]) -> VerifyRequest:
        state = self._states[item.seq_id]
        seq = state.seq
        return VerifyRequest(state.params, state.generator, seq.prompt_ids, seq.output_ids, drafts)

    def _observe(self, items: list[ScheduledItem]) -> None:
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

    def engine_state(self) -> EngineState:
        """Scrape-time engine gauges and counters."""
        s = self.scheduler
        return EngineState(
            running=s.num_running,
            waiting=s.num_waiting,
            kv_usage=s.kv.usage,
            prefix_queries=s.prefix_hit_tokens + s.prefix_miss_tokens,
            prefix_hits=s.prefix_hit_tokens,
            preemptions=s.num_preemptions,
        )

    def _sample(self, result: StepResult) -> SampleOutput:
        states = [self._states[item.seq.seq_id] for item in result.sampled_items]
        logits = self._mask_early_stop(result.logits, states)
        batch = SamplingBatch.build(
            [s.params for s in states],
            [s.generator for s in states],
            [s.seq.prompt_ids for s in states],
            [s.seq.output_ids for s in states],
            self.model_cfg.vocab_size,
            self.runner.device,
        )
        return self.sampler.sample(logits, batch)

    def _mask_early_stop(self, logits: torch.Tensor, states: list[_SeqState]) -> torch.Tensor:
        """Before ``min_new_tokens`` a row may not sample EOS or its stop tokens."""
        params = [s.params for s in states]
        num_outputs = [len(s.seq.output_ids) for s in states]
        return mask_early_stop(logits, params, num_outputs, self.tokenizer.eos_token_id)

    def _process(self, result: StepResult, out: SampleOutput) -> list[TokenOutput]:
        outputs = []
        logprobs = out.logprobs.tolist()
        tops = None
        if out.top_logprobs is not None:
            tops = (out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist())
        for row, item in enumerate(result.sampled_items):
            state = self._states.get(item.seq.seq_id)
            if state is None or not item.seq.output_ids:
                continue
            top = {} if tops is None else self._top_dict(state, tops, row)
            outputs.append(self._emit(state, [logprobs[row]], [top]))
        return outputs

    @staticmethod
    def _top_dict(state: _SeqState, tops, row: int) -> dict[int, float]:
        k = state.params.logprobs or 0
        return dict(zip(tops[1][row][:k], tops[0][row][:k], strict=True))

    def _emit(
        self,
        state: _SeqState,
        logprobs: list[float],
        tops: list[dict[int, float]],
        end: int | None = None,
    ) -> TokenOutput:
        """Report the ``len(logprobs)`` output tokens before ``end`` (default: the last
        ones), up to the first that stops."""
        seq, params = state.seq, state.params
        end = len(seq.output_ids) if end is None else end
        done = end - len(logprobs)
        text, reason, kept = "", None, 0
        while reason is None and done + kept < end:
            token = seq.output_ids[done + kept]
            kept += 1
            reason = check_stop_token(token, done + kept, params, self.tokenizer.eos_token_id)
            if reason != "stop":
                piece, hit = state.stop.feed(state.detok.add(token))
                text, reason = text + piece, "stop" if hit else reason
        if reason is not None and not state.stop.stopped:
            text += state.stop.feed(state.detok.flush())[0] + state.stop.flush()
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
            self._export(seq)
        return out

    def _export(self, seq: Sequence) -> None:
        draft = None if self.spec is None else self.spec.state(seq.seq_id)
        self._exports[seq.request_id] = KVExport(
            seq.request_id,
            seq.prompt_ids,
            seq.output_ids[-1],
            list(seq.page_table),
            self.cfg.page_size,
            draft,
        )

    def _finish(self, state: _SeqState, reason: str) -> None:
        seq = state.seq
        self._rollback(seq)
        if seq.prefill_only and seq.finish_reason == "prefilled":
            self.scheduler.release_exported(seq)
        else:
            self.scheduler.finish(seq, reason)
        self._states.pop(seq.seq_id, None)

    def _rollback(self, seq: Sequence) -> None:
        """Overlap mode: drop the in-flight step's work for ``seq`` before it ends."""
        if self._overlap is not None:
            self._overlap.rollback(seq.seq_id)

    def _scheduler_finished(self) -> list[TokenOutput]:
        """Outputs for sequences the scheduler ended itself (context outgrew the pool)."""
        outputs = []
        for seq in self.scheduler.pop_finished():
            state = self._states.get(seq.seq_id)
            if seq.finish_reason == "prefilled" or state is None:
                continue
            self._states.pop(seq.seq_id)
            outputs.append(
                TokenOutput(
                    seq.request_id,
                    state.index,
                    [],
                    "",
                    True,
                    seq.finish_reason,
                    prompt_tokens=len(seq.prompt_ids),
                    completion_tokens=len(seq.output_ids),
                )
            )
        return outputs

    # ---- disaggregation hooks ---------------------------------------------------------
    def export_kv(self, request_id: str) -> KVExport:
        """Prefill side: the pages and first token of a finished prefill-only request."""
        if request_id not in self._exports:
            raise KeyError(f"request {request_id!r} has no exported KV (not prefilled here?)")
        return self._exports[request_id]

    def has_export(self, request_id: str) -> bool:
        """Whether ``request_id`` is a prefilled request whose pages wait for a pull."""
        return request_id in self._exports

    def release_export(self, request_id: str) -> None:
        """Prefill side: free the exported pages once the decode side has them."""
        self._exports.pop(request_id, None)
        state = self._states.pop(f"{request_id}#0", None)
        if state is not None:
            self.scheduler.release_exported(state.seq)

    def reserve_kv(self, num_tokens: int) -> list[int] | None:
        """Decode side: reserve pages for an incoming prompt's KV (None when full)."""
        return self.scheduler.reserve(num_tokens)

    def release_reservation(self, pages: list[int]) -> None:
        self.scheduler.release_reservation(pages)

    def import_kv(
        self,
        req: Request,
        first_token: int,
        pages: list[int],
        first_logprob: float = 0.0,
        first_top: dict[int, float] | None = None,
        draft_token: int | None = None,
        draft_hidden: torch.Tensor | None = None,
    ) -> None:
        """Decode side: continue ``req`` from KV already written into reserved ``pages``.

        The first token (sampled by the prefill side, with its logprobs) is emitted here
        as the request's first output, through this engine's detokenizer and stop-string
        matcher, so the decode stream carries every output token and no text is lost at
        the handoff. With speculative decoding, ``draft_token`` and ``draft_hidden`` [H]
        (the prefill side's ``KVExport.draft``) let the first decode step draft at once;
        without them it verifies no drafts and the drafting starts one step later.
        """
        self._check_new_id(req.request_id)
        prompt = self._prompt_ids(req)
        seq = self._new_sequence(req, 0, prompt, output_ids=[first_token])
        self.scheduler.add_prefilled(seq, pages)
        self._track(seq, 0, req.params, prompt)
        if self.spec is not None and draft_token is not None and draft_hidden is not None:
            hidden = draft_hidden.to(self.runner.device)
            self.spec.set_state(seq.seq_id, DraftState(seq.num_tokens, draft_token, hidden))
        state = self._states[seq.seq_id]
        self._pending.append(self._emit(state, [first_logprob], [first_top or {}]))
