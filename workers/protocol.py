"""Typed messages between the router and the workers (no torch imports).

Every message crosses Ray as JSON bytes (``encode`` / ``decode``) and is validated by
pydantic on arrival, so a worker never unpickles anything the router built, and the
router imports none of the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsv3serve.sampling.sampling_params import SamplingParams
from kv_transfer.handle import KVHandle

Role = Literal["prefill", "decode", "colocated"]
M = TypeVar("M", bound=BaseModel)
WireDType = Literal["bfloat16", "float16", "float32"]
WIRE_DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"bfloat16": 2, "float16": 2, "float32": 4})
MAX_PREFIX_HASHES = 512  # the most prefix hashes one DP rank's report may carry


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def encode(msg: BaseModel) -> bytes:
    """Serialize a message for the wire (JSON)."""
    return msg.model_dump_json().encode()


def decode(cls: type[M], data: bytes) -> M:
    """Parse and validate a message of type ``cls``; raises pydantic ValidationError."""
    return cls.model_validate_json(data)


class GenerateRequest(_Msg):
    """A tokenized request; ``request_id`` is assigned by the router. ``dp_rank``
    (colocated replicas): the DP-attention rank the router chose, honoured unless invalid
    or full (PD names the rank in ``PrefillRequest`` and ``ReserveRequest`` instead)."""

    request_id: str
    prompt_ids: list[int] = Field(min_length=1)
    params: SamplingParams
    dp_rank: int | None = Field(None, ge=0)


class TokenChunk(_Msg):
    """New tokens of one sequence (``index`` < n), or a terminal error.

    ``top_logprobs`` holds, per token, ``[token_id, logprob]`` pairs (JSON has no int
    keys). ``error`` set means the request failed on the worker; ``finished`` is then true.
    """

    request_id: str
    index: int = 0
    token_ids: list[int] = []
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[float] = []
    top_logprobs: list[list[tuple[int, float]]] = []
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_status: int | None = None  # the HTTP status the error maps to (400, 503, ...)


def error_chunk(request_id: str, message: str, status: int) -> TokenChunk:
    """The in-band end of a stream that failed (after its first chunk, or before any)."""
    return TokenChunk(
        request_id=request_id,
        finished=True,
        finish_reason="error",
        error=message,
        error_status=status,
    )


class PrefillRequest(_Msg):
    """Prefill ``prompt_ids`` (n=1), sample the first token, stage the KV for a pull.

    ``attempt_id`` names this try of the request, unique per try (a retry gets a new one):
    the engine runs it, and the KV is staged and released (``release_kv``), under that id,
    so cleanup meant for one try never touches another. The KV handle carries it.

    ``skip_pages``: leading prompt pages the decode side holds already (its prefix cache,
    see ``ReserveResult``): they are not staged. The prefill side still computes every
    prompt token its own prefix cache does not hold.

    ``dp_rank``: the DP-attention rank the router chose (``router.routing.rank_routing``); the
    replica's DP scheduler runs the request there unless the rank is invalid or full.
    """

    request: GenerateRequest
    attempt_id: str = Field(min_length=1, max_length=256)
    skip_pages: int = Field(0, ge=0)
    dp_rank: int | None = Field(None, ge=0)


class DraftHandoff(_Msg):
    """The MTP draft state a speculative prefill hands to a speculative decode.

    ``token``: the draft's guess for the token after the first output token. ``hidden``:
    the draft's hidden state at the last prompt position, ``shape`` (``[hidden_size]``)
    elements of ``dtype`` in C order, little-endian, as raw bytes (base64 in the JSON).
    ``workers.draft_wire`` converts it to and from tensors.
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64"
    )

    token: int = Field(ge=0)
    dtype: WireDType
    shape: list[int] = Field(min_length=1, max_length=4)
    hidden: bytes

    @model_validator(mode="after")
    def _check_size(self) -> DraftHandoff:
        if any(n < 1 for n in self.shape):
            raise ValueError(f"shape: found {self.shape}, expected positive sizes")
        expected = math.prod(self.shape) * WIRE_DTYPE_BYTES[self.dtype]
        if len(self.hidden) != expected:
            raise ValueError(
                f"hidden: found {len(self.hidden)} bytes, expected {expected} for "
                f"{self.dtype} of shape {self.shape}"
            )
        return self


