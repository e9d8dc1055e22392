"""The FlashMLA backend's plumbing on the CPU, with FakeFlashMLACPU standing in for
sgl-flash-mla (whose kernels need an SM90 GPU) and FakeFlashInferCPU for the prefill path:
metadata once per step, the block table and lengths it passes, one call per query length,
fp8 descales, fixed CUDA-graph buffers, config checks and selection. The real kernels are
checked in test_attention_flashmla_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from attention_cases import (
    DEEPSEEK_ATTENTION,
    DEEPSEEK_DIMS,
    compare_with_ref,
    make_case,
    make_pool,
)
from attention_e2e import DENSE, assert_logits_close, step_logits
from fake_flash_mla import decode_calls, install, metadata_calls
from fake_flashinfer import install as install_flashinfer
from model_utils import load_ours

from dsv3serve.attention.base import CudaGraphLimits, MLADims
from dsv3serve.attention.flashmla_backend import FlashMLAAttention
from dsv3serve.attention.ref import TorchRefAttention
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.graph_capture import fork_attention
from dsv3serve.kernels.flashmla_q import pack_q_ref
from dsv3serve.model.tiny import make_tiny_checkpoint

DIMS = DEEPSEEK_DIMS
PAGE = 64
FP8 = {"dtype": torch.float8_e4m3fn, "fp8_scales": "layer"}


@pytest.fixture(autouse=True)
def fake_flash_mla(monkeypatch):
    install_flashinfer(monkeypatch)
    return install(monkeypatch)


def _q(t: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, DIMS.num_heads, DIMS.kv_cache_dim, generator=gen).to(torch.bfloat16)
    q_latent, q_pe = q.split([DIMS.kv_lora_rank, DIMS.qk_rope_head_dim], -1)
    return q_latent, q_pe


def test_decode_matches_the_reference_and_plans_metadata_once(fake_flash_mla) -> None:
    case = make_case(DIMS, [1] * 5, [0, 62, 63, 64, 130], "cpu", PAGE)
    compare_with_ref(FlashMLAAttention(case.pool, DIMS), case, DIMS, absorbed=True)
    [meta] = metadata_calls(fake_flash_mla)  # one plan, two layers
    assert meta["tokens"] == DIMS.num_heads and not meta["fp8"]
    calls = decode_calls(fake_flash_mla)
    assert len(calls) == case.pool.num_layers
    assert calls[0]["q_shape"] == (5, 1, DIMS.num_heads, DIMS.kv_cache_dim)
    assert not calls[0]["causal"] and calls[0]["softmax_scale"] == DIMS.softmax_scale
    assert calls[0]["kv_ptr"] != calls[1]["kv_ptr"]  # each layer reads its own cache


def test_block_table_and_lengths_are_each_sequences_pages() -> None:
    case = make_case(DIMS, [1] * 3, [10, 200, 64], "cpu", PAGE)
    attn = FlashMLAAttention(case.pool, DIMS)
    attn.plan(case.batch)
    [launch] = attn._launches
    lens = [b - a for a, b in zip(case.batch.kv_indptr, case.batch.kv_indptr[1:], strict=False)]
    assert launch.seq_lens.tolist() == lens == [11, 201, 65]
    assert launch.block_table.dtype == torch.int32 and launch.block_table.shape == (3, 4)
    slots = case.batch.kv_slots
    for b, n in enumerate(lens):
        first = slots[case.batch.kv_indptr[b] :: PAGE][: -(-n // PAGE)] // PAGE
        assert launch.block_table[b, : len(first)].tolist() == first.tolist()
    assert attn.index_mode == "page"


def test_verify_is_causal_with_s_q_above_one(fake_flash_mla) -> None:
    case = make_case(DIMS, [4] * 4, [0, 13, 61, 100], "cpu", PAGE, decode=True)
    compare_with_ref(FlashMLAAttention(case.pool, DIMS), case, DIMS, absorbed=True)
    [meta] = metadata_calls(fake_flash_mla)
    assert meta["tokens"] == 4 * DIMS.num_heads
    call = decode_calls(fake_flash_mla)[0]
    assert call["causal"] and call["q_shape"] == (4, 4, DIMS.num_heads, DIMS.kv_cache_dim)


def test_sequences_adding_different_token_counts_run_one_call_per_count(fake_flash_mla) -> None:
    """A verify where one sequence has no drafts, or a forced absorbed prefill."""
    case = make_case(DIMS, [1, 4, 4, 1, 2], [30, 0, 70, 5, 64], "cpu", PAGE, decode=True)
    compare_with_ref(FlashMLAAttention(case.pool, DIMS), case, DIMS, absorbed=True)
    assert [m["tokens"] // DIMS.num_heads for m in metadata_calls(fake_flash_mla)] == [1, 2, 4]
    calls = decode_calls(fake_flash_mla)
    assert [c["q_shape"][:2] for c in calls[:3]] == [(2, 1), (1, 2), (2, 4)]
    assert [c["causal"] for c in calls[:3]] == [False, True, True]


def test_prefill_and_extend_run_flashinfers_path(fake_flash_mla) -> None:
    case = make_case(DIMS, [5, 17, 1], [0, 70, 3], "cpu", PAGE)
    compare_with_ref(FlashMLAAttention(case.pool, DIMS), case, DIMS, absorbed=False)
    assert not fake_flash_mla.calls  # the MHA form never reaches FlashMLA


@pytest.mark.parametrize("q_scale", [1.0, 0.25])
def test_fp8_pool_passes_the_layer_and_query_descales(fake_flash_mla, q_scale: float) -> None:
    """q is packed as e4m3(clamp(q / q_scale, +-448)) with descale_q = q_scale (fixed: the
    same tensor every call), descale_k the layer's scale."""
    case = make_case(
        DIMS, [1, 1, 3], [40, 129, 7], "cpu", PAGE, decode=True, **FP8, layer_scale=0.5
    )
    attn = FlashMLAAttention(case.pool, DIMS, q_scale=q_scale)
    attn.plan(case.batch)
    ref = TorchRefAttention(case.pool, DIMS.kv_lora_rank)
    ref.plan(case.batch)
    for layer in range(case.pool.num_layers):
        attn.save_latent(layer, case.new_latents)
        q_latent, q_pe = _q(case.batch.num_tokens, seed=layer)
        got = attn.forward_absorbed(q_latent, q_pe, layer, DIMS.softmax_scale)
        q8 = pack_q_ref(q_latent, q_pe, torch.float8_e4m3fn, 1 / q_scale)
        deq = q8.float() * q_scale  # the reference sees the kernel's q, in float32
        want = ref.forward_absorbed(deq[..., :512], deq[..., 512:], layer, DIMS.softmax_scale)
        # the fake rounds its output to bf16 once, as the kernel does
        tol = 2**-8 * want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=tol)
    assert all(m["fp8"] for m in metadata_calls(fake_flash_mla))
    for call in decode_calls(fake_flash_mla):
        assert call["fp8"] and call["q_dtype"] == torch.float8_e4m3fn
        assert call["descale_k"].tolist() == [0.5]
        assert call["descale_q"].tolist() == [q_scale]


