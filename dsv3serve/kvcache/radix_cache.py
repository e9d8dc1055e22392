"""Radix prefix cache over KV pages, one page per tree node (pure Python).

Each node holds one full page: its key is the tuple of ``page_size`` token ids whose KV
the page stores, and its path from the root is the whole prefix before it. Every tenant
salt has its own root, so different salts never share a node.

Ownership: a page inserted into the tree belongs to the tree. A request that uses tree
pages holds a lock (reference) on the deepest node it uses; a lock counts on every node
up to the root, so a node with ``ref_count == 0`` has an unreferenced subtree. Only those
nodes are evictable, leaves first, least recently used first; eviction returns the page
to the allocator.

With a host tier (``host_tier.py``, the hierarchical cache) an evicted node keeps its KV
in a host page when one can be had (its device page is copied there first) and stays in
the tree, host-only; ``match_prefix`` loads a matched host-only run back into device pages
before it returns. The device-resident nodes stay closed under parents (eviction takes
device leaves, loading goes top-down), so a host-only node has only host-only children,
is never locked and holds exactly one of the two pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from dsv3serve.kvcache.allocator import PageAllocator
from dsv3serve.kvcache.host_tier import HostTier
from dsv3serve.kvcache.prefix_hash import next_hash, salt_hash
from dsv3serve.kvcache.radix_node import InsertResult, PageKey, PrefixMatch, RadixNode

__all__ = ["InsertResult", "PageKey", "PrefixMatch", "RadixCache", "RadixNode"]


class RadixCache:
    """Page-granular prefix cache with per-salt roots, ref counts and LRU eviction.

    When ``enabled`` is False the cache is inert: ``match_prefix`` finds nothing (misses
    are still counted) and ``insert`` keeps nothing, leaving every page with the caller.
    ``host`` adds the host tier under the device pages (see the module docstring).
    """

    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator,
        enabled: bool = True,
        host: HostTier | None = None,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.enabled = enabled
        self._allocator = allocator
        self.host = host if enabled else None
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
        misses = the rest. A host-only run of the match is loaded back into device pages
        first, as far as device pages can be had without evicting the match itself.
        """
        path = self._walk(tokens, salt, limit) if self.enabled else []
        nodes = [node for node in path if node.on_device]
        handle = nodes[-1] if nodes else None
        self._touch(path[-1] if path else None)
        self.lock(handle)
        loaded: list[RadixNode] = []
        if len(nodes) < len(path):
            handle, loaded = self._load(path[len(nodes) :], handle)
        nodes.extend(loaded)
        num_tokens = len(nodes) * self.page_size
        if record_stats:
            self.record_query(len(tokens), num_tokens)
        host_tokens = len(loaded) * self.page_size
        return PrefixMatch([node.page for node in nodes], num_tokens, handle, host_tokens)

    def peek(self, tokens: Sequence[int], salt: str = "", limit: int | None = None) -> int:
        """Tokens ``match_prefix`` would match now (device and host tier), without
        locking, loading or counting stats."""
        return sum(self.peek_tiers(tokens, salt, limit))

    def peek_tiers(
        self, tokens: Sequence[int], salt: str = "", limit: int | None = None
    ) -> tuple[int, int]:
        """``(device_tokens, host_tokens)``: the cached prefix of ``tokens`` split by the
        tier holding it (the device part comes first)."""
        path = self._walk(tokens, salt, limit) if self.enabled else []
        device = sum(1 for node in path if node.on_device)
        return device * self.page_size, (len(path) - device) * self.page_size

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
        """Free up to ``num_pages`` unreferenced pages, LRU leaves first; return how many.

        With a host tier each one's KV is copied to a host page first where one can be
        had (the least recently used host-only leaves make room), before this returns."""
        freed = self._evict_pages(num_pages)
        if self.host is not None:
            self.host.flush()
        return freed

    def prefix_hashes(self, max_entries: int, on_device: bool | None = None) -> list[int]:
        """Hashes (``kvcache.prefix_hash``) of the cached prefixes, one per node, at most
        ``max_entries`` of them: the most recently used first, the deepest first among
        equals (a deep prefix's hash implies all of its shorter ones). ``on_device``:
        only nodes held in device pages (True) or only host-only ones (False)."""
        entries: list[tuple[int, int, int]] = []  # (last access, depth, hash)
        for salt, root in self._roots.items():
            stack = [(child, 1, salt_hash(salt)) for child in root.children.values()]
            while stack:
                node, depth, parent_hash = stack.pop()
                h = node.prefix_hash
                if h is None:
                    h = node.prefix_hash = next_hash(parent_hash, node.key)
                if on_device is None or node.on_device == on_device:
                    entries.append((node.last_access, depth, h))
                stack.extend((child, depth + 1, h) for child in node.children.values())
        # a path shares its access time: deepest first
        return [h for *_, h in heapq.nlargest(max_entries, entries)]

    def check_invariants(self) -> set[int]:
        """Check counters, ref counts and page ownership; return the set of tree pages."""
        pages: set[int] = set()
        host_pages: set[int] = set()
        evictable = 0
        for salt, root in self._roots.items():
            assert root.is_root and root.salt == salt and root.children, "bad or empty root"
            for node in self._descendants(root):
                if not node.on_device:
                    self._check_host_node(node, host_pages)
                    continue
                assert node.host_page < 0, f"page {node.page} also holds a host page"
                assert node.page not in pages, f"page {node.page} is in the tree twice"
                assert self._allocator.is_allocated(node.page), f"tree page {node.page} is free"
                child_refs = sum(child.ref_count for child in node.children.values())
                assert node.ref_count >= child_refs, "ref count below its children's"
                pages.add(node.page)
                evictable += node.ref_count == 0
        assert len(pages) == self._cached, f"cached count {self._cached} != {len(pages)}"
        assert evictable == self._evictable, f"evictable {self._evictable} != {evictable}"
        if self.host is not None:
            self.host.check_invariants(host_pages)
        return pages

    def _check_host_node(self, node: RadixNode, host_pages: set[int]) -> None:
        assert self.host is not None and node.host_page >= 0, "a node holds no page"
        assert node.host_page not in host_pages, f"host page {node.host_page} held twice"
        assert node.ref_count == 0, f"host-only node (host page {node.host_page}) is locked"
        assert not any(child.on_device for child in node.children.values()), (
            f"host-only node (host page {node.host_page}) has a device child"
        )
        host_pages.add(node.host_page)

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
        elif not child.on_device:  # host-only: the caller's page holds the same KV
            assert self.host is not None
            self.host.free(child.host_page)
            child.page, child.host_page = page, -1
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

    @staticmethod
    def _is_device_leaf(node: RadixNode) -> bool:
        """Evictable from the device: unreferenced and no child on the device."""
        if not node.on_device or node.ref_count:
            return False
        return not any(child.on_device for child in node.children.values())

    def _push_if_evictable_leaf(self, node: RadixNode | None) -> None:
        if node is None or node.is_root or not self._is_device_leaf(node):
            return
        self._pushes += 1
        heapq.heappush(self._lru, (node.last_access, self._pushes, node))
        if len(self._lru) > 4 * self._cached + 64:
            self._lru = [entry for entry in self._lru if self._is_candidate(*entry)]
            heapq.heapify(self._lru)

    def _is_candidate(self, last_access: int, _order: int, node: RadixNode) -> bool:
        attached = node.parent is not None
        return attached and self._is_device_leaf(node) and node.last_access == last_access

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
        if node.on_device:
            self._cached -= 1
            self._evictable -= 1
        if parent.is_root and not parent.children:
            del self._roots[parent.salt]
        self._push_if_evictable_leaf(parent)
        if self.host is not None:
            self.host.push_leaf(parent)

    # ---- the host tier ----------------------------------------------------------------
    def _evict_pages(self, num_pages: int) -> int:
        """``evict`` without carrying out the logged host copies."""
        freed: list[int] = []
        while len(freed) < num_pages:
            node = self._pop_lru_leaf()
            if node is None:
                break
            freed.append(node.page)
            self._demote(node)
        self._allocator.free(freed)
        return len(freed)

    def _demote(self, node: RadixNode) -> None:
        """Move an evicted device leaf to a host page, or drop it (and its host-only
        subtree) when there is no host tier or no host page; its device page is the
        caller's to free."""
        host_page = self._host_page() if self.host is not None else None
        if host_page is None:
            self._drop(node)
            return
        assert self.host is not None
        self.host.log_backup(node.page, host_page)
        node.page, node.host_page = -1, host_page
        self._cached -= 1
        self._evictable -= 1
        self._push_if_evictable_leaf(node.parent)
        self.host.push_leaf(node)

    def _host_page(self) -> int | None:
        assert self.host is not None
        while (page := self.host.alloc()) is None:
            victim = self.host.pop_lru_leaf()
            if victim is None:
                return None
            self._drop(victim)
            self.host.stats.dropped_pages += 1
        return page

    def _drop(self, node: RadixNode) -> None:
        """Take ``node`` and its subtree out of the tree, freeing their host pages."""
        self._detach(node)
        for dropped in [node, *self._descendants(node)]:
            if dropped.host_page >= 0:
                assert self.host is not None
                self.host.free(dropped.host_page)
                dropped.host_page = -1

    def _load(
        self, run: list[RadixNode], handle: RadixNode | None
    ) -> tuple[RadixNode | None, list[RadixNode]]:
        """Load the host-only chain ``run`` (below the locked ``handle``) into device pages,
        top-down, moving the lock down with each; stop where no device page can be had or
        a node of the chain was dropped to make room. Returns the new lock and the nodes
        loaded."""
        assert self.host is not None
        loaded: list[RadixNode] = []
        for node in run:
            page = self._device_page()
            if page is None or node.parent is None or node.on_device:
                self._allocator.free([page] if page is not None else [])
                break
            self.host.log_load(node.host_page, page)
            self.host.free(node.host_page)
            node.page, node.host_page = page, -1
            self._cached += 1
            self._evictable += 1
            self.lock(node)
            self.unlock(handle)
            handle = node
            loaded.append(node)
        self.host.flush()
        return handle, loaded

    def _device_page(self) -> int | None:
        if self._allocator.num_free == 0:
            self._evict_pages(1)
        pages = self._allocator.alloc(1)
        return pages[0] if pages else None

    @staticmethod
    def _descendants(root: RadixNode) -> list[RadixNode]:
        nodes: list[RadixNode] = []
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
