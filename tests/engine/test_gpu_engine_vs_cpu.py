"""The GPU engine's greedy tokens equal the CPU reference engine's (CUDA GPU).

Reference: device cpu, float32, torch attention and MoE backends. GPU: bf16, the fast
path (flashinfer attention, Triton MoE, Triton/cuBLAS FP8 GEMMs with activation quant,
decode CUDA graphs). Tiny FP8 checkpoint with DeepSeek-V3's attention shapes, made
margin-safe by ``engine_margin.make_margin_checkpoint``; prompts chosen by the rule in
``engine_margin.select_prompts``: a chunked prefill (300 tokens, chunks of 128), a
prefix-cache hit, a short prompt, a one-token extend over cached pages.
"""

from __future__ import annotations

import pytest
from attention_cases import DEEPSEEK_ATTENTION

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

from engine_margin import (  # noqa: E402
    assert_same_greedy,
    first_step_logits,
    generate,
    make_margin_checkpoint,
    select_prompts,
)

from dsv3serve.engine.config import EngineConfig  # noqa: E402
from dsv3serve.engine.engine import Engine  # noqa: E402

NEW_TOKENS = 6
MIN_MARGIN = 0.25  # selection threshold (logits); the CPU bf16 analogue's error is <= 0.1
MULTIPLE = 3.0  # required margin / measured first-step error


def _engine(ckpt, device: str, **kw) -> Engine:
    return Engine(
        EngineConfig(
            model=str(ckpt),
            device=device,
            page_size=64,
            num_kv_tokens=16 * 1024,
            chunked_prefill_size=128,
            **kw,
        )
    )


def test_gpu_fast_path_greedy_equals_cpu_reference(tmp_path) -> None:
    ckpt, _ = make_margin_checkpoint(tmp_path / "ckpt", fp8=True, overrides=DEEPSEEK_ATTENTION)
    cpu = _engine(ckpt, "cpu", dtype="float32")
    gpu = _engine(
        ckpt, "cuda", dtype="bfloat16", attention_backend="flashinfer", moe_backend="triton"
    )
    assert gpu.runner.graphs is not None  # decode steps replay CUDA graphs
    prompts, want = select_prompts(cpu, NEW_TOKENS, MIN_MARGIN, max_tries=16)
    error = (first_step_logits(gpu, prompts) - first_step_logits(cpu, prompts)).abs().max()
    replays = gpu.runner.graphs.replays
    got = generate(gpu, prompts, NEW_TOKENS)
    assert gpu.runner.graphs.replays > replays
    print(f"min margin {want.min_margin:.3f}, first-step logit error {error.item():.4f}")
    assert_same_greedy(want, got, error.item(), MULTIPLE)
