"""How many pages a rank's KV pool gets, and why: an explicit size, the CPU rule, the GPU budget.

- ``num_kv_tokens`` given: that many tokens, in whole pages.
- CPU: what the scheduler can use, ``max_running_requests`` requests of the whole context
  each, capped by a fixed budget per host (``cpu_kv_cache_space_gib``, 4 GiB by default as
  vLLM's ``VLLM_CPU_KVCACHE_SPACE``) that the group's ranks on the host share equally. It
  never depends on the host's free memory.
- GPU: SGLang's ``mem_fraction_static`` of the device's total (:func:`cuda_kv_budget_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv3serve.kvcache.allocator import pages_for_tokens

__all__ = [
    "DEFAULT_CPU_KV_CACHE_SPACE_GIB",
    "GIB",
    "KVSize",
    "cpu_kv_size",
    "cuda_kv_budget_bytes",
    "cuda_kv_size",
    "explicit_kv_size",
]

GIB = 1 << 30
DEFAULT_CPU_KV_CACHE_SPACE_GIB = 4.0  # vLLM's CPU backend default (VLLM_CPU_KVCACHE_SPACE)


@dataclass(frozen=True)
class KVSize:
    """A KV pool of ``pages`` pages of ``page_size`` tokens, ``page_bytes`` each (all layers,
    fp8 scales included), and the ``reason`` it has that size (what the engine's startup
    log and ``dsv3serve plan`` print)."""

    pages: int
    page_size: int
    page_bytes: int
    reason: str

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    def describe(self) -> str:
        """One line: pages, tokens, bytes and why."""
        return (
            f"{self.pages} pages of {self.page_size} tokens = {self.tokens} tokens, "
            f"{self.nbytes} bytes ({self.nbytes / GIB:.2f} GiB): {self.reason}"
        )


def explicit_kv_size(num_kv_tokens: int, page_size: int, page_bytes: int) -> KVSize:
    """``num_kv_tokens`` tokens in whole pages."""
    pages = pages_for_tokens(num_kv_tokens, page_size)
    return KVSize(pages, page_size, page_bytes, f"num_kv_tokens {num_kv_tokens}")


def cpu_kv_size(
    *,
    max_running_requests: int,
    context_len: int,
    space_gib: float,
    ranks_on_host: int,
    page_size: int,
    page_bytes: int,
) -> KVSize:
    """The CPU pool: ``max_running_requests`` x the pages of one ``context_len`` request, at
    most this rank's share of ``space_gib`` (``space_gib / ranks_on_host``).

    Raises ValueError, naming ``cpu_kv_cache_space_gib``, when the share holds no page.
    """
    counts = (max_running_requests, context_len, ranks_on_host, page_size, page_bytes)
    if min(counts) < 1 or space_gib <= 0:
        raise ValueError(
            "expected positive max_running_requests, context_len, space_gib, ranks_on_host, "
            f"page_size and page_bytes, got {max_running_requests}, {context_len}, "
            f"{space_gib}, {ranks_on_host}, {page_size} and {page_bytes}"
        )
    wanted = max_running_requests * pages_for_tokens(context_len, page_size)
    share = int(space_gib * GIB) // ranks_on_host
    cap = share // page_bytes
    if wanted <= cap:
        why = f"requests x context: {max_running_requests} x {context_len} tokens"
        return KVSize(wanted, page_size, page_bytes, why)
    if cap < 1:
        raise ValueError(
            f"cpu_kv_cache_space_gib {space_gib:g} over {ranks_on_host} ranks on this host "
            f"leaves {share} bytes per rank, less than one KV page ({page_bytes} bytes); "
            "raise it or set num_kv_tokens"
        )
    return KVSize(cap, page_size, page_bytes, _capped(space_gib, ranks_on_host, share))


def _capped(space_gib: float, ranks_on_host: int, share: int) -> str:
    if ranks_on_host == 1:
        return f"capped at {space_gib:g} GiB (cpu_kv_cache_space_gib)"
    return (
        f"capped at {share / GIB:.3g} GiB: cpu_kv_cache_space_gib {space_gib:g} "
        f"shared by {ranks_on_host} ranks on this host"
    )


def cuda_kv_budget_bytes(free: int, total: int, fraction: float, reserved: int) -> int:
    """The KV pool's bytes on a GPU under SGLang's ``mem_fraction_static``: the weights and
    the KV together take ``fraction`` of the GPU's ``total`` memory, so the pool gets that
    share less what is in use now (``total - free``: the weights, the CUDA context) and less
    ``reserved`` (the CUDA graphs and the activations of the largest step, which come later).

    Raises ValueError, naming ``mem_fraction_static``, when nothing is left for the pool.
    """
    budget = int(total * fraction) - (total - free) - reserved
    if budget <= 0:
        raise ValueError(
            f"mem_fraction_static {fraction}: {total * fraction / 1e9:.1f} GB of the GPU's "
            f"{total / 1e9:.1f} GB, less {(total - free) / 1e9:.1f} GB in use and "
            f"{reserved / 1e9:.1f} GB reserved for graphs and activations, leaves nothing "
            "for the KV cache; raise mem_fraction_static or use a layout that holds fewer "
            "weights per GPU"
        )
    return budget


def cuda_kv_size(budget: int, fraction: float, page_size: int, page_bytes: int) -> KVSize:
    """The whole pages of ``budget`` bytes (:func:`cuda_kv_budget_bytes`)."""
    why = f"mem_fraction_static {fraction:g} of the GPU, less weights and reserves"
    return KVSize(budget // page_bytes, page_size, page_bytes, why)
