"""Scheduler data types: limits, per-sequence state, the per-step batch (pure Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

from dsv3serve.kvcache.radix_cache import RadixNode


class ContextLengthError(ValueError):
    """A request cannot fit the context limit or the KV pool."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits.

    ``chunked_prefill_size`` caps prefill tokens per step; ``<= 0`` disables chunking, so
    a prompt runs whole in one step (then ``max_num_batched_tokens`` must cover
    ``max_context_len``). ``max_num_batched_tokens`` caps all tokens of a step, decodes
    included. ``policy`` orders the waiting queue: ``fcfs`` by arrival, ``lpm`` longest
    cached prefix first. ``num_lookahead_tokens`` (speculative decoding: the draft steps
    per round) extra slots are given to each decode, when they fit, for draft tokens.
    ``num_host_pages`` > 0 puts a host-memory tier of that many pages under the prefix
    cache (the hierarchical cache; the scheduler then needs a page copier).
    """

    page_size: int
    num_pages: int
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192
    max_num_batched_tokens: int = 16384
    max_context_len: int = 163840
    policy: Literal["fcfs", "lpm"] = "fcfs"
    enable_prefix_cache: bool = True
    num_lookahead_tokens: int = 0
    num_host_pages: int = 0

    def __post_init__(self) -> None:
        positive = ("page_size", "num_pages", "max_running_requests")
        for name in (*positive, "max_num_batched_tokens", "max_context_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_host_pages < 0:
            raise ValueError(f"num_host_pages must be >= 0, got {self.num_host_pages}")
        if self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}")
        if self.policy not in ("fcfs", "lpm"):
            raise ValueError(f"policy must be 'fcfs' or 'lpm', got {self.policy!r}")
        if self.chunked_prefill_size <= 0 and self.max_num_batched_tokens < self.max_context_len:
            raise ValueError(
                f"without chunked prefill a whole prompt runs in one step, so "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_context_len ({self.max_context_len})"
            )

    @property
    def chunking(self) -> bool:
        """Whether prefills may be split across steps."""
        return self.chunked_prefill_size > 0


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, in the running set, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation stream and the KV pages that hold its context.

    ``num_computed_tokens`` tokens of ``all_token_ids`` have KV in the cache, at slots
    given by ``page_table`` (slot = page * page_size + offset). The first
    ``num_tree_pages`` pages of ``page_table`` belong to the radix prefix cache and are
    locked through ``cache_handle``; the rest belong to this sequence. Append generated
    tokens with ``append_token``. ``prefill_only`` sequences (the prefill side of
    prefill/decode disaggregation) finish after their first token and keep their pages
    until the scheduler's ``release_exported``.
    """

    seq_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    request_id: str = ""
    salt: str = ""
    prefill_only: bool = False
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    arrival: int = -1
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    num_tree_pages: int = 0
    cache_handle: RadixNode | None = None
    num_admissions: int = 0
    dp_rank: int = 0  # the DP-attention rank whose KV pool holds it (DPScheduler)
    preferred_dp_rank: int | None = None  # the router's choice (DPScheduler.add honours it)

    def __post_init__(self) -> None:
        self.prompt_ids = list(self.prompt_ids)
        self.output_ids = list(self.output_ids)
        if not self.request_id:
            self.request_id = self.seq_id
        if not self.prompt_ids:
            raise ValueError(f"sequence {self.seq_id}: prompt_ids is empty")
        if self.max_new_tokens < 0:
            raise ValueError(f"sequence {self.seq_id}: max_new_tokens {self.max_new_tokens} < 0")

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list of prompt + output token ids."""
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        """Whether the sequence has left the scheduler's queues."""
        return self.status is SequenceStatus.FINISHED

    @property
    def num_generation_slots_left(self) -> int:
        """Tokens it may still generate: ``max_new_tokens`` minus its outputs (0 for a
        prefill-only sequence that has its first token)."""
        if self.prefill_only and self.output_ids:
            return 0
        return self.max_new_tokens - len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list."""
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        if start >= prompt_len:
            return self.output_ids[start - prompt_len : end - prompt_len]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt_len]

    def append_token(self, token_id: int) -> None:
        """Record one generated token."""
        self.output_ids.append(token_id)


@dataclass(frozen=True)
class ScheduledItem:
    """Tokens ``start .. start+num_tokens-1`` of ``seq`` to run through the model this step.

    ``slots[i]`` is the KV-cache slot where token ``start+i`` is written. When ``sample``
    is True the item ends at the last token of the sequence and the logits of its last
    token are sampled. ``is_decode`` marks the one-token steps of the decode phase.

    A decode item may also own ``num_lookahead`` slots after its token (``slots`` then
    holds ``num_tokens + num_lookahead`` entries): speculative decoding writes draft
    tokens there and verifies them with the decode token in one forward, so the step
    commits between 1 and ``1 + num_lookahead`` tokens.
    """

    seq: Sequence
    start: int
    num_tokens: int
    token_ids: list[int]
    slots: list[int]
    sample: bool
    is_decode: bool
    num_lookahead: int = 0

    @property
    def seq_id(self) -> str:
        """The scheduled sequence's id."""
        return self.seq.seq_id

    @property
    def positions(self) -> range:
        """Positions of the scheduled tokens in the sequence."""
        return range(self.start, self.start + self.num_tokens)


@dataclass(frozen=True)
class ScheduledBatch:
    """One scheduler step: decode items first, then prefill chunks."""

    items: list[ScheduledItem]

    @property
    def num_tokens(self) -> int:
        """Total tokens in the step (without lookahead slots)."""
        return sum(item.num_tokens for item in self.items)

    @property
    def decode_items(self) -> list[ScheduledItem]:
        """The one-token decode steps."""
        return [item for item in self.items if item.is_decode]

    @property
    def prefill_items(self) -> list[ScheduledItem]:
        """The prefill (or recompute) chunks."""
        return [item for item in self.items if not item.is_decode]

    @property
    def sample_items(self) -> list[ScheduledItem]:
        """Items whose last token's logits are sampled."""
        return [item for item in self.items if item.sample]


@dataclass
class StepPlan:
    """The step being built: its items so far and the token budget left."""

    tokens_left: int
    prefill_tokens_left: int
    chunking: bool
    items: dict[str, ScheduledItem] = field(default_factory=dict)
    preempted: bool = False

    @classmethod
    def start(cls, config: SchedulerConfig) -> StepPlan:
        """An empty plan with the full per-step budget of ``config``."""
        prefill = config.chunked_prefill_size if config.chunking else config.max_num_batched_tokens
        return cls(config.max_num_batched_tokens, prefill, config.chunking)

    def grant_prefill(self, remaining: int) -> int:
        """Prefill tokens granted out of ``remaining``: all, a chunk, or 0 if it must wait."""
        limit = min(self.tokens_left, self.prefill_tokens_left)
        if remaining <= limit:
            return remaining
        return limit if self.chunking else 0

    def add(self, item: ScheduledItem) -> None:
        """Append ``item`` and charge its tokens (lookahead included) to the budget."""
        self.items[item.seq_id] = item
        self.tokens_left -= item.num_tokens + item.num_lookahead
        if not item.is_decode:
            self.prefill_tokens_left -= item.num_tokens

    def to_batch(self) -> ScheduledBatch | None:
        """The finished step, or None when it is empty."""
        return ScheduledBatch(list(self.items.values())) if self.items else None
