"""The FP8 MLA decode kernel (``mla_decode_fp8``) on CPU through Triton's interpreter, against
the float32 oracle ``mla_decode_ref`` on the same NaN-poisoned fp8 pool.

Run with ``TRITON_INTERPRET=1`` set before pytest starts; skipped otherwise. Every value and
fp8 scale no sequence uses is NaN, so a stray read shows. Contexts of 1 token, off page (8)
and tile (32) multiples, one and several KV splits, heads not filling a head block. Softmax
scale 0.33 gives scores of std ~3.2 on these widths, as DeepSeek-V3's does on its own, so
the errors are of the size ``mla_fp8_tolerance`` derives.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from interp_util import INTERPRETING, gpu_like_casts  # noqa: E402

if not INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts", allow_module_level=True)

from mla_decode_cases import fp8_case, rel_err  # noqa: E402
from mla_fp8_tolerance import FP8_RTOL, P_RTOL  # noqa: E402

from dsv3serve.attention.base import MLADims  # noqa: E402
from dsv3serve.attention.triton_mla import TritonMLAAttention  # noqa: E402
from dsv3serve.kernels.mla_decode_fp8 import (  # noqa: E402
    FP8MLAConfig,
    fp8_num_splits,
    quantize_q,
)
from dsv3serve.kernels.mla_decode_ref import mla_decode_ref, quantize_rows_e4m3  # noqa: E402

DIMS = MLADims(20, 64, 16, 32, 16, 0.33)  # 20 heads: a full and a partial head block of 16
SMALL = FP8MLAConfig(block_h=16, block_n=32, max_splits=3, min_split_tokens=32)
CONFIGS = {
    "dv2": SMALL,
    "dv1": FP8MLAConfig(block_h=16, block_n=32, dv_split=1, max_splits=3, min_split_tokens=32),
    "prefetch": FP8MLAConfig(
        block_h=16, block_n=32, dv_split=1, prefetch=True, max_splits=3, min_split_tokens=32
    ),
}


@pytest.fixture(autouse=True)
def _casts(monkeypatch):
    """GPU-like casts, and loop bounds from loaded scalars (see test_mla_decode_interp)."""
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang

    def patch_with_scalar_index(fn):
        scope = patch_lang(fn)
        scope.set_attr(tl.core.tensor, "__index__", _scalar_index)
        return scope

    monkeypatch.setattr(interpreter, "_patch_lang", patch_with_scalar_index)
    with gpu_like_casts():
        yield


def _scalar_index(self) -> int:
    return int(np.asarray(self.handle.data).reshape(-1)[0])


def _queries(tokens: int, dims: MLADims = DIMS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(tokens, dims.num_heads, dims.kv_cache_dim, generator=gen).to(torch.float16)
    return q.split([dims.kv_lora_rank, dims.qk_rope_head_dim], -1)


def _compare(case, cfg: FP8MLAConfig, dims: MLADims = DIMS, **kw) -> TritonMLAAttention:
    """The backend's output against the oracle, exact and with q rounded as the kernel does."""
    attn = TritonMLAAttention(case.pool, dims, fp8_config=cfg, fp8_kernel="mma", **kw)
    attn.plan(case.batch)
    q_nope, q_pe = _queries(case.batch.num_tokens, dims)
    got = attn.forward_absorbed(q_nope, q_pe, 1, dims.softmax_scale)
    args = (q_nope, q_pe, case.pool.kv_buffer(1), case.pool.scale_buffer(1), attn.meta)
    exact = mla_decode_ref(*args, dims.softmax_scale)
    same_q = mla_decode_ref(*args, dims.softmax_scale, quantize_q=True)
    assert got.shape == exact.shape and got.dtype == torch.float16
    err, err_p = rel_err(got, exact), rel_err(got, same_q)
    print(f"relative error: {err:.4f} vs float32, {err_p:.4f} vs float32 with e4m3 q")
    assert err < FP8_RTOL, err
    assert err_p < P_RTOL, err_p
    return attn


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("cached", [[0], [37], [20, 0, 200, 31, 64]], ids=["1tok", "38tok", "bs5"])
def test_decode_matches_the_float32_reference(cfg: FP8MLAConfig, cached: list[int]) -> None:
    case = fp8_case(DIMS, [1] * len(cached), cached, page_size=8)
    attn = _compare(case, cfg)
    assert attn.fp8_mma and attn.index_mode == "page"


@pytest.mark.parametrize("max_splits", [1, 3], ids=["one-split", "three-splits"])
def test_split_counts(max_splits: int) -> None:
    """One split writes the output itself; several go through the log-sum-exp merge."""
    cfg = FP8MLAConfig(block_h=16, block_n=32, max_splits=max_splits, min_split_tokens=32)
    case = fp8_case(DIMS, [1, 1], [95, 40], page_size=16, seed=3)
    attn = _compare(case, cfg)
    assert attn.meta.num_splits == max_splits


def test_verify_is_causal_bottom_right() -> None:
    """Three new tokens per sequence: query j sees the cache up to its own position."""
    case = fp8_case(DIMS, [3, 3], [29, 5], page_size=8, decode=True, seed=4)
    _compare(case, SMALL)


def test_unaligned_slots_use_token_indices() -> None:
    case = fp8_case(DIMS, [1, 1], [30, 11], page_size=8, aligned=False, seed=5)
    attn = _compare(case, SMALL)
    assert attn.index_mode == "token"


def test_rope_narrower_than_the_dot_minimum() -> None:
    """A rope of 16 (the tiny model's) is padded to the FP8 dot's K of 32 with zeros."""
    dims = MLADims(4, 64, 16, 16, 16, 0.4)
    case = fp8_case(dims, [1, 1], [33, 7], page_size=8, seed=6)
    _compare(case, SMALL, dims)


def test_dequant_kernel_stays_selectable() -> None:
    case = fp8_case(DIMS, [1], [10], page_size=8)
    attn = TritonMLAAttention(case.pool, DIMS, fp8_kernel="dequant")
    assert not attn.fp8_mma
    with pytest.raises(ValueError, match="fp8_kernel"):
        TritonMLAAttention(case.pool, DIMS, fp8_kernel="fp4")


def test_quantize_q_rounds_as_the_oracle() -> None:
    q_nope, q_pe = _queries(3)
    q8, qs = quantize_q(q_nope, q_pe)
    got = q8.float() * qs[..., None]
    want = quantize_rows_e4m3(torch.cat([q_nope, q_pe], -1))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_split_heuristic_fills_waves() -> None:
    cfg = FP8MLAConfig()  # 64 heads a block, 2 programs a head block, 2 per SM
    assert [fp8_num_splits(t, 128, cfg, 132) for t in (1, 16, 32, 64, 128)] == [32, 4, 2, 1, 1]
    one = FP8MLAConfig(num_warps=8, dv_split=1, ctas_per_sm=1)
    assert fp8_num_splits(64, 128, one, 132) == 1
