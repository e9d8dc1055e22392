"""The FlashMLA backend on the real kernels (sgl-flash-mla 1.0.0, SM90) against the torch
reference, and the engine through it against flashinfer (CUDA GPU with flash_mla).

DeepSeek-V3's attention shapes (128 heads, latent 512 + rope 64), page size 64, NaN in
every cache slot a batch does not use (rows past a sequence's length in its last page
included), fresh random inputs.

Tolerances:

- bf16: ``BF16_TOL`` (attention_cases): four bf16 rounding steps (2^-8 each). The probe of
  the kernel measured 0.2 % relative L2 error against float32.
- FP8: the kernel reads e4m3 KV and an e4m3 ``q`` (one fixed scale, ``q_scale``: 1 unless
  given, so ``q`` is stored as ``e4m3(clamp(q / q_scale, +-448))``) and computes its
  products on e4m3 operands; the reference reads the same e4m3 KV, dequantised, in float32,
  with the unrounded bf16 ``q``. e4m3 keeps 3 mantissa bits from 2^-6 up: such a value is
  off by at most 2^-4 of itself (round to nearest), 2^-4/sqrt(3) = 3.6 % RMS. The test's
  ``q`` is N(0, 1), stored times ``1 / q_scale`` (1 or 4): its largest stored values (~5.5
  and ~22) stay 20x or more below saturation, and the 1.2 % of values under 2^-6 * q_scale
  (subnormal) are off by at most 2^-10 * q_scale, which the relative L2 norm does not see:
  rounding N(0, 1) to e4m3 with
  unit scale and with a scale from its own maximum both give 2.66 % relative L2 (measured
  on the CPU). So the fixed scale rounds ``q`` as the per-call maximum did (run 1,
  2026-12-06, with that scale: 4.9-5.0 % decode, 3.6 % verify, against the bound below).
  Each score sums 576 such products and each output thousands of weighted
  rows, so the errors average rather than add, and the output's relative L2 error stays
  near one element's RMS rounding (the probe measured 3.4 % on random inputs). Bound:
  relative L2 per layer below ``FP8_REL_L2`` = 2^-4 (6.25 %, one element's worst
  rounding), and no element off by more than a quarter of the output's largest value (a
  wrong page, mask or descale moves elements by the output's own size).
"""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
try:
    import flash_mla
    from flash_mla.flash_mla_interface import FlashMLASchedMeta
except (ImportError, OSError) as err:  # not installed, or its CUDA library does not load
    pytest.skip(f"needs sgl-flash-mla (flash_mla): {err}", allow_module_level=True)
pytest.importorskip("flashinfer")  # the prefill path and the engine comparison

from attention_cases import (  # noqa: E402
    DEEPSEEK_ATTENTION,
    DEEPSEEK_DIMS,
    compare_with_ref,
    make_case,
    run_layers,
)
from attention_e2e import DENSE  # noqa: E402
from engine_margin import make_margin_checkpoint, select_prompts  # noqa: E402

from dsv3serve.attention.base import CudaGraphLimits  # noqa: E402
from dsv3serve.attention.flashmla_backend import FlashMLAAttention  # noqa: E402
from dsv3serve.attention.ref import TorchRefAttention  # noqa: E402
from dsv3serve.bench.engine.greedy_compare import compare  # noqa: E402
from dsv3serve.engine.config import EngineConfig  # noqa: E402
from dsv3serve.engine.engine import Engine  # noqa: E402
from dsv3serve.engine.request import Request  # noqa: E402
from dsv3serve.sampling.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

DIMS, PAGE = DEEPSEEK_DIMS, 64
FP8_REL_L2 = 2.0**-4
FP8_MAX_ABS = 0.25  # of the output's largest value
FP8 = {"dtype": torch.float8_e4m3fn, "fp8_scales": "layer"}


def _context_lens(batch_size: int, seed: int) -> list[int]:
    """Mixed lengths: page edges (63, 64, 65), one token, and random ones up to 3000."""
    rng = random.Random(seed)
    fixed = [1, 63, 64, 65, 1000, 4097]
    return (fixed + [rng.randint(2, 3000) for _ in range(batch_size)])[:batch_size]


@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_decode_bf16(batch_size: int) -> None:
    case = make_case(DIMS, [1] * batch_size, _context_lens(batch_size, 0), "cuda", PAGE)
    compare_with_ref(FlashMLAAttention(case.pool, DIMS), case, DIMS, absorbed=True)


def test_verify_bf16_four_tokens_per_sequence() -> None:
    """The MTP verify shape (k = 3 drafts: s_q = 4), causal within the new tokens."""
    case = make_case(DIMS, [4] * 6, [0, 1, 62, 64, 300, 2049], "cuda", PAGE, decode=True)
    compare_with_ref(FlashMLAAttention(case.pool, DIMS), case, DIMS, absorbed=True)


def test_mixed_new_token_counts_bf16() -> None:
    case = make_case(DIMS, [1, 4, 4, 2, 1], [30, 0, 700, 64, 5], "cuda", PAGE, decode=True)
    compare_with_ref(FlashMLAAttention(case.pool, DIMS), case, DIMS, absorbed=True)


