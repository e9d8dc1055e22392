"""The decoder layer's fused add + RMSNorm + FP8 quantisation path on a GPU: the tiny FP8
checkpoint's logits with the fused kernel on equal those with it off (the reference ops)
within ``REL_BOUND``, and the fused kernel really runs (two calls per layer per forward).

Bound: both paths quantise the same bf16 values, except where the fused norm's float32
summation order flips a bf16 rounding and then an e4m3 value by one step (<1% of entries,
bounded in tests/kernels/test_norm_quant_interp.py). The tiny model's random weights amplify
such flips: on CPU a handful of them moved its logits by ~13% relative. 0.25 leaves room for
that; a dropped residual moved them by 0.7 (tests/model/test_fused_norm_quant.py, where the
CPU wiring test compares the two paths exactly).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import scattered_slots

import dsv3serve.model.deepseek_v3 as dsv3
from dsv3serve.attention.ref import TorchRefAttention
from dsv3serve.config import ModelConfig
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kvcache.pool import MLAKVPool
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions
from dsv3serve.model.weights import load_checkpoint

pytestmark = pytest.mark.gpu
REL_BOUND = 0.25
PAGE = 4


def _logits(model_dir: Path, fused: bool, prompts: list[list[int]]) -> torch.Tensor:
    cfg = ModelConfig.from_hf(model_dir)
    with torch.device("cuda"):  # as the model runner builds it
        model = DeepseekV3ForCausalLM(cfg, ModelOptions(fuse_norm_quant=fused))
    load_checkpoint(model, model_dir)
    pool = MLAKVPool(model.num_kv_layers, 64, PAGE, cfg.kv_cache_dim, torch.bfloat16, "cuda")
    attn = TorchRefAttention(pool, cfg.kv_lora_rank)
    spans = [SeqSpan(p, 0, scattered_slots(i, len(p))) for i, p in enumerate(prompts)]
    batch = ForwardBatch.build(spans, "cuda")
    batch.logits_indices = torch.arange(batch.num_tokens, device="cuda")
    return model.compute_logits(model(batch, attn)).float()


def test_fused_layer_equals_reference_ops(
    tiny_fp8_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = dsv3.add_rmsnorm_quant

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dsv3, "add_rmsnorm_quant", counting)
    g = torch.Generator().manual_seed(3)
    vocab = ModelConfig.from_hf(tiny_fp8_dir).vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9)]
    off = _logits(tiny_fp8_dir, False, prompts)
    assert not calls, "the fused kernel ran with fuse_norm_quant=False"
    on = _logits(tiny_fp8_dir, True, prompts)
    layers = ModelConfig.from_hf(tiny_fp8_dir).num_hidden_layers
    assert len(calls) == 2 * layers, f"expected {2 * layers} fused calls, got {len(calls)}"
    rel = float((on - off).norm() / off.norm())
    print(f"fused vs reference ops: relative logit difference {rel:.2e}")
    assert rel < REL_BOUND, f"expected relative difference < {REL_BOUND}, got {rel:.3f}"


@pytest.mark.parametrize("fused", [True, False])
def test_other_norms_take_the_one_kernel_form(tiny_bf16_dir: Path, fused: bool) -> None:
    """On CUDA with the switch on, the norms a fused layer does not replace (the final
    norm, the MTP layer's three) run the Triton kernel; with it off, the reference ops. The
    logits above ran through them."""
    cfg = ModelConfig.from_hf(tiny_bf16_dir)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(cfg, ModelOptions(fuse_norm_quant=fused))
    load_checkpoint(model, tiny_bf16_dir)
    nextn = model.nextn
    assert nextn is not None
    outer = (model.norm, nextn.enorm, nextn.hnorm, nextn.shared_head_norm)
    assert [n.fused for n in outer] == [fused] * 4
