"""Radix prefix cache over KV pages, one page per tree node (pure Python).

Each node holds one full page: its key is the tuple of ``page_size`` token ids whose KV
the page stores, and its path from the root is the whole prefix before it. Every tenant
salt has its own root, so different salts never share a node.

Ownership: a page inserted into the tree belongs to the tree. A request that uses tree
pages holds a lock (reference) on the deepest node it uses; a lock counts on every node
up to the root, so a node with ``ref_count == 0`` has an unreferenced subtree. Only those
nodes are evictable, leaves first, least recently used first; eviction returns the page
to the allocator.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsv3serve.kvcache.allocator import PageAllocator
from dsv3serve.kvcache.prefix_hash import next_hash, salt_hash

PageKey = tuple[int, ...]


@dataclass(eq=False)
class RadixNode:
    """One cached page. Roots carry ``page == -1`` and are never evicted."""

    key: PageKey
    page: int
    parent: RadixNode | None
    salt: str
    children: dict[PageKey, RadixNode] = field(default_factory=dict)
    ref_count: int = 0
    last_access: int = 0
    prefix_hash: int | None = None  # memo of prefix_hashes (a node's path never changes)

    @property
    def is_root(self) -> bool:
        return self.page < 0


@dataclass(frozen=True)
class PrefixMatch:
    """Result of ``match_prefix``: tree pages for the first ``num_tokens`` tokens.

    ``handle`` is the locked deepest node (None when nothing matched); pass it to
    ``unlock`` when done with the pages.
    """

    pages: list[int]
    num_tokens: int
    handle: RadixNode | None


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


class RadixCache:
    """Page-granular prefix cache with per-salt roots, ref counts and LRU eviction.

    When ``enabled`` is False the cache is inert: ``match_prefix`` finds nothing (misses
    are still counted) and ``insert`` keeps nothing, leaving every page with the caller.
    """

    def __init__(self, page_size: int, allocator: PageAllocator, enabled: bool = True) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.enabled = enabled
        self._allocator = allocator
        self._roots: dict[str, RadixNode] = {}
        self._clock = 0
        self._cached = 0
        self._evictable = 0
        self._lru: list[tuple[int, int, RadixNode]] = []  # lazy heap of candidate leaves
        self._pushes = 0
        self.hit_tokens = 0
        self.miss_tokens = 0

    @property
    def cached_pages(self) -> int:
        """Pages held by the tree (locked or not)."""
        return self._cached

    @property
    def evictable_pages(self) -> int:
        """Tree pages no request references; ``evict`` can free all of them."""
        return self._evictable

    def match_prefix(
        self,
        tokens: Sequence[int],
        salt: str = "",
        limit: int | None = None,
        record_stats: bool = True,
    ) -> PrefixMatch:
        """Find and lock the longest cached prefix of ``tokens`` made of full pages.

        At most ``limit`` tokens (rounded down to full pages) are matched. With
        ``record_stats`` the query counts ``len(tokens)`` tokens: hits = matched tokens,
        misses = the rest.
        """
        path = self._walk(tokens, salt, limit) if self.enabled else []
        num_tokens = len(path) * self.page_size
        if record_stats:
            self.record_query(len(tokens), num_tokens)
        handle = path[-1] if path else None
        self._touch(handle)
        self.lock(handle)
        return PrefixMatch([node.page for node in path], num_tokens, handle)

    def peek(self, tokens: Sequence[int], salt: str = "", limit: int | None = None) -> int:
        """Tokens ``match_prefix`` would match now, without locking or counting stats."""
        return len(self._walk(tokens, salt, limit)) * self.page_size if self.enabled else 0

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a prefix query of ``num_tokens`` tokens of which ``num_hit_tokens`` hit."""
        self.hit_tokens += num_hit_tokens
        self.miss_tokens += num_tokens - num_hit_tokens

    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: str = "") -> InsertResult:
        """Add ``pages`` (KV of ``tokens[: len(pages) * page_size]``) under ``salt``.

        New keys take ownership of the caller's page; keys already present keep the tree's
        page and report the caller's as a duplicate. See ``InsertResult``.
        """
        if len(tokens) < len(pages) * self.page_size:
            raise ValueError(
                f"insert needs {len(pages) * self.page_size} tokens for {len(pages)} pages, "
                f"got {len(tokens)}"
            )
        if not self.enabled or not pages:
            return InsertResult(None, list(pages), [])
        node = self._roots.setdefault(salt, RadixNode((), -1, None, salt))
        tree_pages: list[int] = []
        duplicates: list[int] = []
        for index, page in enumerate(pages):
            node = self._child_for_insert(node, self._key(tokens, index), page, duplicates)
            tree_pages.append(node.page)
        self._touch(node)
        self._push_if_evictable_leaf(node)
        return InsertResult(node, tree_pages, duplicates)

    def lock(self, handle: RadixNode | None) -> None:
        """Reference ``handle`` and its ancestors so they cannot be evicted."""
        node = handle
        while node is not None and not node.is_root:
            if node.ref_count == 0:
                self._evictable -= 1
            node.ref_count += 1
            node = node.parent

    def unlock(self, handle: RadixNode | None) -> None:
        """Drop one reference taken by ``match_prefix`` or ``lock``."""
        self._touch(handle)
        node = handle
        while node is not None and not node.is_root:
            if node.ref_count <= 0:
                raise ValueError(f"unlock of page {node.page} that is not locked")
            node.ref_count -= 1
            if node.ref_count == 0:
                self._evictable += 1
            node = node.parent
        self._push_if_evictable_leaf(handle)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unreferenced pages, LRU leaves first; return how many."""
        freed: list[int] = []
        while len(freed) < num_pages:
            node = self._pop_lru_leaf()
            if node is None:
                break
            self._detach(node)
            freed.append(node.page)
        self._allocator.free(freed)
        return len(freed)

    def prefix_hashes(self, max_entries: int) -> list[int]:
        """Hashes (``kvcache.prefix_hash``) of the cached prefixes, one per node, at most
        ``max_entries`` of them: the most recently used first, the deepest first among
        equals (a deep prefix's hash implies all of its shorter ones)."""
        entries: list[tuple[int, int, int]] = []  # (last access, depth, hash)
        for salt, root in self._roots.items():
            stack = [(child, 1, salt_hash(salt)) for child in root.children.values()]
            while stack:
                node, depth, parent_hash = stack.pop()
                h = node.prefix_hash
                if h is None:
                    h = node.prefix_hash = next_hash(parent_hash, node.key)
                entries.append((node.last_access, depth, h))
                stack.extend((child, depth + 1, h) for child in node.children.values())
        # a path shares its access time: deepest first
        return [h for *_, h in heapq.nlargest(max_entries, entries)]

    def check_invariants(self) -> set[int]:
        """Check counters, ref counts and page ownership; return the set of tree pages."""
        pages: set[int] = set()
        evictable = 0
        for salt, root in self._roots.items():
            assert root.is_root and root.salt == salt and root.children, "bad or empty root"
            for node in self._descendants(root):
                assert node.page not in pages, f"page {node.page} is in the tree twice"
                assert self._allocator.is_allocated(node.page), f"tree page {node.page} is free"
                child_refs = sum(child.ref_count for child in node.children.values())
                assert node.ref_count >= child_refs, "ref count below its children's"
                pages.add(node.page)
                evictable += node.ref_count == 0
        assert len(pages) == self._cached, f"cached count {self._cached} != {len(pages)}"
        assert evictable == self._evictable, f"evictable {self._evictable} != {evictable}"
        return pages

    def _key(self, tokens: Sequence[int], index: int) -> PageKey:
        start = index * self.page_size
        return tuple(tokens[start : start + self.page_size])

    def _walk(self, tokens: Sequence[int], salt: str, limit: int | None) -> list[RadixNode]:
        num_tokens = len(tokens) if limit is None else min(len(tokens), limit)
        node = self._roots.get(salt)
        path: list[RadixNode] = []
        for index in range(num_tokens // self.page_size):
            node = node.children.get(self._key(tokens, index)) if node else None
            if node is None:
                break
            path.append(node)
        return path

    def _child_for_insert(
        self, node: RadixNode, key: PageKey, page: int, duplicates: list[int]
    ) -> RadixNode:
        child = node.children.get(key)
        if child is None:
            child = RadixNode(key, page, node, node.salt)
            node.children[key] = child
            self._cached += 1
            self._evictable += 1
        elif child.page != page:
            duplicates.append(page)
        return child

    def _touch(self, handle: RadixNode | None) -> None:
        self._clock += 1
        node = handle
        while node is not None:
            node.last_access = self._clock
            node = node.parent

    def _push_if_evictable_leaf(self, node: RadixNode | None) -> None:
        if node is None or node.is_root or node.ref_count or node.children:
            return
        self._pushes += 1
        heapq.heappush(self._lru, (node.last_access, self._pushes, node))
        if len(self._lru) > 4 * self._cached + 64:
            self._lru = [entry for entry in self._lru if self._is_candidate(*entry)]
            heapq.heapify(self._lru)

    def _is_candidate(self, last_access: int, _order: int, node: RadixNode) -> bool:
        attached = node.parent is not None
        leaf = not node.ref_count and not node.children
        return attached and leaf and node.last_access == last_access

    def _pop_lru_leaf(self) -> RadixNode | None:
        while self._lru:
            entry = heapq.heappop(self._lru)
            if self._is_candidate(*entry):
                return entry[2]
        return None

    def _detach(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        node.parent = None
        self._cached -= 1
        self._evictable -= 1
        if parent.is_root and not parent.children:
            del self._roots[parent.salt]
        self._push_if_evictable_leaf(parent)

    @staticmethod
    def _descendants(root: RadixNode) -> list[RadixNode]:
        nodes: list[RadixNode] = []
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
