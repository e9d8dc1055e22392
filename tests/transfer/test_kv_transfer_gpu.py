"""KV transfer between two GPUs: torch_dist over NCCL (and gloo, and shm) with CUDA pools.

Skipped without CUDA (conftest) or with fewer than two GPUs. The prefill side's serving
thread is rank 0 and the test thread rank 1, in one process; ``dsv3serve.bench.kv.check_gpu``
(run last) does the same between two processes with real engines.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer import TransferError, create_kv_connector
from kv_transfer.pages import gather_pages

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float32]
LAYERS, PAGES, PAGE_SIZE = 4, 64, 16
POISON = 0xFF  # NaN in every storage dtype


@pytest.fixture(autouse=True)
def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def _fill(pool: MLAKVPool, make) -> MLAKVPool:
    for layer in range(pool.num_layers):
        tensors = [pool.kv_buffer(layer), pool.scale_buffer(layer)]
        for raw in (t.view(torch.uint8) for t in tensors if t is not None):
            raw.copy_(make(raw.shape, raw.device))
    return pool


def random_pool(dtype: torch.dtype, device: str) -> MLAKVPool:
    pool = MLAKVPool(LAYERS, PAGES, PAGE_SIZE, dtype=dtype, device=device)
    return _fill(pool, lambda s, d: torch.randint(0, 256, s, dtype=torch.uint8, device=d))


def poisoned_pool(dtype: torch.dtype, device: str) -> MLAKVPool:
    pool = MLAKVPool(LAYERS, PAGES, PAGE_SIZE, dtype=dtype, device=device)
    return _fill(pool, lambda s, d: torch.full(s, POISON, dtype=torch.uint8, device=d))


def _bytes(pool: MLAKVPool, pages: list[int]) -> torch.Tensor:
    return gather_pages(pool, pages).cpu()


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_dist_cuda0_to_cuda1_bit_exact(dtype: torch.dtype, backend: str) -> None:
    src, dst = random_pool(dtype, "cuda:0"), poisoned_pool(dtype, "cuda:1")
    prefill = create_kv_connector("torch_dist", src, backend=backend, timeout_s=60)
    decode = create_kv_connector("torch_dist", dst, backend=backend, timeout_s=60, chunk_mib=0.1)
    src_pages, dst_pages = [7, 3, 40, 41, 12], [0, 63, 20, 21, 9]
    handle = prefill.publish("g1", src_pages, 70)
    for _ in range(2):  # the second pull reuses the pair and its communicator
        decode.receive(handle, dst_pages)
        assert torch.equal(_bytes(src, src_pages), _bytes(dst, dst_pages))
    others = [p for p in range(PAGES) if p not in dst_pages]
    assert bool((_bytes(dst, others) == POISON).all())
    prefill.release("g1")
    start = time.monotonic()
    with pytest.raises(TransferError, match="not staged"):
        decode.receive(handle, dst_pages)
    assert time.monotonic() - start < 10
    assert prefill.staged() == 0
    decode.close()
    prefill.close()


def test_nccl_peer_gone_raises_within_timeout() -> None:
    """NCCL does not notice a vanished peer by itself: the receive's deadline does."""
    src, dst = random_pool(torch.bfloat16, "cuda:0"), poisoned_pool(torch.bfloat16, "cuda:1")
    prefill = create_kv_connector("torch_dist", src, timeout_s=4, chunk_mib=1)
    decode = create_kv_connector("torch_dist", dst, timeout_s=4, chunk_mib=1)
    handle = prefill.publish("gone", list(range(32)), 500)
    decode.receive(handle, list(range(32, 64)))
    prefill.close()
    start = time.monotonic()
    with pytest.raises(TransferError):
        decode.receive(handle, list(range(32, 64)))
    assert time.monotonic() - start < 4 + 6
    decode.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shm_with_cuda_pools(dtype: torch.dtype) -> None:
    src, dst = random_pool(dtype, "cuda:0"), poisoned_pool(dtype, "cuda:1")
    prefill, decode = create_kv_connector("shm", src), create_kv_connector("shm", dst)
    handle = prefill.publish("s1", [5, 6, 1], 40)
    decode.receive(handle, [2, 9, 30])
    assert torch.equal(_bytes(src, [5, 6, 1]), _bytes(dst, [2, 9, 30]))
    prefill.close()
    decode.close()


def test_check_gpu_script_passes(tmp_path: Path) -> None:
    from dsv3serve.bench.kv.check_gpu import main

    out = tmp_path / "check.json"
    argv = ["--out", str(out), "--num-prompts", "2", "--bw-tokens", "2048", "--bw-iters", "3"]
    assert main(argv) == 0, out.read_text()
