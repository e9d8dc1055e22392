"""Typed messages between the router and the workers (no torch imports).

Every message crosses Ray as JSON bytes (``encode`` / ``decode``) and is validated by
pydantic on arrival, so a worker never unpickles anything the router built, and the
router imports none of the engine.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from dsv3serve.engine.sampling_params import SamplingParams
from kv_transfer.handle import KVHandle

Role = Literal["prefill", "decode", "colocated"]
M = TypeVar("M", bound=BaseModel)


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def encode(msg: BaseModel) -> bytes:
    """Serialize a message for the wire (JSON)."""
    return msg.model_dump_json().encode()


def decode(cls: type[M], data: bytes) -> M:
    """Parse and validate a message of type ``cls``; raises pydantic ValidationError."""
    return cls.model_validate_json(data)


class GenerateRequest(_Msg):
    """A tokenized request; ``request_id`` is assigned by the router."""

    request_id: str
    prompt_ids: list[int] = Field(min_length=1)
    params: SamplingParams


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


class PrefillRequest(_Msg):
    """Prefill ``prompt_ids`` (n=1), sample the first token, stage the KV for a pull."""

    request: GenerateRequest


class PrefillResult(_Msg):
    """The first token (as a chunk) and the handle of the staged KV pages.

    ``kv`` is None when the first token already finished the request (EOS, a stop token,
    max_tokens=1): nothing is left for the decode side.
    """

    first: TokenChunk
    kv: KVHandle | None


class ReserveRequest(_Msg):
    """Decode admission: hold pages for ``num_tokens`` of incoming KV for ``lease_s``."""

    request_id: str
    num_tokens: int = Field(ge=1)
    lease_s: float = Field(gt=0)


class ReserveResult(_Msg):
    ok: bool
    num_pages: int = 0


class DecodeRequest(_Msg):
    """Pull ``kv`` into the reservation of ``request.request_id``, then decode on."""

    request: GenerateRequest
    first_token: int
    first_logprob: float = 0.0
    first_top_logprobs: list[tuple[int, float]] = []
    kv: KVHandle


class WorkerLoad(_Msg):
    """What a router needs to pick a replica."""

    role: Role
    running: int
    waiting: int
    free_pages: int
    num_pages: int


class WorkerInfo(_Msg):
    """Static facts about a replica's engine."""

    role: Role
    max_model_len: int
    page_size: int
    vocab_size: int


class WorkerStats(_Msg):
    """Internal accounting, used by tests to check that nothing leaks."""

    role: Role
    free_pages: int
    num_pages: int
    evictable_pages: int
    live_requests: int
    staged_kv: int
    reservations: int
    group_size: int = 1
