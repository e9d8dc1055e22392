"""The engine: scheduler + model runner + sampler + detokenizer, one ``step()`` at a time.

A step is schedule (CPU), run (device: forward and sample), then process (CPU: stop checks,
detokenize). Without overlap they run back to back. With the overlap scheduler (on by default
on CUDA, ``disable_overlap_schedule`` turns it off, ``force_overlap_schedule`` turns it on off
CUDA) the host schedules and launches step n+1 before it processes step n, whose tokens the
new step reads through device-side placeholders: see ``engine/overlap_loop.py``. Speculative
decoding always runs without overlap; a multi-rank group (``use_runner``) runs with it, rank 0
sending each step's sampled ids to the other ranks' rings.

The engine is a facade: the step stages live in ``engine/core.py``, the step loops in
``engine/loops.py`` (plain, speculative) and ``engine/overlap_loop.py``, and the PD export and
import hooks in ``engine/pd_hooks.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.core import EngineCore
from dsv3serve.engine.intake import InvalidRequestError, new_sequence
from dsv3serve.engine.kv_size import context_len
from dsv3serve.engine.loops import PlainLoop, SpecLoop, StepLoop
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.overlap_loop import OverlapLoop
from dsv3serve.engine.pd_hooks import FirstToken, KVExport, PDHooks
from dsv3serve.engine.protocols import StepRunner
from dsv3serve.engine.request import Request, TokenOutput
from dsv3serve.engine.sampler import Sampler, make_generator
from dsv3serve.engine.scheduler.dp import DPScheduler
from dsv3serve.engine.scheduler.pd import NO_PREFIX
from dsv3serve.engine.scheduler.scheduler import KVReservation, Scheduler
from dsv3serve.engine.scheduler.sequence import SchedulerConfig
from dsv3serve.engine.speculative.forwards import SpecForwards
from dsv3serve.engine.speculative.loop import SpecDecoder
from dsv3serve.engine.speculative.stats import SpecStats
from dsv3serve.kvcache.host_pool import HostKVPool
from dsv3serve.kvcache.radix_cache import PrefixMatch
from dsv3serve.metrics import EngineState, Metrics, with_tier_state
from dsv3serve.settings import export_compile_caches
from dsv3serve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["Engine", "InvalidRequestError", "KVExport", "KVReservation", "resolve_model_dir"]


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
        # an engine built without the CLI (a Ray worker, a test) gets the cache dir's
        # compile caches too, before its attention backend first imports flashinfer
        export_compile_caches()
        self.cfg = cfg
        model_dir = resolve_model_dir(cfg)
        self.model_cfg = ModelConfig.from_hf(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        runner = ModelRunner(cfg, model_dir, self.model_cfg)
        self.host_pool = _host_pool(cfg, runner)
        host_pages = self.host_pool.num_pages if self.host_pool is not None else 0
        sched_cfg = _scheduler_config(cfg, self.model_cfg, runner.num_pages, host_pages)
        self.scheduler: Scheduler | DPScheduler = Scheduler(sched_cfg, self.host_pool)
        self.sampler = Sampler(make_generator(cfg.seed, runner.device))
        self.spec: SpecDecoder | None = None
        self._spec_stats = SpecStats(cfg.spec_num_steps)
        if cfg.spec_num_steps:
            quant = cfg.speculative_draft_model_quantization
            self.spec = SpecDecoder(runner, cfg.spec_num_steps, quant)
        vocab = self.model_cfg.vocab_size
        self._core = EngineCore(
            self.scheduler, runner, self.sampler, self.tokenizer, vocab,
            any_whitespace=not cfg.disable_any_whitespace,
        )  # fmt: skip
        self._states = self._core.states  # the same dict, read by tests and the worker host
        self._pd = PDHooks(self._core, self.spec, cfg.page_size)
        self._overlap: OverlapLoop | None = None
        self._loop: StepLoop = self._make_loop(runner)

    def _make_loop(self, runner: ModelRunner) -> StepLoop:
        if runner.future is not None:
            self._overlap = OverlapLoop(self._core, runner.future)
            return self._overlap
        if self.cfg.model_copy(update={"speculative_algorithm": None}).overlap_schedule:
            logger.info("overlap schedule off: speculative decoding runs without it")
        if self.spec is not None:
            return SpecLoop(self._core, self.spec, self._spec_stats)
        return PlainLoop(self._core)

    @property
    def runner(self) -> StepRunner:
        """What runs the forward: this rank's ModelRunner, or what ``use_runner`` gave."""
        return self._core.runner

    @property
    def spec_stats(self) -> SpecStats:
        """Speculative decoding's acceptance counts (all zero without it)."""
        return self._spec_stats

    @spec_stats.setter
    def spec_stats(self, stats: SpecStats) -> None:
        self._spec_stats = stats
        if isinstance(self._loop, SpecLoop):
            self._loop.stats = stats

    @property
    def metrics(self) -> Metrics | None:
        """The Prometheus metrics steps report to (set by the serving layer)."""
        return self._core.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics | None) -> None:
        self._core.metrics = metrics

    @property
    def overlap(self) -> bool:
        """Whether steps run with the overlap scheduler."""
        return self._overlap is not None

    def use_runner(
        self,
        runner: StepRunner,
        scheduler: DPScheduler | None = None,
        spec_forwards: SpecForwards | None = None,
    ) -> None:
        """Run steps through ``runner`` (e.g. a group leader wrapping ``self.runner``).

        ``scheduler`` (DP attention: one scheduler per DP rank) replaces this engine's;
        call it before any request. A speculative engine needs ``spec_forwards``, the
        group's forwards that every rank runs (its steps never call ``runner.run``).
        """
        if scheduler is not None and self.scheduler.has_unfinished:
            raise RuntimeError("use_runner: requests are queued; call it before any")
        if self.spec is not None:
            if spec_forwards is None:
                raise ValueError(
                    "speculative_algorithm in a group: expected the group's spec forwards "
                    "(GroupSpecForwards or DPSpecForwards), found none"
                )
            self.spec.use_forwards(spec_forwards)
        if self._overlap is not None and self._overlap.in_flight:
            raise RuntimeError("use_runner: a step is in flight; call it before any step")
        self._core.runner = runner
        if scheduler is not None:
            self.scheduler = self._core.scheduler = scheduler

    # ---- requests -------------------------------------------------------------------
    def add_request(self, req: Request, prefill_only: bool = False) -> None:
        """Queue ``req``; raises InvalidRequestError / ContextLengthError before any work."""
        self._core.check_new_id(req.request_id)
        if prefill_only and req.params.n != 1:
            raise InvalidRequestError("prefill-only requests take n=1")
        prompt = self._core.prompt_ids(req)
        for i in range(req.params.n):
            seq = new_sequence(req, i, prompt, prefill_only=prefill_only)
            self.scheduler.add(seq)  # the first may raise ContextLengthError; all share it
            self._core.track(seq, i, req.params, prompt)

    def abort(self, request_id: str) -> bool:
        """Abort every sequence of ``request_id`` in any state; frees all its pages."""
        self._pd.forget(request_id)
        return self._core.abort(request_id)

    @property
    def num_live_sequences(self) -> int:
        """Sequences this engine tracks (running, waiting, or prefilled awaiting a pull)."""
        return len(self._core.states)

    def has_unfinished(self) -> bool:
        """Whether any sequence still needs steps (exported prefills do not)."""
        return self._loop.in_flight or self._core.has_unfinished()

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Run one scheduler iteration; returns the new outputs of every sequence.

        With the overlap scheduler the outputs are those of the previous step's tokens.
        """
        return self._loop.step()

    def engine_state(self) -> EngineState:
        """Scrape-time engine gauges and counters (one pool: DP ranks report their own)."""
        s = self.scheduler
        if not isinstance(s, Scheduler):
            raise TypeError("engine_state: expected one scheduler; DP ranks report their own")
        state = scheduler_state(s, prefill_tokens=s.num_prefill_tokens)
        tier = s.kv.host_tier
        return state if tier is None else with_tier_state(state, tier)

    # ---- disaggregation hooks (engine/pd_hooks.py) ------------------------------------
    def export_kv(self, request_id: str) -> KVExport:
        """Prefill side: the pages and first token of a finished prefill-only request."""
        return self._pd.export_kv(request_id)

    def has_export(self, request_id: str) -> bool:
        """Whether ``request_id`` is a prefilled request whose pages wait for a pull."""
        return self._pd.has_export(request_id)

    def prefill_ready_pages(self, request_id: str) -> list[int]:
        """Prefill side: the leading prompt pages of a prefill-only request still
        prefilling whose KV is final (finished chunks), never the prompt's last page."""
        return self._pd.ready_pages(request_id)

    def on_pages_dropped(self, hook: Callable[[str], None]) -> None:
        """Prefill side: ``hook(request_id)`` runs on the step thread before a sequence's
        pages are freed or swapped (finish, abort, preemption, prefix-cache dedup); a
        reader of :meth:`prefill_ready_pages` must stop before it returns."""
        self._pd.on_pages_dropped(hook)

    def release_export(self, request_id: str) -> bool:
        """Prefill side: free the exported pages once the decode side has them.

        Returns False, touching nothing, unless ``request_id`` is exported here (a request
        still prefilling is aborted with :meth:`abort`, never released).
        """
        return self._pd.release_export(request_id)

    def reserve_kv(self, num_tokens: int) -> list[int] | None:
        """Decode side: reserve pages for an incoming prompt's KV (None when full)."""
        pages = self._pd.reserve_kv(num_tokens)
        self._sync_host_copies()
        return pages

    def reserve_prompt_kv(
        self, prompt_ids: list[int], salt: str = "", dp_rank: int | None = None
    ) -> KVReservation | None:
        """Decode side: reserve pages for the part of ``prompt_ids`` whose KV is not cached
        here; the cached prefix is locked for the request (None when full). ``dp_rank``:
        the DP-attention rank a router chose (a DP scheduler's; ignored without one)."""
        reservation = self._pd.reserve_prompt(prompt_ids, salt, dp_rank)
        self._sync_host_copies()
        return reservation

    def _sync_host_copies(self) -> None:
        """A reservation's pages may have been backed up to the host tier on a side stream
        (or its prefix loaded back): the KV connector writes them outside the streams."""
        if self.host_pool is not None:
            self.host_pool.synchronize()

    def release_reservation(self, pages: list[int]) -> None:
        """Decode side: give back reserved pages that will not be used."""
        self._pd.release_reservation(pages)

    def release_prompt_kv(self, reservation: KVReservation) -> None:
        """Decode side: give back an unused ``reserve_prompt_kv`` reservation."""
        self._pd.release_prompt(reservation)

    def import_kv(
        self,
        req: Request,
        first_token: int,
        pages: list[int],
        first_logprob: float = 0.0,
        first_top: dict[int, float] | None = None,
        draft_token: int | None = None,
        draft_hidden: torch.Tensor | None = None,
        prefix: PrefixMatch | None = None,
        cached_tokens: int = 0,
    ) -> None:
        """Decode side: continue ``req`` from KV already written into reserved ``pages``.

        The first token (sampled by the prefill side, with its logprobs) is emitted here
        as the request's first output, through this engine's detokenizer and stop-string
        matcher, so the decode stream carries every output token and no text is lost at
        the handoff. With speculative decoding, ``draft_token`` and ``draft_hidden`` [H]
        (the prefill side's ``KVExport.draft``) let the first decode step draft at once;
        without them it verifies no drafts and the drafting starts one step later.
        With decode-side prefix reuse, ``prefix`` (a ``reserve_prompt_kv`` reservation's)
        holds the prompt's first pages and ``pages`` the rest. ``cached_tokens``: the
        prefill side's prefix-cache hit, reported as the request's cached tokens.
        """
        draft = None
        if draft_token is not None and draft_hidden is not None:
            draft = (draft_token, draft_hidden)
        first = FirstToken(first_token, first_logprob, first_top, draft, cached_tokens)
        self._pd.import_kv(req, pages, first, NO_PREFIX if prefix is None else prefix)


