"""The FP8 MLA decode kernel (``mla_decode_fp8``) on a CUDA GPU at DeepSeek-V3's widths (128
heads, latent 512 + rope 64, bf16 q, page size 64) against the float32 oracle
``mla_decode_ref`` on the same NaN-poisoned fp8 pool, for every config the bench times.

Tolerances (``mla_fp8_tolerance``): ``FP8_RTOL`` against the exact oracle, ``P_RTOL``
against the oracle fed q rounded as the kernel rounds it. The measured errors are printed
(``pytest -s``).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from attention_cases import DEEPSEEK_DIMS  # noqa: E402
from mla_decode_cases import fp8_case, rel_err  # noqa: E402
from mla_fp8_tolerance import FP8_RTOL, P_RTOL  # noqa: E402

from dsv3serve.attention.base import MLADims  # noqa: E402
from dsv3serve.attention.flashinfer_backend import CudaGraphLimits  # noqa: E402
from dsv3serve.attention.triton_mla import TritonMLAAttention  # noqa: E402
from dsv3serve.bench.kernels.mla import FP8_CONFIGS  # noqa: E402
from dsv3serve.kernels.mla_decode_fp8 import FP8MLAConfig  # noqa: E402
from dsv3serve.kernels.mla_decode_ref import mla_decode_ref  # noqa: E402

pytestmark = pytest.mark.gpu

DIMS = DEEPSEEK_DIMS
PAGE = 64


def _context_lens(batch_size: int, seed: int) -> list[int]:
    """One token, page edges (63, 64, 65), 4K-ish, and random ones up to 4096."""
    rng = random.Random(seed)
    fixed = [1, 63, 64, 65, 4095, 4096, 1000]
    return (fixed + [rng.randint(2, 4096) for _ in range(batch_size)])[:batch_size]


def _queries(tokens: int, dims: MLADims = DIMS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(tokens, dims.num_heads, dims.kv_cache_dim, generator=gen, device="cuda")
    return q.to(torch.bfloat16).split([dims.kv_lora_rank, dims.qk_rope_head_dim], -1)


def _check(case, attn: TritonMLAAttention, out: torch.Tensor, q: tuple, layer: int) -> None:
    pool, scale = case.pool, attn.dims.softmax_scale
    args = (*q, pool.kv_buffer(layer), pool.scale_buffer(layer), attn.meta)
    exact = mla_decode_ref(*args, scale)
    same_q = mla_decode_ref(*args, scale, quantize_q=True)
    err, err_p = rel_err(out, exact), rel_err(out, same_q)
    print(f"relative error {err:.4f} (float32 oracle), {err_p:.4f} (oracle with e4m3 q)")
    assert err < FP8_RTOL, f"relative error {err:.2e} against the float32 oracle"
    assert err_p < P_RTOL, f"relative error {err_p:.2e} against the oracle with e4m3 q"


def _run(case, cfg: FP8MLAConfig, dims: MLADims = DIMS, layer: int = 1) -> TritonMLAAttention:
    attn = TritonMLAAttention(case.pool, dims, fp8_config=cfg, fp8_kernel="mma")
    attn.plan(case.batch)
    q = _queries(case.batch.num_tokens, dims)
    out = attn.forward_absorbed(*q, layer, dims.softmax_scale)
    assert out.dtype == torch.bfloat16 and attn.fp8_mma
    _check(case, attn, out, q, layer)
    return attn


@pytest.mark.parametrize("cfg", FP8_CONFIGS.values(), ids=FP8_CONFIGS.keys())
@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_decode(batch_size: int, cfg: FP8MLAConfig) -> None:
    cached = [n - 1 for n in _context_lens(batch_size, batch_size)]
    case = fp8_case(DIMS, [1] * batch_size, cached, PAGE, device="cuda", seed=batch_size)
    assert _run(case, cfg).index_mode == "page"


@pytest.mark.parametrize("num_heads", [16, 32, 64])
def test_fewer_heads_per_rank(num_heads: int) -> None:
    """Tensor-parallel shards: 16 / 32 / 64 heads (16 and 32 pad a head block of 64)."""
    dims = replace(DIMS, num_heads=num_heads)
    case = fp8_case(dims, [1] * 8, [0, 63, 64, 700, 2047, 3000, 5, 129], PAGE, device="cuda")
    _run(case, FP8MLAConfig(), dims)


def test_verify_three_tokens_per_sequence() -> None:
    case = fp8_case(DIMS, [3] * 4, [0, 62, 700, 2500], PAGE, device="cuda", decode=True)
    _run(case, FP8MLAConfig())


def test_token_indices_for_unaligned_slots() -> None:
    case = fp8_case(DIMS, [1] * 3, [5, 300, 64], PAGE, device="cuda", aligned=False)
    assert _run(case, FP8MLAConfig()).index_mode == "token"


def test_cuda_graph_replay_follows_a_new_plan() -> None:
    """Captured after planning one batch, replayed after planning another of the same size
    with other contexts and pages: the output is the second batch's attention."""
    first = fp8_case(DIMS, [1] * 4, [10, 100, 1000, 64], PAGE, device="cuda", seed=1)
    second = fp8_case(DIMS, [1] * 4, [3000, 7, 129, 2048], PAGE, device="cuda", seed=2)
    attn = TritonMLAAttention(
        second.pool, DIMS, cuda_graph=CudaGraphLimits(8, 1024), fp8_kernel="mma"
    )
    q = _queries(4)
    attn.plan(first.batch)
    attn.forward_absorbed(*q, 0, DIMS.softmax_scale)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward_absorbed(*q, 0, DIMS.softmax_scale)
    attn.plan(second.batch)
    graph.replay()
    _check(second, attn, out, q, 0)
