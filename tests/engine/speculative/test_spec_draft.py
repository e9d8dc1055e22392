"""The NextN draft model: its own weight precision, and a clear error without a NextN layer.

Draft outputs are compared over one prompt run through the draft as an extend, in a
scratch KV pool: unquantising an FP8 draft changes nothing (same values, activation
quantisation off), quantising a BF16 one to FP8 changes outputs only by FP8 rounding.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_utils import load_ours
from spec_util import ScratchModel

from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.engine.speculative.draft_quant import requantize_draft
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

PROMPT = torch.randint(0, 128000, (24,), generator=torch.Generator().manual_seed(7)).tolist()


def draft_outputs(model: DeepseekV3ForCausalLM) -> torch.Tensor:
    """Draft hidden states at every position of PROMPT, from the target's hidden states."""
    scratch = ScratchModel(model, 1, len(PROMPT))
    _, hidden = scratch.target([scratch.span(0, PROMPT[:-1], 0)])
    with torch.inference_mode():
        batch = ForwardBatch.build([scratch.span(0, PROMPT[1:], 0)], "cpu")
        return NextNDraft(model).forward(batch, hidden, scratch.attn)


def fp8_params(module: torch.nn.Module) -> int:
    return sum(p.dtype == torch.float8_e4m3fn for p in module.parameters())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_unquantising_an_fp8_draft_keeps_its_outputs(tiny_fp8_dir: Path) -> None:
    model = load_ours(tiny_fp8_dir, dtype=torch.float32, fp8_act_quant=False)
    before, target_fp8 = draft_outputs(model), fp8_params(model.layers)
    assert fp8_params(model.nextn) > 0
    requantize_draft(model.nextn, "unquant", torch.float32)
    assert fp8_params(model.nextn) == 0 and fp8_params(model.layers) == target_fp8
    assert rel_err(draft_outputs(model), before) < 1e-5


def test_quantising_a_bf16_draft_to_fp8_only_rounds_it(tiny_bf16_dir: Path) -> None:
    model = load_ours(tiny_bf16_dir, dtype=torch.float32, fp8_act_quant=False)
    before = draft_outputs(model)
    requantize_draft(model.nextn, "fp8", torch.float32)
    assert fp8_params(model.nextn) > 0 and fp8_params(model.layers) == 0
    assert model.nextn.eh_proj.weight.dtype == torch.float32  # as in DeepSeek's FP8 files
    assert 1e-4 < rel_err(draft_outputs(model), before) < 0.1


def test_a_checkpoint_without_nextn_is_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="num_nextn_predict_layers=1, got 0"):
        NextNDraft(SimpleNamespace(nextn=None))  # type: ignore[arg-type]
