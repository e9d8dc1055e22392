"""The Triton MLA decode kernel on CPU through Triton's interpreter, against the torch
reference backend (:class:`TorchRefAttention`) reading the same pool.

Run with ``TRITON_INTERPRET=1`` set before pytest starts; skipped otherwise. Pools are
NaN-poisoned (values and fp8 scales) everywhere no sequence has a token, so a stray read
shows. Queries are fp16 (the interpreter cannot multiply bf16 in ``tl.dot``; the kernel takes
the same path for both). Tolerance: a relative error (norm) of ``RTOL``: the reference
computes in float32 from bf16-rounded rows, the kernel dots in fp16 and rounds the
probabilities to fp16 before the PV product.
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

from attention_e2e import DENSE, assert_logits_close, step_logits  # noqa: E402
from mla_decode_cases import fp8_case, rel_err  # noqa: E402
from model_utils import load_ours  # noqa: E402

from dsv3serve.attention.base import MLADims  # noqa: E402
from dsv3serve.attention.flashinfer_backend import CudaGraphLimits  # noqa: E402
from dsv3serve.attention.ref import TorchRefAttention  # noqa: E402
from dsv3serve.attention.triton_mla import TritonMLAAttention  # noqa: E402
from dsv3serve.engine.cuda_graph import DecodeGraphs  # noqa: E402
from dsv3serve.engine.model_runner import kv_slots  # noqa: E402
from dsv3serve.forward_batch import ForwardBatch, SeqSpan  # noqa: E402
from dsv3serve.kernels.mla_decode import MLADecodeConfig  # noqa: E402
from dsv3serve.kvcache.pool import MLAKVPool  # noqa: E402
from dsv3serve.model.tiny import make_tiny_checkpoint  # noqa: E402

DIMS = MLADims(4, 32, 16, 16, 16, 32**-0.5)  # 4 heads, latent 32 + rope 16
RTOL = 1e-2
SMALL = MLADecodeConfig(block_h=16, block_n=16, max_splits=3, min_split_tokens=16)


@pytest.fixture(autouse=True)
def _casts(monkeypatch):
    """GPU-like casts, and loop bounds from loaded scalars: the interpreter holds a scalar
    as a 1-element array, which its ``range`` (``int(array)``) rejects under numpy 2."""
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


def _compare(case, cfg: MLADecodeConfig, layer: int = 1, **kw) -> TritonMLAAttention:
    """The bf16-dot kernel (fp8 pools too: ``fp8_kernel='dequant'``; the FP8 kernel has
    its own tests, test_mla_decode_fp8_interp.py)."""
    attn = TritonMLAAttention(case.pool, DIMS, config=cfg, fp8_kernel="dequant", **kw)
    ref = TorchRefAttention(case.pool, DIMS.kv_lora_rank)
    attn.plan(case.batch)
    ref.plan(case.batch)
    gen = torch.Generator().manual_seed(7)
    t, h = case.batch.num_tokens, DIMS.num_heads
    q = torch.randn(t, h, DIMS.kv_cache_dim, generator=gen).to(torch.float16)
    q_latent, q_pe = q.split([DIMS.kv_lora_rank, DIMS.qk_rope_head_dim], -1)
    got = attn.forward_absorbed(q_latent, q_pe, layer, DIMS.softmax_scale)
    want = ref.forward_absorbed(q_latent, q_pe, layer, DIMS.softmax_scale)
    assert got.shape == want.shape and got.dtype == torch.float16
    assert rel_err(got, want) < RTOL, rel_err(got, want)
    return attn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("cached", [[0], [37], [20, 1, 49, 16, 70]], ids=["bs1-0", "bs1", "bs5"])
def test_decode_matches_the_torch_reference(dtype: torch.dtype, cached: list[int]) -> None:
    """Contexts off page multiples (page 8), several KV splits merged, bs 1 and 5."""
    case = fp8_case(DIMS, [1] * len(cached), cached, page_size=8, dtype=dtype)
    attn = _compare(case, SMALL)
    assert attn.index_mode == "page"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_verify_is_causal_bottom_right(dtype: torch.dtype) -> None:
    """Three new tokens per sequence: query j sees the cache up to its own position."""
    case = fp8_case(DIMS, [3, 3], [29, 5], page_size=8, dtype=dtype, decode=True)
    _compare(case, SMALL)


def test_unaligned_slots_use_token_indices() -> None:
    case = fp8_case(DIMS, [1, 1], [30, 11], page_size=8, aligned=False)
    attn = _compare(case, SMALL)
    assert attn.index_mode == "token"


@pytest.mark.parametrize("splits", [1, 2], ids=["one-split", "two-splits"])
def test_split_counts(splits: int) -> None:
    """One split writes the output directly; many exercise the log-sum-exp merge."""
    cfg = MLADecodeConfig(block_h=16, block_n=16, max_splits=splits, min_split_tokens=1)
    case = fp8_case(DIMS, [1, 1, 1], [63, 2, 40], page_size=16)
    _compare(case, cfg)


def test_graph_buffers_follow_a_new_plan() -> None:
    """With CUDA-graph limits, a plan of the same shape rewrites the same buffers."""
    limits = CudaGraphLimits(max_batch_size=4, max_kv_indices=64)
    first = fp8_case(DIMS, [1, 1], [10, 30], page_size=8, seed=1)
    attn = _compare(first, SMALL, cuda_graph=limits)
    meta = attn.meta
    second = fp8_case(DIMS, [1, 1], [33, 4], page_size=8, seed=2)
    attn.pool = second.pool
    attn.plan(second.batch)
    assert attn.meta.kv_len.data_ptr() == meta.kv_len.data_ptr()
    assert attn.meta.kv_indices.data_ptr() == meta.kv_indices.data_ptr()
    assert attn.meta.kv_len.tolist() == [34, 5]


@pytest.mark.parametrize(
    "fp8_kernel, rel_tol", [("dequant", 3e-2), ("mma", 6e-2)], ids=["dequant", "fp8-mma"]
)
def test_tiny_model_logits_match_the_torch_backend(tmp_path, fp8_kernel: str, rel_tol: float):
    """The dense tiny model (fp16) step by step (prefill, extend, decode, 3-token verify),
    each backend on its own fp8 pool: the same logits to the model's noise floor (the FP8
    kernel's q and P rounding add its error, ``mla_fp8_tolerance``: 3.9% seen at step 3)."""
    ckpt = make_tiny_checkpoint(tmp_path, fp8=False, num_shards=1, overrides=DENSE)
    model = load_ours(ckpt, dtype=torch.float16, fp8_act_quant=False)
    dims = MLADims.from_config(model.cfg)
    lens, kw = [5, 30], {"page_size": 8, "kv_dtype": torch.float8_e4m3fn, "decode_steps": 1}
    want = step_logits(model, lambda pool: TorchRefAttention(pool, dims.kv_lora_rank), lens, **kw)
    got = step_logits(
        model,
        lambda pool: TritonMLAAttention(pool, dims, config=SMALL, fp8_kernel=fp8_kernel),
        lens,
        **kw,
    )
    assert_logits_close(got, want, rel_tol=rel_tol)


