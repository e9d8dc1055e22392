"""The flashinfer backend's planning, indexing and merging on the CPU, against the torch
reference, with FakeFlashInferCPU standing in for flashinfer (which needs a GPU; the GPU
tests in test_attention_flashinfer_gpu.py run the same cases on the real kernels)."""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    DEEPSEEK_DIMS,
    SMALL_DIMS,
    compare_with_ref,
    make_case,
    make_pool,
    run_layers,
)
from attention_e2e import DENSE, assert_logits_close, step_logits
from fake_flashinfer import install
from model_utils import load_ours

from dsv3serve.attention import create_attention_backend
from dsv3serve.attention.base import MLADims
from dsv3serve.attention.flashinfer_backend import CudaGraphLimits, FlashInferMLAAttention
from dsv3serve.attention.ref import TorchRefAttention
from dsv3serve.engine.config import EngineConfig
from dsv3serve.kvcache.pool import MLAKVPool
from dsv3serve.model.tiny import make_tiny_checkpoint

DIMS = [SMALL_DIMS, DEEPSEEK_DIMS]
DIM_IDS = ["small", "deepseek"]


@pytest.fixture(autouse=True)
def fake_flashinfer(monkeypatch):
    return install(monkeypatch)


def backend(case, dims: MLADims, **kw) -> FlashInferMLAAttention:
    return FlashInferMLAAttention(case.pool, dims, **kw)


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_decode_paged(dims: MLADims) -> None:
    case = make_case(dims, [1] * 5, [1, 63, 64, 65, 130], "cpu", page_size=16)
    attn = backend(case, dims)
    compare_with_ref(attn, case, dims, absorbed=True)
    assert attn.index_mode == "page"


def test_decode_falls_back_to_token_indices_for_unaligned_slots() -> None:
    case = make_case(SMALL_DIMS, [1] * 3, [5, 40, 17], "cpu", page_size=16, aligned=False)
    attn = backend(case, SMALL_DIMS)
    compare_with_ref(attn, case, SMALL_DIMS, absorbed=True)
    assert attn.index_mode == "token"


def test_decode_token_indices_when_asked() -> None:
    case = make_case(SMALL_DIMS, [1] * 3, [5, 40, 17], "cpu", page_size=16)
    attn = backend(case, SMALL_DIMS, paged=False)
    compare_with_ref(attn, case, SMALL_DIMS, absorbed=True)
    assert attn.index_mode == "token"


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_verify_three_tokens_per_sequence_is_causal(dims: MLADims) -> None:
    case = make_case(dims, [3] * 4, [0, 13, 16, 40], "cpu", page_size=16, decode=True)
    compare_with_ref(backend(case, dims), case, dims, absorbed=True)


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_prefill_without_prefix(dims: MLADims) -> None:
    case = make_case(dims, [1, 17, 40], [0, 0, 0], "cpu", page_size=16)
    attn = backend(case, dims)
    compare_with_ref(attn, case, dims, absorbed=False)
    assert attn.prefix_chunks == 0


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("chunk", [10_000, 7], ids=["one-chunk", "chunks-of-7"])
def test_extend_with_cached_prefix(dims: MLADims, chunk: int) -> None:
    """Some sequences have a prefix, one does not (masked merge), a decode row rides along."""
    case = make_case(dims, [5, 1, 12, 3], [0, 20, 9, 33], "cpu", page_size=16)
    attn = backend(case, dims, max_prefix_chunk_tokens=chunk)
    compare_with_ref(attn, case, dims, absorbed=False)
    assert attn.prefix_chunks == (1 if chunk > 100 else 9)


def test_extend_where_every_sequence_has_a_prefix() -> None:
    case = make_case(SMALL_DIMS, [4, 2], [16, 5], "cpu", page_size=16)
    compare_with_ref(backend(case, SMALL_DIMS), case, SMALL_DIMS, absorbed=False)


def test_forced_forms_are_planned_on_first_use() -> None:
    """attn_impl 'absorb' on a prefill batch and 'mha' on a decode batch."""
    prefill = make_case(SMALL_DIMS, [6, 3], [4, 0], "cpu", page_size=16)
    compare_with_ref(backend(prefill, SMALL_DIMS), prefill, SMALL_DIMS, absorbed=True)
    decode = make_case(SMALL_DIMS, [1, 1], [4, 30], "cpu", page_size=16)
    compare_with_ref(backend(decode, SMALL_DIMS), decode, SMALL_DIMS, absorbed=False)


def test_cuda_graph_wrappers_follow_replans_of_one_batch_size() -> None:
    first = make_case(SMALL_DIMS, [1] * 3, [5, 40, 17], "cpu", page_size=16, seed=1)
    attn = backend(first, SMALL_DIMS, cuda_graph=CudaGraphLimits(4, 64))
    compare_with_ref(attn, first, SMALL_DIMS, absorbed=True)
    wrapper = attn._mla_run[0]
    second = make_case(SMALL_DIMS, [1] * 3, [33, 2, 60], "cpu", page_size=16, seed=2)
    attn.pool = second.pool
    attn._views = {s: attn._latent_views(s) for s in attn._views}
    compare_with_ref(attn, second, SMALL_DIMS, absorbed=True)
    assert attn._mla_run[0] is wrapper


