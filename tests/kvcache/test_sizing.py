"""KV pool sizing: the CPU rule on a table of cases, an explicit size, the GPU budget."""

from __future__ import annotations

import pytest

from dsv3serve.kvcache.sizing import (
    GIB,
    KVSize,
    cpu_kv_size,
    cuda_kv_budget_bytes,
    cuda_kv_size,
    explicit_kv_size,
)

PAGE_BYTES = 25_600  # the tiny model in float32: 5 KV layers x 16 tokens x 80 values x 4 B
SHARED = "capped at {} GiB: cpu_kv_cache_space_gib 4 shared by"
# (max_running_requests, context_len, space_gib, ranks_on_host) -> (pages, reason starts with)
CPU_CASES = [
    # small demand: requests x the pages of one whole context
    ((4, 2048, 4.0, 1), (4 * 128, "requests x context: 4 x 2048 tokens")),
    ((1, 17, 4.0, 1), (2, "requests x context: 1 x 17 tokens")),  # a partial page is a page
    ((3, 17, 4.0, 1), (3 * 2, "requests x context: 3 x 17 tokens")),  # ... of each request
    ((256, 4096, 4.0, 1), (256 * 256, "requests x context: 256 x 4096 tokens")),
    # the same demand with more ranks on the host: still under each rank's share
    ((4, 2048, 4.0, 2), (4 * 128, "requests x context")),
    # the tiny model's 163,840-token context x 256 requests: 1 TB wanted, capped
    ((256, 163_840, 4.0, 1), (4 * GIB // PAGE_BYTES, "capped at 4 GiB (cpu_kv_cache_space_gib)")),
    ((256, 163_840, 4.0, 2), (2 * GIB // PAGE_BYTES, f"{SHARED.format(2)} 2 ranks on this")),
    ((256, 163_840, 4.0, 4), (GIB // PAGE_BYTES, f"{SHARED.format(1)} 4 ranks on this")),
    ((256, 163_840, 0.5, 1), (GIB // 2 // PAGE_BYTES, "capped at 0.5 GiB")),
    # exactly at the cap is not capped
    ((1, 16 * (GIB // PAGE_BYTES), 1.0, 1), (GIB // PAGE_BYTES, "requests x context")),
    ((1, 16 * (GIB // PAGE_BYTES) + 1, 1.0, 1), (GIB // PAGE_BYTES, "capped at 1 GiB")),
]


@pytest.mark.parametrize(("args", "expected"), CPU_CASES)
def test_cpu_pool_is_requests_times_context_capped_per_host(
    args: tuple[int, int, float, int], expected: tuple[int, str]
) -> None:
    requests, context, space, ranks = args
    size = cpu_kv_size(
        max_running_requests=requests,
        context_len=context,
        space_gib=space,
        ranks_on_host=ranks,
        page_size=16,
        page_bytes=PAGE_BYTES,
    )
    pages, reason = expected
    assert (size.pages, size.page_size, size.page_bytes) == (pages, 16, PAGE_BYTES)
    assert size.reason.startswith(reason), size.reason
    assert size.nbytes <= int(space * GIB) // ranks  # never past this rank's share


def test_cpu_ranks_on_one_host_never_pass_the_cap_together() -> None:
    for ranks in (1, 2, 3, 4, 8):
        size = cpu_kv_size(
            max_running_requests=256,
            context_len=163_840,
            space_gib=4.0,
            ranks_on_host=ranks,
            page_size=16,
            page_bytes=PAGE_BYTES,
        )
        assert 4 * GIB - ranks * PAGE_BYTES < ranks * size.nbytes <= 4 * GIB


def test_cpu_budget_without_a_page_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="cpu_kv_cache_space_gib 1e-06 over 2 ranks"):
        cpu_kv_size(
            max_running_requests=1,
            context_len=4096,
            space_gib=1e-6,
            ranks_on_host=2,
            page_size=16,
            page_bytes=PAGE_BYTES,
        )
    with pytest.raises(ValueError, match="expected positive"):
        cpu_kv_size(
            max_running_requests=0,
            context_len=4096,
            space_gib=4.0,
            ranks_on_host=1,
            page_size=16,
            page_bytes=PAGE_BYTES,
        )


def test_explicit_size_is_whole_pages_of_num_kv_tokens() -> None:
    size = explicit_kv_size(1000, 16, PAGE_BYTES)
    assert (size.pages, size.tokens, size.reason) == (63, 1008, "num_kv_tokens 1000")


def test_describe_says_pages_tokens_bytes_and_why() -> None:
    size = KVSize(pages=512, page_size=16, page_bytes=PAGE_BYTES, reason="num_kv_tokens 8192")
    assert size.describe() == (
        "512 pages of 16 tokens = 8192 tokens, 13107200 bytes (0.01 GiB): num_kv_tokens 8192"
    )


def test_cuda_kv_budget_leaves_the_reserves_free() -> None:
    """SGLang's mem_fraction_static: weights + KV take the fraction of the GPU's total; the
    graphs' and the largest step's activations stay outside the pool (two H200s,
    2026-11-28: sized as a fraction of what the weights left free, the prefill pool left
    4.5 GB and the first 16K-token prefill step failed to allocate)."""
    gb = 10**9
    # 150 GB GPU, 110 GB in use (weights, context), 8 GB reserved: 0.85 * 150 - 110 - 8
    assert cuda_kv_budget_bytes(40 * gb, 150 * gb, 0.85, 8 * gb) == int(9.5 * gb)
    assert cuda_kv_budget_bytes(40 * gb, 150 * gb, 0.85, 0) == int(17.5 * gb)
    size = cuda_kv_size(int(9.5 * gb), 0.85, 64, 71_424 * 64)
    assert size.pages == int(9.5 * gb) // (71_424 * 64)
    assert size.reason.startswith("mem_fraction_static 0.85 of the GPU")


def test_cuda_kv_budget_refuses_when_nothing_is_left_naming_the_field() -> None:
    gb = 10**9
    with pytest.raises(ValueError, match="mem_fraction_static 0.7"):
        cuda_kv_budget_bytes(40 * gb, 150 * gb, 0.7, 1 * gb)