def test_planned_metadata_gives_what_the_kernels_own_schedule_gives() -> None:
    """bf16: the metadata ``plan`` builds once per step against an empty FlashMLASchedMeta,
    which makes the kernel schedule the call itself. (Run 1 failed here with both outputs
    all NaN: the test did not write the new token's latent, so every sequence read its
    NaN-poisoned last row.)"""
    case = make_case(DIMS, [1] * 8, _context_lens(8, 3), "cuda", PAGE)
    attn = FlashMLAAttention(case.pool, DIMS)
    attn.plan(case.batch)
    attn.save_latent(0, case.new_latents)  # else each sequence's last row stays NaN
    q = torch.randn(8, DIMS.num_heads, DIMS.kv_cache_dim, device="cuda").to(torch.bfloat16)
    got = attn.forward_absorbed(q[..., :512], q[..., 512:], 0, DIMS.softmax_scale)
    assert torch.isfinite(got).all(), "non-finite output: a poisoned row was read"
    [launch] = attn._launches
    kv = case.pool.kv_buffer(0).view(-1, PAGE, 1, DIMS.kv_cache_dim)
    own, _ = flash_mla.flash_mla_with_kvcache(
        q.view(8, 1, DIMS.num_heads, -1), kv, launch.block_table, launch.seq_lens, 512,
        FlashMLASchedMeta(), softmax_scale=DIMS.softmax_scale, use_legacy=True,
    )  # fmt: skip
    own = own.reshape_as(got)
    print(f"planned vs the kernel's own schedule: bit-identical {torch.equal(got, own)}")
    torch.testing.assert_close(got, own, rtol=2**-8, atol=2**-8)


def _fp8_errors(case, attn: FlashMLAAttention) -> list[tuple[float, float]]:
    """(relative L2, largest error / largest value) per layer against the reference over
    the same e4m3 pool with the unrounded q."""
    got = run_layers(attn, case, DIMS, absorbed=True)
    ref = TorchRefAttention(case.pool, DIMS.kv_lora_rank)
    want = run_layers(ref, case, DIMS, absorbed=True)
    errors = []
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all(), "non-finite output: a poisoned row was read"
        diff = g.float() - w.float()
        errors.append(
            ((diff.norm() / w.float().norm()).item(), (diff.abs().max() / w.abs().max()).item())
        )
    return errors


@pytest.mark.parametrize(
    ("layer_scale", "q_scale"), [(1.0, 1.0), (1 / 16, 1 / 4)], ids=["unit", "kv-1/16-q-1/4"]
)
@pytest.mark.parametrize(
    ("new", "cached"),
    [([1] * 32, _context_lens(32, 5)), ([4] * 6, [0, 1, 62, 64, 300, 2049])],
    ids=["decode", "verify"],
)
def test_fp8_within_the_e4m3_bound(
    new: list[int], cached: list[int], layer_scale: float, q_scale: float
) -> None:
    """KV scale 1/16 stores x * 16 and q scale 1/4 stores q * 4: N(0, 1) values stay far
    below 448, and a dropped ``descale_k`` or ``descale_q`` (or the two swapped) would be
    several times off."""
    case = make_case(DIMS, new, cached, "cuda", PAGE, decode=True, **FP8, layer_scale=layer_scale)
    errors = _fp8_errors(case, FlashMLAAttention(case.pool, DIMS, q_scale=q_scale))
    print(
        f"fp8 (relative L2, max / max) per layer: {[(round(a, 4), round(b, 4)) for a, b in errors]}"
    )
    for layer, (rel, worst) in enumerate(errors):
        assert rel < FP8_REL_L2, f"layer {layer}: relative L2 error {rel:.4f}"
        assert worst < FP8_MAX_ABS, f"layer {layer}: largest error {worst:.4f} of the largest value"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_graph_replay_follows_a_new_plan(fp8: bool) -> None:
    """Capture the absorbed layer after one plan; plan a new batch of the same size (new
    block table, lengths and metadata in the same buffers), replay, compare with the
    reference on the new batch."""
    kw = FP8 if fp8 else {}
    first = make_case(DIMS, [1] * 4, [10, 700, 64, 129], "cuda", PAGE, seed=1, **kw)
    second = make_case(DIMS, [1] * 4, [1500, 3, 65, 640], "cuda", PAGE, seed=2, **kw)
    pool = second.pool  # both batches address the second pool's pages
    assert first.pool.num_pages <= pool.num_pages
    attn = FlashMLAAttention(pool, DIMS, cuda_graph=CudaGraphLimits(8, 256, 32))
    q = torch.randn(4, DIMS.num_heads, DIMS.kv_cache_dim, device="cuda").to(torch.bfloat16)
    q_latent, q_pe = q.split([DIMS.kv_lora_rank, DIMS.qk_rope_head_dim], -1)
    attn.plan(first.batch)
    attn.forward_absorbed(q_latent, q_pe, 0, DIMS.softmax_scale)  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward_absorbed(q_latent, q_pe, 0, DIMS.softmax_scale)
    attn.plan(second.batch)
    attn.save_latent(0, second.new_latents)
    graph.replay()
    ref = TorchRefAttention(pool, DIMS.kv_lora_rank)
    ref.plan(second.batch)
    want = ref.forward_absorbed(q_latent, q_pe, 0, DIMS.softmax_scale).float()
    scale = want.abs().max().item()
    if not fp8:
        torch.testing.assert_close(out.float(), want, rtol=0.016, atol=0.016 * scale)
        return
    diff = out.float() - want
    assert (diff.norm() / want.norm()).item() < FP8_REL_L2
    assert diff.abs().max().item() < FP8_MAX_ABS * scale