def test_cuda_graph_buffers_too_small_is_an_error() -> None:
    case = make_case(SMALL_DIMS, [1] * 2, [100, 100], "cpu", page_size=16)
    attn = backend(case, SMALL_DIMS, cuda_graph=CudaGraphLimits(4, 8))
    with pytest.raises(ValueError, match="max_kv_indices"):
        attn.plan(case.batch)


def test_fp8_pool_is_not_supported() -> None:
    pool = MLAKVPool(2, 4, 16, SMALL_DIMS.kv_cache_dim, torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="fp8"):
        FlashInferMLAAttention(pool, SMALL_DIMS)


def test_wrong_scale_is_an_error() -> None:
    case = make_case(SMALL_DIMS, [1], [4], "cpu", page_size=16)
    attn = backend(case, SMALL_DIMS)
    attn.plan(case.batch)
    q = torch.zeros(1, SMALL_DIMS.num_heads, SMALL_DIMS.kv_lora_rank, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="softmax scale"):
        attn.forward_absorbed(q, q[..., :16], 0, 0.5)


def test_factory_needs_cuda_and_dims() -> None:
    pool = make_pool(SMALL_DIMS, 4, 16, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        create_attention_backend("flashinfer", pool, SMALL_DIMS.kv_lora_rank, SMALL_DIMS)
    with pytest.raises(ValueError, match="MLADims"):
        create_attention_backend("flashinfer", pool, SMALL_DIMS.kv_lora_rank)


def test_missing_flashinfer_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", None)
    pool = make_pool(SMALL_DIMS, 4, 16, "cpu")
    with pytest.raises(ImportError, match="flashinfer-python==0.6.18.post1"):
        FlashInferMLAAttention(pool, SMALL_DIMS)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"device": "cpu"}, "CUDA device"),
        ({"device": "cuda", "dtype": "float32"}, "float32"),
    ],
)
def test_engine_config_rejects_what_flashinfer_cannot_run(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="tiny", attention_backend="flashinfer", **fields)
    assert EngineConfig(model="tiny", attention_backend="flashinfer", device="cuda:0")
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}  # served by the Triton decode kernel
    assert EngineConfig(model="tiny", attention_backend="flashinfer", device="cuda", **fp8)


def test_tiny_model_logits_match_the_torch_backend(tmp_path) -> None:
    """Prefill, extend, decode and verify steps of the dense tiny model (bf16, CPU)."""
    ckpt = make_tiny_checkpoint(tmp_path, fp8=False, num_shards=1, overrides=DENSE)
    model = load_ours(ckpt, dtype=torch.bfloat16, fp8_act_quant=False)
    dims = MLADims.from_config(model.cfg)
    lens = [5, 23, 40]
    want = step_logits(model, lambda pool: TorchRefAttention(pool, dims.kv_lora_rank), lens, 4)
    got = step_logits(model, lambda pool: FlashInferMLAAttention(pool, dims), lens, 4)
    assert_logits_close(got, want, rel_tol=3e-2)


def _attend_planned(attn: FlashInferMLAAttention, case, seed: int = 2) -> list[torch.Tensor]:
    """``run_layers`` without its ``plan``: what a replay of an earlier plan computes."""
    gen = torch.Generator().manual_seed(seed)
    t, h, outs = case.batch.num_tokens, SMALL_DIMS.num_heads, []
    for layer in range(case.pool.num_layers):
        attn.save_latent(layer, case.new_latents)
        q = torch.randn(t, h, SMALL_DIMS.kv_cache_dim, generator=gen).to(torch.bfloat16)
        q_latent, q_pe = q.split([SMALL_DIMS.kv_lora_rank, SMALL_DIMS.qk_rope_head_dim], -1)
        outs.append(attn.forward_absorbed(q_latent, q_pe, layer, SMALL_DIMS.softmax_scale))
    return outs


def test_forks_in_other_graph_slots_keep_their_plans() -> None:
    """Two layouts of one batch size planned one after the other (as the chained draft
    steps of one CUDA graph are): each fork runs its own plan, not the last one."""
    from dsv3serve.engine.graph_capture import fork_attention

    first = make_case(SMALL_DIMS, [1] * 3, [5, 40, 17], "cpu", page_size=16, seed=1)
    second = make_case(SMALL_DIMS, [1] * 3, [33, 2, 60], "cpu", page_size=16, seed=2)
    attn = backend(first, SMALL_DIMS, cuda_graph=CudaGraphLimits(4, 64))
    other = fork_attention(attn, "draft0")
    other.pool = second.pool
    other._views = {s: other._latent_views(s) for s in other._views}
    want = [
        run_layers(TorchRefAttention(c.pool, SMALL_DIMS.kv_lora_rank), c, SMALL_DIMS, True)
        for c in (first, second)
    ]
    attn.plan(first.batch)
    other.plan(second.batch)  # its own slot: leaves the first plan's buffers alone
    assert attn._mla_run[0] is not other._mla_run[0]
    for fork, case, ref in zip((attn, other), (first, second), want, strict=True):
        for got, w in zip(_attend_planned(fork, case), ref, strict=True):
            scale = w.float().abs().max().item()
            torch.testing.assert_close(got.float(), w.float(), rtol=0.02, atol=0.02 * scale)
