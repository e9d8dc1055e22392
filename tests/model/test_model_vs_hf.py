"""Our model against HF transformers' DeepseekV3ForCausalLM (float32, tiny BF16 checkpoint).

The HF model is the correctness anchor: written by others, loaded from the same files.
The tiny checkpoint has random non-zero ``e_score_correction_bias`` and YaRN rope scaling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import greedy_generate, load_ours, make_attn, prefill_logits, scattered_slots

from dsv3serve.forward_batch import ForwardBatch, SeqSpan

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def hf_model(tiny_bf16_dir: Path):
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tiny_bf16_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = [1, 5, 17, 33]
    return [torch.randint(0, 128000, (n,), generator=g).tolist() for n in lengths]


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


def test_bias_really_changes_routing(tiny_bf16_dir: Path) -> None:
    model = load_ours(tiny_bf16_dir, dtype=torch.float32)
    gate = model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.abs().min() > 0
    x = torch.randn(64, model.cfg.hidden_size)
    from dsv3serve.moe.gate import grouped_topk

    logits = x @ gate.weight.t()
    c = model.cfg
    args = (c.num_experts_per_tok, c.n_group, c.topk_group, c.routed_scaling_factor)
    _, biased_ids = grouped_topk(logits, gate.e_score_correction_bias, *args)
    _, plain_ids = grouped_topk(logits, torch.zeros_like(gate.e_score_correction_bias), *args)
    assert not torch.equal(biased_ids.sort(-1).values, plain_ids.sort(-1).values)


@pytest.mark.parametrize("attn_impl", ["mha", "absorb"])
def test_prefill_logits_match_hf(tiny_bf16_dir, hf_model, prompts, attn_impl) -> None:
    model = load_ours(tiny_bf16_dir, dtype=torch.float32, attn_impl=attn_impl)
    ours = prefill_logits(model, make_attn(model), prompts)
    for ids, logits in zip(prompts, ours, strict=True):
        assert rel_err(logits, hf_logits(hf_model, ids)) < REL_TOL


def test_decode_steps_through_absorbed_path_match_hf(tiny_bf16_dir, hf_model, prompts) -> None:
    model = load_ours(tiny_bf16_dir, dtype=torch.float32)  # auto: absorbed MQA for decode
    steps = 6
    outs, logit_log = greedy_generate(model, make_attn(model), prompts, steps)
    for ids, out, step_logits in zip(prompts, outs, logit_log, strict=True):
        with torch.no_grad():
            hf_out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps
            )[0, len(ids) :].tolist()
        assert out == hf_out
        full = hf_logits(hf_model, ids + out)
        for k, logits in enumerate(step_logits):
            assert rel_err(logits, full[len(ids) - 1 + k]) < REL_TOL


def test_mha_and_absorbed_forms_agree_on_extend_over_cached_prefix(tiny_bf16_dir) -> None:
    """Second chunk of a prompt attends to a cached prefix; both MLA forms agree."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128000, (29,), generator=g).tolist()
    results = []
    for impl in ("mha", "absorb"):
        model = load_ours(tiny_bf16_dir, dtype=torch.float32, attn_impl=impl)
        attn = make_attn(model)
        slots = scattered_slots(0, len(ids))
        model(ForwardBatch.build([SeqSpan(ids[:11], 0, slots[:11], False)], "cpu"), attn)
        batch = ForwardBatch.build([SeqSpan(ids[11:], 11, slots)], "cpu")
        batch.logits_indices = torch.arange(batch.num_tokens)
        results.append(model.compute_logits(model(batch, attn)))
    assert rel_err(results[1], results[0]) < REL_TOL