def test_bf16_pool_gets_the_packed_query_without_descales(fake_flash_mla) -> None:
    case = make_case(DIMS, [1, 1], [3, 64], "cpu", PAGE)
    attn = FlashMLAAttention(case.pool, DIMS)
    attn.plan(case.batch)
    attn.save_latent(0, case.new_latents)
    attn.forward_absorbed(*_q(2), 0, DIMS.softmax_scale)
    [call] = decode_calls(fake_flash_mla)
    assert call["q_dtype"] == torch.bfloat16 and call["descale_q"] is None
    with pytest.raises(ValueError, match="q_scale: expected a positive float, got 0"):
        FlashMLAAttention(case.pool, DIMS, q_scale=0)


def test_graph_buffers_stay_fixed_and_follow_a_new_plan(fake_flash_mla) -> None:
    """A graph replays the buffers it captured: a second plan of the same batch size must
    refill the same table, lengths and metadata (the fake rejects stale metadata)."""
    second = make_case(DIMS, [1] * 4, [150, 3, 65, 64], "cpu", PAGE, seed=2)
    first = make_case(DIMS, [1] * 4, [10, 70, 64, 1], "cpu", PAGE, seed=1)
    attn = FlashMLAAttention(second.pool, DIMS, cuda_graph=CudaGraphLimits(8, 64, 5))
    attn.plan(first.batch)  # first.batch's pages are pages of the larger pool too
    attn.forward_absorbed(*_q(4), 0, DIMS.softmax_scale)
    compare_with_ref(attn, second, DIMS, absorbed=True)
    calls = decode_calls(fake_flash_mla)
    assert len({c["ptrs"] for c in calls}) == 1, "the replanned step moved its buffers"
    assert calls[0]["block_table"].shape == (4, 5)  # the limits' width
    assert calls[-1]["seqlens"].tolist() == [151, 4, 66, 65]


