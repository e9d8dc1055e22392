"""The connector ABC: how a prefill engine stages KV pages and a decode engine pulls them."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TypeVar

from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.handle import KVHandle, TransferStats
from kv_transfer.pages import PageLayout

__all__ = ["KVConnector", "parse_options"]

OptionsT = TypeVar("OptionsT")


def parse_options(cls: type[OptionsT], options: JSONObject, connector: str) -> OptionsT:
    """Build the frozen options dataclass ``cls``; unknown names raise ValueError."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"connector {connector!r}: unknown options {unknown}; valid options: {sorted(known)}"
        )
    return cls(**options)


class KVConnector(ABC):
    """Moves the KV pages of one prefilled request from a prefill pool to a decode pool.

    One instance per engine rank, built on that rank's :class:`MLAKVPool`. The protocol is a
    pull: the prefill side ``publish``-es the prompt's pages and gets a JSON-safe
    :class:`KVHandle`; the router carries the handle to the decode side, which ``receive``-s
    into pages it reserved; then the prefill side ``release``-s (after the decode side
    reported success, or when the router's lease expires). Until ``release`` the staging
    serves pulls and the caller must keep the pages allocated (a connector may read them
    lazily); after ``release`` returns the connector no longer touches them.

    Transfers are bit-exact: the raw storage bytes of every layer, plus the float32
    scales of fp8 pools, land in the destination pages in the order given
    (:class:`~kv_transfer.pages.PageLayout`). Pages not named are never written.
    """

    name: str  # set by each class; a wrapper (workers/fault_injection.py) takes its inner's
    # Whether one request's pages may be published as several stagings, each pulled on its
    # own while the prefill runs on (overlapped transfer, ``workers/ranges.py``); a
    # connector without it is used with one staging per request, after the prefill.
    incremental: bool = True

    def __init__(self, pool: MLAKVPool) -> None:
        self.pool = pool
        self.layout = PageLayout.of(pool)

    # ---- prefill side ----------------------------------------------------------------
    @abstractmethod
    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        """Stage exactly ``pages`` (holding ``num_tokens`` tokens) for a pull.

        Raises ValueError for invalid pages or a request id that is already staged.
        """

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Drop the staging of ``request_id``; idempotent (unknown ids are ignored)."""

    @abstractmethod
    def staged(self) -> int:
        """Number of staged requests (for leak checks)."""

    # ---- decode side -----------------------------------------------------------------
    @abstractmethod
    def receive(self, handle: KVHandle, dst_pages: list[int]) -> TransferStats:
        """Pull ``handle``'s pages into ``dst_pages`` of this pool; blocks until written.

        ``len(dst_pages)`` must equal ``handle.num_pages``. Raises
        :class:`~kv_transfer.handle.TransferError` on any failure (staging missing or
        released, layout mismatch, peer gone, timeout); it never hangs.
        """

    @abstractmethod
    def close(self) -> None:
        """Release every staging and connection; the connector is unusable afterwards."""

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
