"""Prefill/decode disaggregation hooks on the engine core: the prefill side exports a
prefilled request's pages and first token, the decode side reserves pages for incoming KV
and continues a request from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv3serve.engine.core import EngineCore
from dsv3serve.engine.intake import new_sequence
from dsv3serve.engine.request import Request
from dsv3serve.engine.scheduler.dp import DPScheduler
from dsv3serve.engine.scheduler.pd import NO_PREFIX, KVReservation
from dsv3serve.engine.scheduler.scheduler import Scheduler
from dsv3serve.engine.scheduler.sequence import Sequence, SequenceStatus
from dsv3serve.engine.speculative.loop import DraftState, SpecDecoder
from dsv3serve.kvcache.radix_cache import PrefixMatch


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


@dataclass(frozen=True)
class FirstToken:
    """The prefill side's first token of an imported request, with its logprobs and,
    under speculative decoding, the seed of the first draft chain (token, hidden [H]).

    ``cached_tokens``: prompt tokens the prefill side took from its prefix cache (not
    computed for this request); the imported request reports them in its outputs.
    """

    token: int
    logprob: float = 0.0
    top: dict[int, float] | None = None
    draft: tuple[int, torch.Tensor] | None = None
    cached_tokens: int = 0


class PDHooks:
    """Export and import of KV over one :class:`EngineCore`; it becomes the core's
    ``on_prefilled``, so every prefilled sequence is recorded as an export."""

    def __init__(self, core: EngineCore, spec: SpecDecoder | None, page_size: int) -> None:
        self.core, self.spec, self.page_size = core, spec, page_size
        self._exports: dict[str, KVExport] = {}
        core.on_prefilled = self.record_export

    def record_export(self, seq: Sequence) -> None:
        """Keep ``seq``'s pages and first token for the decode side to pull."""
        draft = None if self.spec is None else self.spec.state(seq.seq_id)
        self._exports[seq.request_id] = KVExport(
            seq.request_id,
            seq.prompt_ids,
            seq.output_ids[-1],
            list(seq.page_table),
            self.page_size,
            draft,
        )

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s export record (its pages go with the abort)."""
        self._exports.pop(request_id, None)

    def export_kv(self, request_id: str) -> KVExport:
        """Prefill side: the pages and first token of a finished prefill-only request."""
        if request_id not in self._exports:
            raise KeyError(f"request {request_id!r} has no exported KV (not prefilled here?)")
        return self._exports[request_id]

    def has_export(self, request_id: str) -> bool:
        """Whether ``request_id`` is a prefilled request whose pages wait for a pull."""
        return request_id in self._exports

    def ready_pages(self, request_id: str) -> list[int]:
        """Prefill side, while ``request_id`` (a prefill-only request) still prefills: its
        leading prompt pages whose KV is final (every token of the page computed, by
        finished chunks or from the prefix cache), never the prompt's last page; [] when
        it is not running (waiting, preempted, finished, unknown).

        The pages stay this sequence's until the hook of :meth:`on_pages_dropped` names it.
        """
        state = self.core.state(f"{request_id}#0")
        if state is None or not state.seq.prefill_only:
            return []
        seq = state.seq
        if seq.status is not SequenceStatus.RUNNING:
            return []
        prompt = len(seq.prompt_ids)
        full = min(seq.num_computed_tokens, prompt) // self.page_size
        last = (prompt - 1) // self.page_size  # the index of the prompt's last page
        return list(seq.page_table[: min(full, last)])

    def on_pages_dropped(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(request_id)`` on the step thread before a sequence's pages are
        freed or swapped for the prefix cache's copies (see
        ``Scheduler.set_pages_dropped_hook``); pages :meth:`ready_pages` returned are
        safe to read until then."""
        scheduler = self.core.scheduler
        if not isinstance(scheduler, Scheduler):  # DPScheduler
            raise ValueError("on_pages_dropped: a DP-attention scheduler has no such hook")
        scheduler.set_pages_dropped_hook(lambda seq: hook(seq.request_id))

    def release_export(self, request_id: str) -> bool:
        """Prefill side: free the exported pages once the decode side has them.

        Only an exported request is touched: a release for an id that is still
        prefilling (or unknown, or already released) is a no-op and returns False, so a
        late release can never pull a live sequence out from under ``step()``.
        """
        if self._exports.pop(request_id, None) is None:
            return False
        state = self.core.drop_state(f"{request_id}#0")
        if state is not None:
            self.core.scheduler.release_exported(state.seq)
        return True

    def reserve_kv(self, num_tokens: int) -> list[int] | None:
        """Decode side: reserve pages for an incoming prompt's KV (None when full)."""
        return self.core.scheduler.reserve(num_tokens)

    def reserve_prompt(
        self, prompt: list[int], salt: str, dp_rank: int | None = None
    ) -> KVReservation | None:
        """Decode side: lock ``prompt``'s prefix cached here and reserve pages for the rest
        of its KV (None when full); on DP rank ``dp_rank`` when a DP scheduler can."""
        scheduler = self.core.scheduler
        if dp_rank is None or not isinstance(scheduler, DPScheduler):
            return scheduler.reserve_prompt(prompt, salt)
        return scheduler.reserve_prompt(prompt, salt, dp_rank)

    def release_reservation(self, pages: list[int]) -> None:
        """Decode side: give back reserved pages that will not be used."""
        self.core.scheduler.release_reservation(pages)

    def release_prompt(self, reservation: KVReservation) -> None:
        """Decode side: give back an unused ``reserve_prompt`` reservation."""
        self.core.scheduler.release_prompt(reservation)

    def import_kv(
        self, req: Request, pages: list[int], first: FirstToken, prefix: PrefixMatch = NO_PREFIX
    ) -> None:
        """Decode side: continue ``req`` from KV in the locked ``prefix`` pages and the
        reserved ``pages`` after them; its first output (``first.token``) waits in the
        core's pending outputs."""
        core = self.core
        core.check_new_id(req.request_id)
        prompt = core.prompt_ids(req)
        seq = new_sequence(req, 0, prompt, output_ids=[first.token])
        seq.num_cached_tokens = first.cached_tokens
        core.scheduler.add_prefilled(seq, pages, prefix)
        state = core.track(seq, 0, req.params, prompt)
        if self.spec is not None and first.draft is not None:
            token, hidden = first.draft
            draft = DraftState(seq.num_tokens, token, hidden.to(core.runner.device))
            self.spec.set_state(seq.seq_id, draft)
        core.push_pending(core.emit(state, [first.logprob], [first.top or {}]))
