"""The radix prefix cache's node and result types (pure Python): see ``radix_cache.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

PageKey = tuple[int, ...]


@dataclass(eq=False)
class RadixNode:
    """One cached page: ``page`` on the device, or (host-only, ``page == -1``) ``host_page``
    in the host tier. Roots have an empty key and no parent, and are never evicted."""

    key: PageKey
    page: int
    parent: RadixNode | None
    salt: str
    children: dict[PageKey, RadixNode] = field(default_factory=dict)
    ref_count: int = 0
    last_access: int = 0
    prefix_hash: int | None = None  # memo of prefix_hashes (a node's path never changes)
    host_page: int = -1

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.key

    @property
    def on_device(self) -> bool:
        return self.page >= 0


@dataclass(frozen=True)
class PrefixMatch:
    """Result of ``match_prefix``: tree pages for the first ``num_tokens`` tokens.

    ``handle`` is the locked deepest node (None when nothing matched); pass it to
    ``unlock`` when done with the pages. ``host_tokens`` of the matched tokens (the last
    ones) were loaded back from the host tier for this match.
    """

    pages: list[int]
    num_tokens: int
    handle: RadixNode | None
    host_tokens: int = 0


@dataclass(frozen=True)
class InsertResult:
    """Result of ``insert``.

    ``pages[i]`` is the page the tree now holds for page ``i`` of the inserted prefix; it
    differs from the caller's page where the tree already had that key. Those caller pages
    are listed in ``duplicate_pages``: the caller frees them and switches to ``pages``.
    ``handle`` is the deepest node of the prefix (not locked by ``insert``).
    """

    handle: RadixNode | None
    pages: list[int]
    duplicate_pages: list[int]
