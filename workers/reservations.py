"""The decode side's KV reservations: what a ``ReserveRequest`` holds in the engine, and
the check that a prefill's staged pages are exactly the ones a reservation misses."""

from __future__ import annotations

from dsv3serve.engine.dp_scheduler import DPScheduler
from dsv3serve.engine.engine import Engine, KVReservation
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


def staged_mismatch(handle: KVHandle, res: KVReservation) -> str | None:
    """Why ``handle`` does not stage exactly the pages ``res`` misses; None when it does."""
    if handle.first_page == res.num_cached_pages and handle.num_pages == len(res.pages):
        return None
    return (
        f"the prefill side staged {handle.num_pages} pages from prompt page "
        f"{handle.first_page}, but this decode replica holds the first "
        f"{res.num_cached_pages} pages and reserved {len(res.pages)} for the rest"
    )
