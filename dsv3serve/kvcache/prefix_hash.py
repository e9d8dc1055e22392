"""Stable hashes of page-aligned prompt prefixes (pure Python, no torch).

Entry ``i`` of :func:`page_prefix_hashes` stands for the first ``(i + 1) * page_size``
tokens under a salt: a chain ``h_i = blake2b(h_{i-1} || tokens of page i)`` started from the
salt, so one 64-bit value names a whole prefix, and every process (router, engines) agrees
on it (no per-process hash seed). An engine summarises its prefix cache as a bounded set
of these hashes; a router matches a prompt's hashes against it (``router.routing.rank_policy``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def salt_hash(salt: str) -> int:
    """The chain's start for ``salt`` (a tenant's prefix-cache namespace)."""
    digest = hashlib.blake2b(salt.encode(), digest_size=8, person=b"dsv3-salt").digest()
    return int.from_bytes(digest, "little")


def next_hash(previous: int, page_tokens: Sequence[int]) -> int:
    """The hash of a prefix one page longer than the one ``previous`` names."""
    data = struct.pack(f"<Q{len(page_tokens)}q", previous, *page_tokens)
    digest = hashlib.blake2b(data, digest_size=8, person=b"dsv3-page").digest()
    return int.from_bytes(digest, "little")


def page_prefix_hashes(
    tokens: Sequence[int], page_size: int, salt: str = "", max_pages: int | None = None
) -> list[int]:
    """One hash per full page of ``tokens`` (at most ``max_pages``): entry ``i`` names
    ``tokens[: (i + 1) * page_size]`` under ``salt``."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    num_pages = len(tokens) // page_size
    if max_pages is not None:
        num_pages = min(num_pages, max_pages)
    hashes, h = [], salt_hash(salt)
    for index in range(num_pages):
        h = next_hash(h, tokens[index * page_size : (index + 1) * page_size])
        hashes.append(h)
    return hashes
