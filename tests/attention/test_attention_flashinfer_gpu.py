"""The flashinfer backend on the real kernels against the torch reference (CUDA GPU).

DeepSeek-V3 head shapes (128 heads, latent 512 + rope 64, MHA 192/128), bf16, page size
64, NaN in every cache slot a batch does not use. Tolerances: see attention_cases.
Three kernels JIT-compile on first use (MLA decode, ragged prefill, merge_state); every
test here reuses them.
"""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer")

from attention_cases import DEEPSEEK_ATTENTION, DEEPSEEK_DIMS, compare_with_ref, make_case  # noqa: E402
from attention_e2e import DENSE, assert_logits_close, step_logits  # noqa: E402

from dsv3serve.attention.base import MLADims  # noqa: E402
from dsv3serve.attention.flashinfer_backend import (  # noqa: E402
    CudaGraphLimits,
    FlashInferMLAAttention,
)
from dsv3serve.attention.ref import TorchRefAttention  # noqa: E402
from dsv3serve.config import ModelConfig  # noqa: E402
from dsv3serve.engine.config import EngineConfig  # noqa: E402
from dsv3serve.engine.engine import Engine  # noqa: E402
from dsv3serve.engine.request import Request  # noqa: E402
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions  # noqa: E402
from dsv3serve.model.tiny import make_tiny_checkpoint  # noqa: E402
from dsv3serve.model.weights import load_checkpoint  # noqa: E402
from dsv3serve.sampling.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

DIMS = DEEPSEEK_DIMS
PAGE = 64


def _context_lens(batch_size: int, seed: int) -> list[int]:
    """Mixed lengths: page edges (63, 64, 65), one token, and random ones up to 3000."""
    rng = random.Random(seed)
    fixed = [1, 63, 64, 65, 1000, 4097]
    return (fixed + [rng.randint(2, 3000) for _ in range(batch_size)])[:batch_size]


@pytest.mark.parametrize("batch_size", [1, 5, 32])
def test_decode(batch_size: int) -> None:
    case = make_case(DIMS, [1] * batch_size, _context_lens(batch_size, 0), "cuda", PAGE)
    attn = FlashInferMLAAttention(case.pool, DIMS)
    compare_with_ref(attn, case, DIMS, absorbed=True)
    assert attn.index_mode == "page"


@pytest.mark.parametrize("aligned", [True, False], ids=["paged-off", "unaligned-slots"])
def test_decode_token_indices(aligned: bool) -> None:
    lens = _context_lens(5, 1)
    case = make_case(DIMS, [1] * 5, lens, "cuda", PAGE, aligned=aligned)
    attn = FlashInferMLAAttention(case.pool, DIMS, paged=not aligned)
    compare_with_ref(attn, case, DIMS, absorbed=True)
    assert attn.index_mode == "token"


def test_verify_three_tokens_per_sequence() -> None:
    case = make_case(DIMS, [3] * 6, [0, 1, 62, 64, 300, 2049], "cuda", PAGE, decode=True)
    compare_with_ref(FlashInferMLAAttention(case.pool, DIMS), case, DIMS, absorbed=True)


def test_prefill_without_prefix() -> None:
    case = make_case(DIMS, [1, 17, 200, 513], [0, 0, 0, 0], "cuda", PAGE)
    compare_with_ref(FlashInferMLAAttention(case.pool, DIMS), case, DIMS, absorbed=False)


@pytest.mark.parametrize("chunk", [8192, 256], ids=["one-chunk", "chunks-of-256"])
def test_extend_with_cached_prefix(chunk: int) -> None:
    """One sequence without a prefix (masked merge), one decode row, long prefixes."""
    case = make_case(DIMS, [50, 1, 100, 64], [0, 300, 64, 1000], "cuda", PAGE)
    attn = FlashInferMLAAttention(case.pool, DIMS, max_prefix_chunk_tokens=chunk)
    compare_with_ref(attn, case, DIMS, absorbed=False)
    assert attn.prefix_chunks == (1 if chunk == 8192 else 6)