def scheduler_state(s: Scheduler, **extra: int) -> EngineState:
    """One pool's scrape-time gauges and counters; ``extra``: more ``EngineState`` fields
    (what the caller adds: prefilled tokens, a DP rank's placement counts)."""
    return EngineState(
        running=s.num_running,
        waiting=s.num_waiting,
        kv_usage=s.kv.usage,
        prefix_queries=s.prefix_hit_tokens + s.prefix_miss_tokens,
        prefix_hits=s.prefix_hit_tokens,
        preemptions=s.num_preemptions,
        **extra,
    )


def _host_pool(cfg: EngineConfig, runner: ModelRunner) -> HostKVPool | None:
    pool = runner.pool
    pages = cfg.host_tier_pages(runner.num_pages, pool.page_nbytes)
    return HostKVPool(pool, pages) if pages else None


def _scheduler_config(
    cfg: EngineConfig, model_cfg: ModelConfig, num_pages: int, host_pages: int
) -> SchedulerConfig:
    max_len = context_len(cfg, model_cfg)
    return SchedulerConfig(
        page_size=cfg.page_size,
        num_pages=num_pages,
        max_running_requests=cfg.max_running_requests,
        chunked_prefill_size=cfg.chunked_prefill_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_context_len=max_len,
        policy=cfg.schedule_policy,
        enable_prefix_cache=cfg.enable_prefix_caching,
        num_lookahead_tokens=cfg.spec_num_steps,
        num_host_pages=host_pages,
    )
