"""The Triton MLA decode kernel (bf16 and fp8 pools) on a CUDA GPU against the torch
reference, and the engine serving an fp8 KV cache with ``attention_backend='flashinfer'``.

DeepSeek-V3 head shapes (128 heads, latent 512 + rope 64), bf16 queries, page size 64, NaN
in every value and fp8 scale a batch does not use. Tolerance (``RTOL``, relative L2 norm of
the whole output, and each element within ``ELEM_TOL`` of the output's largest magnitude):
both sides read the same dequantised bf16 rows; the kernel rounds the probabilities to bf16
before the PV product and, with several KV splits, merges float32 partial results, and
both round the output to bf16 once.
"""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

from attention_cases import DEEPSEEK_ATTENTION, DEEPSEEK_DIMS  # noqa: E402
from attention_e2e import DENSE, assert_logits_close, step_logits  # noqa: E402
from mla_decode_cases import fp8_case, rel_err  # noqa: E402

from dsv3serve.attention.base import MLADims  # noqa: E402
from dsv3serve.attention.flashinfer_backend import CudaGraphLimits  # noqa: E402
from dsv3serve.attention.ref import TorchRefAttention  # noqa: E402
from dsv3serve.attention.triton_mla import TritonMLAAttention  # noqa: E402
from dsv3serve.config import ModelConfig  # noqa: E402
from dsv3serve.engine.config import EngineConfig  # noqa: E402
from dsv3serve.engine.engine import Engine  # noqa: E402
from dsv3serve.engine.request import Request  # noqa: E402
from dsv3serve.kvcache.pool import MLAKVPool  # noqa: E402
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions  # noqa: E402
from dsv3serve.model.tiny import make_tiny_checkpoint  # noqa: E402
from dsv3serve.model.weights import load_checkpoint  # noqa: E402
from dsv3serve.sampling.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

DIMS = DEEPSEEK_DIMS
PAGE = 64
RTOL = 1e-2
ELEM_TOL = 0.016
DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
OLD = "dequant"  # these tests hold the bf16-dot kernel; the FP8 one: test_mla_decode_fp8_gpu.py


def _context_lens(batch_size: int, seed: int) -> list[int]:
    """Page edges (63, 64, 65), one token, 4K-ish, and random ones up to 4096."""
    rng = random.Random(seed)
    fixed = [1, 63, 64, 65, 4095, 4096, 1000]
    return (fixed + [rng.randint(2, 4096) for _ in range(batch_size)])[:batch_size]


def _queries(tokens: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tokens, DIMS.num_heads, DIMS.kv_cache_dim, generator=gen, device="cuda")
    return q.to(torch.bfloat16).split([DIMS.kv_lora_rank, DIMS.qk_rope_head_dim], -1)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert rel_err(got, want) < RTOL, f"relative error {rel_err(got, want):.2e}"
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=ELEM_TOL, atol=ELEM_TOL * scale)


