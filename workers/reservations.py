"""The decode side's KV reservations: what a ``ReserveRequest`` holds in the engine, and
the check that a prefill's staged pages are exactly the ones a reservation misses."""

from __future__ import annotations

from dsv3serve.engine.engine import Engine, KVReservation
from dsv3serve.engine.scheduler.dp import DPScheduler
from kv_transfer.handle import KVHandle
from workers.protocol import ReserveRequest


def reserve_for(
    engine: Engine, msg: ReserveRequest, prefix_reuse: bool = True
) -> KVReservation | None:
    """``msg``'s reservation (None when full): after the prompt's prefix cached here when
    ``msg`` names the prompt and ``prefix_reuse`` is on, else for all ``num_tokens``
    (nothing cached: every page is pulled); on DP rank ``msg.dp_rank`` when it has room
    (DP attention only)."""
    if msg.prompt_ids is not None and prefix_reuse:
        return engine.reserve_prompt_kv(msg.prompt_ids, dp_rank=msg.dp_rank)
    pages = engine.reserve_kv(msg.num_tokens)
    return None if pages is None else KVReservation(pages)


def reservation_rank(engine: Engine, res: KVReservation) -> int:
    """The DP rank holding ``res`` (0 without DP attention)."""
    scheduler = engine.scheduler
    if not isinstance(scheduler, DPScheduler) or not res.pages:
        return 0
    return scheduler.split_pages(res.pages)[0]


def staged_mismatch(handle: KVHandle, res: KVReservation, pulled: int = 0) -> str | None:
    """Why ``handle`` does not stage exactly the pages ``res`` misses, once the first
    ``pulled`` of them landed already (overlapped transfer: the attempt's ranges); None
    when it does. The handle may start anywhere up to ``pulled`` (it restages ranges
    the prefill side dropped) and must end with the reservation."""
    cached, first = res.num_cached_pages, handle.first_page
    if cached <= first <= cached + pulled and first - cached + handle.num_pages == len(res.pages):
        return None
    return (
        f"the prefill side staged {handle.num_pages} pages from prompt page {first}, but "
        f"this decode replica holds the first {cached} pages, pulled {pulled} after them "
        f"and reserved {len(res.pages)} for the rest"
    )


def range_mismatch(handle: KVHandle, res: KVReservation, pulled: int) -> str | None:
    """Why ``handle``, a range of a prefill still running, is not the next one for ``res``
    (whose first ``pulled`` pages landed); None when it is. A range never holds the
    prompt's last page: the final handoff does."""
    cached = res.num_cached_pages
    if handle.first_page == cached + pulled and pulled + handle.num_pages < len(res.pages):
        return None
    return (
        f"a KV range of {handle.num_pages} pages from prompt page {handle.first_page} is "
        f"not the next for this reservation: the first {cached} pages are cached here, "
        f"{pulled} pulled after them, {len(res.pages)} reserved"
    )