def test_forks_plan_into_buffers_of_their_own_slot(fake_flash_mla) -> None:
    case = make_case(DIMS, [1] * 2, [10, 100], "cpu", PAGE)
    attn = FlashMLAAttention(case.pool, DIMS, cuda_graph=CudaGraphLimits(4, 16, 4))
    verify = fork_attention(attn, "verify")
    attn.plan(case.batch)
    verify.plan(case.batch)
    assert attn._launches[0].block_table.data_ptr() != verify._launches[0].block_table.data_ptr()
    big = make_case(DIMS, [1] * 5, [1] * 5, "cpu", PAGE)  # over max_batch_size: eager tensors
    eager = FlashMLAAttention(big.pool, DIMS, cuda_graph=CudaGraphLimits(4, 16, 4))
    compare_with_ref(eager, big, DIMS, absorbed=True)


def test_pool_and_dims_it_cannot_read_are_refused() -> None:
    with pytest.raises(ValueError, match="found page_size 16, expected 64"):
        FlashMLAAttention(make_pool(DIMS, 2, 16, "cpu"), DIMS)
    token_fp8 = make_pool(DIMS, 2, PAGE, "cpu", dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="per-token scales"):
        FlashMLAAttention(token_fp8, DIMS)
    small = MLADims(4, 64, 16, 16, 16, 0.1)
    with pytest.raises(ValueError, match="kv_lora_rank 64 and qk_rope_head_dim 16"):
        FlashMLAAttention(make_pool(small, 2, PAGE, "cpu"), small)


def test_missing_flash_mla_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "flash_mla", None)
    with pytest.raises(ImportError, match="sgl-flash-mla==1.0.0"):
        FlashMLAAttention(make_pool(DIMS, 2, PAGE, "cpu"), DIMS)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"device": "cuda"}, "found page_size 16, expected 64"),  # the default page size
        ({"device": "cuda", "page_size": 32}, "found page_size 32, expected 64"),
        ({"device": "cpu", "page_size": 64}, "CUDA device"),
        ({"device": "cuda", "page_size": 64, "dtype": "float32"}, "float32"),
    ],
)
def test_engine_config_refuses_what_flashmla_cannot_run(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="tiny", attention_backend="flashmla", **fields)
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    assert EngineConfig(model="tiny", attention_backend="flashmla", device="cuda", page_size=64)
    assert EngineConfig(
        model="tiny", attention_backend="flashmla", device="cuda:0", page_size=64, **fp8
    )


def test_importing_the_backend_and_engine_does_not_import_flash_mla() -> None:
    """flash_mla is imported when a FlashMLA backend is built, never at module load."""
    code = (
        "import sys; import dsv3serve.cli, dsv3serve.engine.model_runner, "
        "dsv3serve.attention.flashmla_backend as m; "
        "from dsv3serve.attention import attention_backend_class as c; "
        "assert c('flashmla', m.torch.bfloat16) is m.FlashMLAAttention; "
        "assert 'flash_mla' not in sys.modules, 'flash_mla imported'"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """The dense tiny model with DeepSeek-V3's latent widths (512 + 64; 16 heads, to keep
    the CPU run short), bf16."""
    heads = {"num_attention_heads": 16, "num_key_value_heads": 16}
    out = tmp_path_factory.mktemp("tiny_flashmla")
    ckpt = make_tiny_checkpoint(
        out, fp8=False, num_shards=1, overrides=DENSE | DEEPSEEK_ATTENTION | heads
    )
    return load_ours(ckpt, dtype=torch.bfloat16, fp8_act_quant=False)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-layer-scales"])
def test_tiny_model_logits_match_the_torch_backend(tiny_model, fp8: bool) -> None:
    """Prefill, extend, decode and verify steps of the model, RoPE written into the cache on
    the way. With an fp8 pool both backends read the same e4m3 cache; FlashMLA also rounds
    q to e4m3 (unit scale: 2^-4 relative per element at worst; the tiny model's q is O(1)),
    which the tiny model's logits amplify, hence the wider bound (measured on the CPU: 4.0 %
    relative L2 at worst, 3.8 % with q_scale 1/64, bf16 1.1 %)."""
    dims = MLADims.from_config(tiny_model.cfg)
    kv = {"kv_dtype": torch.float8_e4m3fn, "fp8_scales": "layer"} if fp8 else {}
    lens, ref = [5, 70], (lambda p: TorchRefAttention(p, dims.kv_lora_rank))
    want = step_logits(tiny_model, ref, lens, PAGE, decode_steps=1, **kv)
    got = step_logits(
        tiny_model, lambda p: FlashMLAAttention(p, dims), lens, PAGE, decode_steps=1, **kv
    )
    assert_logits_close(got, want, rel_tol=0.1 if fp8 else 3e-2)
