"""DP attention's scheduler: one :class:`Scheduler` per DP rank behind the Scheduler API.

Each DP rank has its own KV pool, so its own pages, prefix cache and batch. A new sequence
goes to the rank whose prefix cache holds the longest prefix of it, then to the rank with
the most available pages, then the fewest running sequences (SGLang's DP controller does
the same by load). The engine sees one page space: page ``p`` of rank ``r`` is the global
page ``r * pages_per_rank + p`` (what PD reservations hand out and take back); a
sequence's ``page_table`` holds its rank's local pages and ``seq.dp_rank`` names the rank.

A router that scores (replica, DP rank) candidates (``router.routing.rank_routing``) names a rank:
a new sequence's ``preferred_dp_rank``, a reservation's ``dp_rank``. It is honoured unless
invalid (no such rank) or full (the rank cannot hold what the prompt misses there); then
the rank is this scheduler's own choice and ``fallbacks`` counts it (per rank taken).
``placed`` counts the sequences and reservations each rank took.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from dsv3serve.engine.scheduler.pd import NO_PREFIX, KVReservation
from dsv3serve.engine.scheduler.scheduler import Scheduler
from dsv3serve.engine.scheduler.sequence import (
    ScheduledBatch,
    ScheduledItem,
    SchedulerConfig,
    Sequence,
)
from dsv3serve.kvcache.radix_cache import PrefixMatch


class DPKVView:
    """The KV counters of every DP rank's pool added up (what metrics and load read)."""

    def __init__(self, ranks: list[Scheduler]) -> None:
        self._ranks = ranks

    def _sum(self, name: str) -> int:
        return sum(getattr(s.kv, name) for s in self._ranks)

    num_pages = property(lambda self: self._sum("num_pages"))
    free_pages = property(lambda self: self._sum("free_pages"))
    used_pages = property(lambda self: self._sum("used_pages"))
    evictable_pages = property(lambda self: self._sum("evictable_pages"))
    available_pages = property(lambda self: self._sum("available_pages"))
    hit_tokens = property(lambda self: self._sum("hit_tokens"))
    miss_tokens = property(lambda self: self._sum("miss_tokens"))

    @property
    def usage(self) -> float:
        """Fraction of all pools that cannot be reclaimed now (0-1)."""
        return 1.0 - self.available_pages / self.num_pages

    def pages_for_tokens(self, num_tokens: int) -> int:
        return self._ranks[0].kv.pages_for_tokens(num_tokens)