def _compare(case, attn: TritonMLAAttention, layer: int = 1) -> None:
    ref = TorchRefAttention(case.pool, DIMS.kv_lora_rank)
    attn.plan(case.batch)
    ref.plan(case.batch)
    q_latent, q_pe = _queries(case.batch.num_tokens)
    got = attn.forward_absorbed(q_latent, q_pe, layer, DIMS.softmax_scale)
    _check(got, ref.forward_absorbed(q_latent, q_pe, layer, DIMS.softmax_scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch_size", [1, 5, 32])
def test_decode(batch_size: int, dtype: torch.dtype) -> None:
    cached = [n - 1 for n in _context_lens(batch_size, batch_size)]
    case = fp8_case(DIMS, [1] * batch_size, cached, PAGE, dtype, "cuda", seed=batch_size)
    attn = TritonMLAAttention(case.pool, DIMS, fp8_kernel=OLD)
    _compare(case, attn)
    assert attn.index_mode == "page"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
def test_verify_three_tokens_per_sequence(dtype: torch.dtype) -> None:
    case = fp8_case(DIMS, [3] * 4, [0, 62, 700, 2500], PAGE, dtype, "cuda", decode=True)
    _compare(case, TritonMLAAttention(case.pool, DIMS, fp8_kernel=OLD))


def test_token_indices_for_unaligned_slots() -> None:
    case = fp8_case(DIMS, [1] * 3, [5, 300, 64], PAGE, device="cuda", aligned=False)
    attn = TritonMLAAttention(case.pool, DIMS, fp8_kernel=OLD)
    _compare(case, attn)
    assert attn.index_mode == "token"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
def test_cuda_graph_replay_follows_a_new_plan(dtype: torch.dtype) -> None:
    """Captured after planning one batch, replayed after planning another of the same size
    with other contexts and pages: the output is the second batch's attention."""
    first = fp8_case(DIMS, [1] * 4, [10, 100, 1000, 64], PAGE, dtype, "cuda", seed=1)
    second = fp8_case(DIMS, [1] * 4, [3000, 7, 129, 2048], PAGE, dtype, "cuda", seed=2)
    attn = TritonMLAAttention(
        second.pool, DIMS, cuda_graph=CudaGraphLimits(8, 1024), fp8_kernel=OLD
    )
    q_latent, q_pe = _queries(4)
    attn.plan(first.batch)
    attn.forward_absorbed(q_latent, q_pe, 0, DIMS.softmax_scale)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward_absorbed(q_latent, q_pe, 0, DIMS.softmax_scale)
    attn.plan(second.batch)
    graph.replay()
    ref = TorchRefAttention(second.pool, DIMS.kv_lora_rank)
    ref.plan(second.batch)
    _check(out, ref.forward_absorbed(q_latent, q_pe, 0, DIMS.softmax_scale))


@pytest.fixture(scope="module")
def deepseek_attention_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """The dense tiny model with DeepSeek-V3's attention shapes (bf16)."""
    out = tmp_path_factory.mktemp("tiny_dsattn_fp8kv")
    return make_tiny_checkpoint(out, fp8=False, overrides=DENSE | DEEPSEEK_ATTENTION)


@pytest.mark.parametrize(
    "fp8_kernel, rel_tol", [("dequant", 5e-2), ("mma", 8e-2)], ids=["dequant", "fp8-mma"]
)
def test_tiny_model_logits_match_the_torch_backend(
    deepseek_attention_ckpt, fp8_kernel: str, rel_tol: float
) -> None:
    """Prefill, extend (flashinfer over dequantised latents), decode and verify (Triton),
    each backend on its own fp8 pool (the FP8 kernel's own error: mla_fp8_tolerance)."""
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(
            ModelConfig.from_hf(deepseek_attention_ckpt),
            ModelOptions(dtype=torch.bfloat16, fp8_act_quant=False),
        )
    load_checkpoint(model, deepseek_attention_ckpt)
    dims = MLADims.from_config(model.cfg)
    lens, kw = [7, 90, 200], {"kv_dtype": torch.float8_e4m3fn}
    want = step_logits(model, lambda p: TorchRefAttention(p, dims.kv_lora_rank), lens, PAGE, **kw)

    def backend(pool: MLAKVPool) -> TritonMLAAttention:
        return TritonMLAAttention(pool, dims, fp8_kernel=fp8_kernel)

    got = step_logits(model, backend, lens, PAGE, **kw)
    assert_logits_close(got, want, rel_tol=rel_tol)


def _generate(ckpt, backend: str, prompts: list[list[int]], **kw) -> tuple[Engine, list]:
    cfg = EngineConfig(
        model=str(ckpt),
        device="cuda",
        dtype="bfloat16",
        attention_backend=backend,
        kv_cache_dtype="fp8_e4m3",
        page_size=PAGE,
        num_kv_tokens=16 * 1024,
        chunked_prefill_size=128,  # the 300-token prompts prefill in 3 chunks (extend)
        fp8_act_quant=False,
        **kw,
    )
    engine = Engine(cfg)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):  # one at a time: later prompts hit the prefix cache
        engine.add_request(Request(f"r{i}", params, prompt_ids=ids))
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
    return engine, [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "nextn-speculative"])
def test_engine_generates_with_an_fp8_cache(deepseek_attention_ckpt, spec: bool) -> None:
    """The engine end to end on an fp8 pool: chunked prefill, prefix-cache hits, decode
    through CUDA graphs (and with speculation: verify graphs). Greedy tokens of a random
    model can flip on rounding, so they are not compared with the torch backend's; the
    logits test above is the correctness check."""
    rng = random.Random(0)
    shared = [rng.randrange(2, 120000) for _ in range(256)]
    prompts = [shared + [rng.randrange(2, 120000) for _ in range(n)] for n in (44, 9, 1)]
    kw = {"speculative_algorithm": "NEXTN"} if spec else {}
    engine, tokens = _generate(deepseek_attention_ckpt, "flashinfer", prompts, **kw)
    assert isinstance(engine.runner.attn, TritonMLAAttention)
    assert engine.runner.attn.index_mode == "page"
    assert engine.runner.graphs is not None
    if spec:
        assert engine.spec.graphs is not None and engine.spec.graphs.verify.replays > 0
    else:
        assert engine.runner.graphs.replays > 0
    assert [len(t) for t in tokens] == [8, 8, 8]