@torch.inference_mode()
def test_padded_decode_graph_path_matches_the_torch_backend(tmp_path) -> None:
    """The engine's CUDA-graph decode path run eagerly (``DecodeGraphs(capture=False)``):
    3 sequences given by page tables (as the engine gives them) padded to 4 with a dummy on
    the scratch page, attention planned into the fixed graph buffers; logits as the torch
    backend's on the same fp8 pool."""
    ckpt = make_tiny_checkpoint(tmp_path, fp8=False, num_shards=1, overrides=DENSE)
    model = load_ours(ckpt, dtype=torch.float16, fp8_act_quant=False)
    dims, page = MLADims.from_config(model.cfg), 8
    pool = MLAKVPool(model.num_kv_layers, 12, page, dims.kv_cache_dim, torch.float8_e4m3fn)
    ref = TorchRefAttention(pool, dims.kv_lora_rank)
    tables, lens = [[3, 7, 1], [10], [0, 5, 2, 8]], [17, 6, 30]  # page 11: scratch
    prompts = [
        SeqSpan([5 + i] * n, 0, kv_slots(t, page, n))
        for i, (t, n) in enumerate(zip(tables, lens, strict=True))
    ]
    model(ForwardBatch.build(prompts, "cpu"), ref)  # prefill the cache
    spans = [SeqSpan.from_pages([9], n, t, page) for t, n in zip(tables, lens, strict=True)]
    attn = TritonMLAAttention(pool, dims, config=SMALL, cuda_graph=CudaGraphLimits(4, 48))
    graphs = DecodeGraphs(model, attn, torch.device("cpu"), [1, 4], 11 * page, capture=False)
    got = graphs.run(spans)
    batch = ForwardBatch.build(spans, "cpu")
    assert batch.kv_pages is not None  # a paged batch: KV indices straight from page tables
    want = model.compute_logits(model(batch, ref)).float()
    assert attn.meta.kv_len.shape[0] == 4  # planned the padded batch
    assert attn.index_mode == "page"
    assert_logits_close([got.float()], [want], rel_tol=3e-2)