class DPScheduler:
    """``dp_size`` schedulers, one per DP rank, with the :class:`Scheduler` interface."""

    def __init__(self, config: SchedulerConfig, dp_size: int) -> None:
        self.config = config  # per rank: num_pages is one rank's pool
        self.ranks = [Scheduler(config) for _ in range(dp_size)]
        self.kv = DPKVView(self.ranks)
        self._staging: dict[int, list[int]] = {}  # first global page -> rank 0 pages
        self.placed = [0] * dp_size  # sequences and reservations each rank took
        self.fallbacks = [0] * dp_size  # of those, the ones a router's rank could not take

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def pages_per_rank(self) -> int:
        return self.config.num_pages

    # ---- placement ------------------------------------------------------------------
    def choose_rank(self, tokens: list[int], salt: str) -> int:
        """The rank for a new sequence: longest cached prefix, most pages, least running."""

        def score(rank: int) -> tuple[int, int, int]:
            s = self.ranks[rank]
            hit = s.kv.peek_prefix(tokens, salt, len(tokens) - 1)
            return hit, s.kv.available_pages, -(s.num_running + s.num_waiting)

        return max(range(self.dp_size), key=score)

    def fits(self, rank: int, tokens: list[int], salt: str) -> bool:
        """Whether ``rank`` is valid and has room now for what ``tokens`` misses in its
        prefix cache (the last token always computed)."""
        if not 0 <= rank < self.dp_size:
            return False
        kv = self.ranks[rank].kv
        hit = kv.peek_prefix(tokens, salt, len(tokens) - 1) // self.config.page_size
        return kv.pages_for_tokens(len(tokens)) - hit <= kv.available_pages

    def _placed(self, rank: int, preferred: int | None) -> int:
        """Count ``rank`` taking a request the router sent to ``preferred`` (if any)."""
        self.placed[rank] += 1
        if preferred is not None and preferred != rank:
            self.fallbacks[rank] += 1
        return rank

    def split_pages(self, pages: list[int]) -> tuple[int, list[int]]:
        """Global pages (all on one rank) -> (rank, local pages)."""
        ranks = {page // self.pages_per_rank for page in pages}
        if len(ranks) != 1:
            raise ValueError(f"expected pages of one DP rank, found ranks {sorted(ranks)}")
        rank = ranks.pop()
        return rank, [page - rank * self.pages_per_rank for page in pages]

    def global_pages(self, rank: int, pages: list[int]) -> list[int]:
        """Local pages of ``rank`` -> global page ids."""
        return [rank * self.pages_per_rank + page for page in pages]

    def _of(self, seq: Sequence) -> Scheduler:
        return self.ranks[seq.dp_rank]

    # ---- the Scheduler interface ----------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` on its ``preferred_dp_rank`` if that fits, else on
        :meth:`choose_rank`'s."""
        tokens, preferred = seq.token_ids(0, seq.num_tokens), seq.preferred_dp_rank
        if preferred is not None and self.fits(preferred, tokens, seq.salt):
            rank = preferred
        else:
            rank = self.choose_rank(tokens, seq.salt)
        seq.dp_rank = self._placed(rank, preferred)
        self._of(seq).add(seq)

    def schedule(self) -> ScheduledBatch | None:
        """Every rank's step, concatenated (items carry their rank in ``seq.dp_rank``)."""
        items = [item for s in self.ranks if (b := s.schedule()) is not None for item in b.items]
        return ScheduledBatch(items) if items else None

    def _by_rank(self, items: list[ScheduledItem]) -> list[tuple[Scheduler, ScheduledBatch]]:
        parts: dict[int, list[ScheduledItem]] = {}
        for item in items:
            parts.setdefault(item.seq.dp_rank, []).append(item)
        return [(self.ranks[r], ScheduledBatch(part)) for r, part in parts.items()]

    def on_step_done(self, batch: ScheduledBatch, sampled: Mapping[str, int | list[int]]) -> None:
        for s, part in self._by_rank(batch.items):
            s.on_step_done(part, sampled)

    def on_step_launched(self, batch: ScheduledBatch, placeholders: Mapping[str, int]) -> None:
        for s, part in self._by_rank(batch.items):
            s.on_step_launched(part, placeholders)

    def resolve_token(self, item: ScheduledItem, placeholder: int, token: int) -> bool:
        return self._of(item.seq).resolve_token(item, placeholder, token)

    def rollback_launch(self, item: ScheduledItem) -> None:
        self._of(item.seq).rollback_launch(item)

    def finish(self, seq: Sequence, reason: str) -> bool:
        return self._of(seq).finish(seq, reason)

    def abort(self, request_id: str) -> bool:
        return any([s.abort(request_id) for s in self.ranks])

    def pop_finished(self) -> list[Sequence]:
        return [seq for s in self.ranks for seq in s.pop_finished()]

    def release_exported(self, seq: Sequence) -> None:
        self._of(seq).release_exported(seq)

    # ---- PD: reservations are global page ids on one rank -------------------------------
    def reserve(self, num_tokens: int) -> list[int] | None:
        """Pages for incoming KV on the rank with the most available pages.

        The KV connector writes into rank 0's pool, so a reservation on another rank also
        holds as many staging pages on rank 0 until :meth:`take_staging` (the move).
        """
        order = sorted(range(self.dp_size), key=lambda r: -self.ranks[r].kv.available_pages)
        for rank in order:
            pages = self._reserve_on(rank, num_tokens)
            if pages is not None:
                return pages
        return None

    def _reserve_on(self, rank: int, num_tokens: int) -> list[int] | None:
        pages = self.ranks[rank].reserve(num_tokens)
        if pages is None or rank == 0:
            return pages
        global_pages = self._with_staging(rank, pages)
        if global_pages is None:
            self.ranks[rank].release_reservation(pages)
        return global_pages

    def _with_staging(self, rank: int, pages: list[int]) -> list[int] | None:
        """Global ids of ``rank``'s reserved ``pages``, with as many staging pages held on
        rank 0 (rank 0's own pages need none); None when rank 0 has no room."""
        if rank == 0:
            return pages
        staging = self.ranks[0].reserve(len(pages) * self.config.page_size)
        if staging is None:
            return None
        global_pages = self.global_pages(rank, pages)
        self._staging[global_pages[0]] = staging
        return global_pages

    def reserve_prompt(
        self, prompt: list[int], salt: str = "", dp_rank: int | None = None
    ) -> KVReservation | None:
        """A :meth:`Scheduler.reserve_prompt` on rank ``dp_rank`` (a router's choice) when
        it has room, else on the rank with the longest cached prefix of ``prompt``, then
        the most available pages (global ``pages``, local prefix pages)."""

        def score(rank: int) -> tuple[int, int]:
            kv = self.ranks[rank].kv
            return kv.peek_prefix(prompt, salt, len(prompt) - 1), kv.available_pages

        order = sorted(range(self.dp_size), key=score, reverse=True)
        if dp_rank is not None and 0 <= dp_rank < self.dp_size:
            order.remove(dp_rank)
            order.insert(0, dp_rank)
        for rank in order:
            reservation = self.ranks[rank].reserve_prompt(prompt, salt)
            if reservation is None:
                continue
            pages = self._with_staging(rank, reservation.pages)
            if pages is not None:
                self._placed(rank, dp_rank)
                return replace(reservation, pages=pages)
            self.ranks[rank].release_prompt(reservation)
        return None

    def landing_pages(self, pages: list[int]) -> list[int]:
        """Rank 0's pages where a reservation's KV arrives (the pages themselves on rank 0)."""
        rank, local = self.split_pages(pages)
        return local if rank == 0 else self._staging[pages[0]]

    def take_staging(self, pages: list[int]) -> list[int]:
        """Rank 0's staging pages of a reservation, no longer tracked here (still reserved
        on rank 0: the caller releases them once moved)."""
        return self._staging.pop(pages[0])

    def release_reservation(self, pages: list[int]) -> None:
        rank, local = self.split_pages(pages)
        self.ranks[rank].release_reservation(local)
        staging = self._staging.pop(pages[0], None)
        if staging is not None:
            self.ranks[0].release_reservation(staging)

    def release_prompt(self, reservation: KVReservation) -> None:
        """Give back a :meth:`reserve_prompt` reservation: pages, staging and prefix lock."""
        self.release_reservation(reservation.pages)
        rank, _ = self.split_pages(reservation.pages)
        self.ranks[rank].kv.release(reservation.prefix.handle, [])

    def add_prefilled(
        self, seq: Sequence, pages: list[int], prefix: PrefixMatch = NO_PREFIX
    ) -> None:
        seq.dp_rank, local = self.split_pages(pages)
        self._of(seq).add_prefilled(seq, local, prefix)

    # ---- counters -------------------------------------------------------------------
    def _total(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.ranks)

    num_running = property(lambda self: self._total("num_running"))
    num_waiting = property(lambda self: self._total("num_waiting"))
    num_exported = property(lambda self: self._total("num_exported"))
    num_preemptions = property(lambda self: self._total("num_preemptions"))
    prefix_hit_tokens = property(lambda self: self._total("prefix_hit_tokens"))
    prefix_miss_tokens = property(lambda self: self._total("prefix_miss_tokens"))

    @property
    def has_unfinished(self) -> bool:
        return any(s.has_unfinished for s in self.ranks)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def check_invariants(self) -> None:
        for s in self.ranks:
            s.check_invariants()