# ---- the engine ------------------------------------------------------------------------
NEW_TOKENS = 6
MIN_MARGIN = 0.25  # prompt selection threshold (logits), as test_gpu_engine_vs_cpu.py
MAX_GAP = 0.25  # nats at positions with the same inputs: rounding; a wrong page moves whole nats


@pytest.fixture(scope="module")
def margin_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """The dense tiny model with DeepSeek-V3's attention shapes, bf16, margin-safe
    (engine_margin.make_margin_checkpoint)."""
    out = tmp_path_factory.mktemp("flashmla_margin")
    ckpt, _ = make_margin_checkpoint(out, fp8=False, overrides=DENSE | DEEPSEEK_ATTENTION)
    return ckpt


def _engine(ckpt, backend: str, **kw) -> Engine:
    return Engine(
        EngineConfig(
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
    )


def _generate(engine: Engine, prompts: list[list[int]]) -> tuple[dict, dict, dict]:
    """Greedy tokens, top-2 log-probabilities and top-1 margins per prompt (one at a time:
    later prompts hit the prefix cache)."""
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    tokens: dict[str, list[int]] = {}
    tops: dict[str, list[dict[int, float]]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"p{i}", params, prompt_ids=ids))
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
                tops.setdefault(out.request_id, []).extend(out.top_logprobs)
    margins = {
        rid: [sorted(t.values(), reverse=True)[0] - sorted(t.values(), reverse=True)[1] for t in ts]
        for rid, ts in tops.items()
    }
    return tokens, tops, margins


def _graph_replays(engine: Engine) -> int:
    spec = getattr(engine, "spec", None)
    if spec is not None and spec.graphs is not None:
        return spec.graphs.verify.replays
    assert engine.runner.graphs is not None
    return engine.runner.graphs.replays


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "nextn-speculative"])
def test_engine_greedy_through_flashmla_equals_flashinfers(margin_ckpt, spec: bool) -> None:
    """bf16, CUDA graphs on (decode; with speculation verify, chain and extend): the
    greedy tokens equal flashinfer's, or part only at a near-tie (the reference's margin
    there within 3x the measured same-input log-probability gap)."""
    kw = {"speculative_algorithm": "NEXTN"} if spec else {}
    ref = _engine(margin_ckpt, "flashinfer", **kw)
    prompts, _ = select_prompts(ref, NEW_TOKENS, MIN_MARGIN)
    want, want_top, want_margin = _generate(ref, prompts)
    engine = _engine(margin_ckpt, "flashmla", **kw)
    assert isinstance(engine.runner.attn, FlashMLAAttention)
    replays = _graph_replays(engine)
    got, got_top, _ = _generate(engine, prompts)
    assert _graph_replays(engine) > replays, "no step replayed a CUDA graph"
    result = compare(got, got_top, want, want_top)
    print(f"flashmla vs flashinfer ({'spec' if spec else 'plain'}): {result}")
    assert result["same_input_logprob_gap"] < MAX_GAP
    for d in result["divergences"]:
        margin = want_margin[d["request"]][d["position"]]
        assert margin <= 3 * result["same_input_logprob_gap"], f"parted at margin {margin}: {d}"


def test_engine_fp8_pool_through_flashmla_runs_graphed(margin_ckpt) -> None:
    """An fp8 pool with one scale per layer, q rounded to e4m3: reported against flashinfer
    bf16, with a loose bound (e4m3 moves log-probabilities by more than bf16 does; a wrong
    page or descale by whole nats)."""
    ref = _engine(margin_ckpt, "flashinfer")
    prompts, _ = select_prompts(ref, NEW_TOKENS, MIN_MARGIN)
    want, want_top, _ = _generate(ref, prompts)
    engine = _engine(margin_ckpt, "flashmla", kv_cache_dtype="fp8_e4m3")
    pool = engine.runner.pool
    assert pool.is_fp8 and pool.fp8_scales == "layer" and pool.scale_buffer(0) is None
    replays = _graph_replays(engine)
    got, got_top, _ = _generate(engine, prompts)
    assert _graph_replays(engine) > replays
    assert [len(t) for t in got.values()] == [NEW_TOKENS] * len(prompts)
    result = compare(got, got_top, want, want_top)
    print(f"flashmla fp8 vs flashinfer bf16: {result}")
    assert result["same_input_logprob_gap"] < 1.0