class PrefillResult(_Msg):
    """The first token (as a chunk), the handle of the staged KV pages, the draft state.

    ``kv`` is None when the first token already finished the request (EOS, a stop token,
    max_tokens=1): nothing is left for the decode side. ``draft`` is set when the prefill
    engine runs speculative decoding (its pages then hold the draft layer's KV too).
    """

    first: TokenChunk
    kv: KVHandle | None
    draft: DraftHandoff | None = None


class PrefillEvent(_Msg):
    """One message of an overlapped prefill (``prefill_stream``): a ``kv_range`` (prompt
    pages of finished chunks, staged while later chunks run: ``first_page`` says where it
    starts among the prompt's pages), or, last, the ``result`` (its ``kv`` holds only the
    pages after every range)."""

    kv_range: KVHandle | None = None
    result: PrefillResult | None = None

    @model_validator(mode="after")
    def _one(self) -> PrefillEvent:
        if (self.kv_range is None) == (self.result is None):
            raise ValueError("a prefill event carries exactly one of kv_range and result")
        return self


class PullRequest(_Msg):
    """Overlapped transfer: pull ``kv``, a range of prompt pages that prefill attempt
    ``attempt_id`` staged while it still runs, into the reservation of ``request_id``."""

    request_id: str
    attempt_id: str = Field(min_length=1, max_length=256)
    kv: KVHandle


class PullResult(_Msg):
    """Whether a range pull landed; ``error`` says why not (the reservation is kept: the
    final handoff pulls what is missing, or gives it back)."""

    ok: bool
    error: str | None = None


class ReserveRequest(_Msg):
    """Decode admission: hold pages for ``num_tokens`` of incoming KV for ``lease_s``.

    With ``prompt_ids`` (``num_tokens`` of them) the decode side first matches the prompt
    against its prefix cache and locks the hit: only the pages after it are reserved.
    ``dp_rank``: the DP-attention rank the router chose; the replica reserves there unless
    the rank is invalid or full (then on the rank its DP scheduler picks).
    """

    request_id: str
    num_tokens: int = Field(ge=1)
    lease_s: float = Field(gt=0)
    prompt_ids: list[int] | None = None
    dp_rank: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check_prompt(self) -> ReserveRequest:
        if self.prompt_ids is not None and len(self.prompt_ids) != self.num_tokens:
            raise ValueError(
                f"prompt_ids: found {len(self.prompt_ids)} tokens, expected num_tokens "
                f"({self.num_tokens})"
            )
        return self


class ReserveResult(_Msg):
    """``num_pages`` reserved for the pull, after ``cached_pages`` prompt pages this side's
    prefix cache holds already (the prefill side stages none of them), on DP rank
    ``dp_rank`` (0 without DP attention). A refusal (``ok`` False) reports ``progress``: a
    count that grows while this replica works towards freeing KV room (its engine's
    steps), so a router waiting for room tells a busy replica from a stuck one."""

    ok: bool
    num_pages: int = 0
    cached_pages: int = 0
    dp_rank: int = Field(0, ge=0)
    progress: int = Field(0, ge=0)


class Caller(_Msg):
    """A named Ray actor (the router replica that sent a request), for liveness checks."""

    name: str
    namespace: str


