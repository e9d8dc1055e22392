"""KV transfer tests' pools and connectors: random-byte and poisoned pools compared as
bytes, the connector names (optional ones skip where their package is missing) and the
options that bound their waits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.factory import OPTIONAL, installed
from kv_transfer.pages import gather_pages

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float32": torch.float32,
}
ONE_SIDED = ("nixl", "mooncake")  # optional packages; a lease server guards their READs


def optional_connector(name: str, *values: Any) -> Any:
    """A parametrization of optional connector ``name`` that skips where it is not installed."""
    reason = f"{name} is not installed (optional: pip install {OPTIONAL[name][1]}); CI skips it"
    return pytest.param(name, *values, marks=pytest.mark.skipif(not installed(name), reason=reason))


NAMES = ["shm", "torch_dist", *(optional_connector(name) for name in ONE_SIDED)]
LAYERS, PAGES, PAGE_SIZE = 3, 24, 4
POISON = 0xFF  # NaN in bf16, fp8 e4m3fn and float32 alike
FAST_S = 5.0  # an error must surface well before any timeout_s used here


def options_for(name: str, chunk_mib: float = 0.001) -> dict[str, Any]:
    """torch_dist: a bounded wait, and (by default) one chunk per layer on the wire."""
    if name in ONE_SIDED:
        return {"timeout_s": 10.0}
    return {"timeout_s": 10.0, "chunk_mib": chunk_mib} if name == "torch_dist" else {}


def _fill(pool: MLAKVPool, make: Any) -> None:
    for layer in range(pool.num_layers):
        tensors = [pool.kv_buffer(layer), pool.scale_buffer(layer)]
        for raw in (t.view(torch.uint8) for t in tensors if t is not None):
            raw.copy_(make(raw.shape))


def random_pool(dtype: str, seed: int) -> MLAKVPool:
    """A pool of random raw bytes, the same for the same (dtype, seed) in any process."""
    pool = MLAKVPool(LAYERS, PAGES, PAGE_SIZE, dtype=DTYPES[dtype])
    gen = torch.Generator().manual_seed(seed)
    _fill(pool, lambda shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen))
    return pool


def poisoned_pool(dtype: str) -> MLAKVPool:
    pool = MLAKVPool(LAYERS, PAGES, PAGE_SIZE, dtype=DTYPES[dtype])
    _fill(pool, lambda shape: torch.full(shape, POISON, dtype=torch.uint8))
    return pool


def assert_moved(src: MLAKVPool, src_pages: list[int], dst: MLAKVPool, dst_pages: list[int]):
    assert torch.equal(gather_pages(src, src_pages), gather_pages(dst, dst_pages))


def assert_poisoned(pool: MLAKVPool, except_pages: list[int]) -> None:
    others = [p for p in range(pool.num_pages) if p not in except_pages]
    assert bool((gather_pages(pool, others) == POISON).all()), "a page not named was written"