def test_cuda_graph_replay_follows_a_new_plan() -> None:
    """Capture the absorbed layer after one plan; replan a new batch of the same size (one
    copy of the index arrays and flashinfer's scheduler alone), replay, and compare with
    the reference on the new batch."""
    first = make_case(DIMS, [1] * 4, [10, 700, 64, 129], "cuda", PAGE, seed=1)
    second = make_case(DIMS, [1] * 4, [1500, 3, 65, 640], "cuda", PAGE, seed=2)
    pool = second.pool  # both batches address the second pool's pages
    assert first.pool.num_pages <= pool.num_pages
    attn = FlashInferMLAAttention(pool, DIMS, cuda_graph=CudaGraphLimits(8, 256))
    q = torch.randn(4, DIMS.num_heads, DIMS.kv_cache_dim, device="cuda").to(torch.bfloat16)
    q_latent, q_pe = q.split([DIMS.kv_lora_rank, DIMS.qk_rope_head_dim], -1)
    attn.plan(first.batch)
    attn.forward_absorbed(q_latent, q_pe, 0, DIMS.softmax_scale)  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward_absorbed(q_latent, q_pe, 0, DIMS.softmax_scale)
    attn.plan(second.batch)
    assert attn.replans == 1  # the second plan of the wrapper reran only the scheduler
    attn.save_latent(0, second.new_latents)
    graph.replay()
    ref = TorchRefAttention(pool, DIMS.kv_lora_rank)
    ref.plan(second.batch)
    want = ref.forward_absorbed(q_latent, q_pe, 0, DIMS.softmax_scale)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(out.float(), want.float(), rtol=0.016, atol=0.016 * scale)


@pytest.fixture(scope="module")
def deepseek_attention_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """The dense tiny model with DeepSeek-V3's attention shapes (bf16)."""
    out = tmp_path_factory.mktemp("tiny_dsattn")
    return make_tiny_checkpoint(out, fp8=False, overrides=DENSE | DEEPSEEK_ATTENTION)


def _load_cuda(ckpt) -> DeepseekV3ForCausalLM:
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(
            ModelConfig.from_hf(ckpt), ModelOptions(dtype=torch.bfloat16, fp8_act_quant=False)
        )
    load_checkpoint(model, ckpt)
    return model


def test_tiny_model_logits_match_the_torch_backend(deepseek_attention_ckpt) -> None:
    model = _load_cuda(deepseek_attention_ckpt)
    dims = MLADims.from_config(model.cfg)
    lens = [7, 90, 200]
    want = step_logits(model, lambda p: TorchRefAttention(p, dims.kv_lora_rank), lens, PAGE)
    got = step_logits(model, lambda p: FlashInferMLAAttention(p, dims), lens, PAGE)
    assert_logits_close(got, want, rel_tol=5e-2)


def _generate(ckpt, backend: str, prompts: list[list[int]], **kw) -> tuple[Engine, list]:
    cfg = EngineConfig(
        model=str(ckpt),
        device="cuda",
        dtype="bfloat16",
        attention_backend=backend,
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
def test_engine_generates_with_flashinfer(deepseek_attention_ckpt, spec: bool) -> None:
    """The engine end to end: chunked prefill, prefix-cache hits, decode (and with
    speculation: draft steps, multi-token verify and draft extend). Greedy tokens of a
    random bf16 model can flip on rounding, so they are reported, not required equal;
    the logits test above is the correctness check."""
    rng = random.Random(0)
    shared = [rng.randrange(2, 120000) for _ in range(256)]
    prompts = [shared + [rng.randrange(2, 120000) for _ in range(n)] for n in (44, 9, 1)]
    kw = {"speculative_algorithm": "NEXTN"} if spec else {}
    engine, tokens = _generate(deepseek_attention_ckpt, "flashinfer", prompts, **kw)
    assert isinstance(engine.runner.attn, FlashInferMLAAttention)
    assert engine.runner.attn.index_mode == "page"
    assert [len(t) for t in tokens] == [8, 8, 8]
    _, reference = _generate(deepseek_attention_ckpt, "torch", prompts, **kw)
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    print(f"flashinfer vs torch greedy completions identical: {same}/{len(prompts)}")