class DecodeRequest(_Msg):
    """Pull ``kv`` into the reservation of ``request.request_id``, then decode on.

    ``draft``: the prefill side's :class:`DraftHandoff`, passed on unchanged; a decode
    replica with speculative decoding needs it (it cannot rebuild the draft's KV).
    ``cached_tokens``: the prefill side's prefix-cache hit (prompt tokens it did not
    compute), reported in every chunk's ``cached_tokens``.
    ``kv_ranges``: ranges of the attempt's overlapped transfer that were not pulled while
    it ran (a pull failed), in order; pulled before ``kv``, which starts after them.
    ``caller``: the router replica reading the stream; the decode replica ends the stream
    once that actor is gone (``workers.caller_watch``). None: never checked.
    """

    request: GenerateRequest
    first_token: int
    first_logprob: float = 0.0
    first_top_logprobs: list[tuple[int, float]] = []
    kv: KVHandle
    kv_ranges: list[KVHandle] = []
    draft: DraftHandoff | None = None
    cached_tokens: int = Field(0, ge=0)
    caller: Caller | None = None


class RankLoad(_Msg):
    """One DP rank's load and prefix-cache summary (a replica without DP attention has one,
    rank 0). ``free_pages``: pages an allocation can get now (free plus evictable);
    ``prefix_hashes``: hashes of page-aligned prefixes its prefix cache holds in device
    pages, most recent first, at most ``MAX_PREFIX_HASHES`` (``dsv3serve.kvcache.prefix_hash``);
    ``host_prefix_hashes``: the same for prefixes held only in its hierarchical cache's host
    tier."""

    dp_rank: int = Field(ge=0)
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    free_pages: int = Field(ge=0)
    num_pages: int = Field(ge=1)
    prefix_hashes: list[int] = Field([], max_length=MAX_PREFIX_HASHES)
    host_prefix_hashes: list[int] = Field([], max_length=MAX_PREFIX_HASHES)


class WorkerLoad(_Msg):
    """What a router needs to pick a replica, and a DP rank of it (``ranks``)."""

    role: Role
    running: int
    waiting: int
    free_pages: int
    num_pages: int
    ranks: list[RankLoad] = []


class WorkerProgress(_Msg):
    """Whether a replica's engine is making progress, read without the engine lock: the
    steps it finished since start and whether one runs now (a long prefill chunk)."""

    steps: int
    stepping: bool


class WorkerInfo(_Msg):
    """Static facts about a replica's engine.

    ``max_model_len`` is what one sequence can really hold: the smaller of the model's
    context (or the configured limit) and ``kv_capacity_tokens``, the KV pool of one DP
    rank (a sequence lives on one rank's pool).
    """

    role: Role
    max_model_len: int
    page_size: int
    vocab_size: int
    kv_capacity_tokens: int


class WorkerStats(_Msg):
    """Internal accounting, used by tests to check that nothing leaks.

    ``pulled_pages`` / ``reused_pages`` (decode side, since start): prompt pages pulled
    from prefill, and prompt pages not pulled because this side's prefix cache held them;
    ``overlapped_pages``: those of the pulled pages that came while their prefill still ran
    (ranges of an overlapped transfer). ``pending_kv``: prefill attempts with ranges open
    (prefill side) or reservations with pull progress (decode side). ``rank_requests``:
    requests placed on each DP rank since start; ``rank_fallbacks``: requests whose
    router-chosen rank was invalid or full. Without DP attention there is no placement to
    count (the replica's one rank takes every request): ``[]`` and 0. (The router routes
    by ``WorkerLoad.ranks``, which has the one entry; these counters are for tests.)
    ``cancelled_prefills`` (prefill side): tries cancelled while they ran (their router
    gave up on them, or their client left).
    """

    role: Role
    free_pages: int
    num_pages: int
    evictable_pages: int
    live_requests: int
    staged_kv: int
    reservations: int
    group_size: int = 1
    pulled_pages: int = 0
    reused_pages: int = 0
    overlapped_pages: int = 0
    pending_kv: int = 0
    rank_requests: list[int] = []
    rank_fallbacks: int = 0
    cancelled_prefills: int = 0
