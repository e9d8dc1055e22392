"""Shared-expert fusion on CPU: routing append, weight tying, the backends' fused call against
routed + separate shared MLP, the model's logits with fusion on vs off, config and CLI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from model_utils import load_ours, make_attn, prefill_logits
from moe_util import random_routing

from dsv3serve.bench.kernels.moe import fusion_max_tokens as bench_fusion_max_tokens
from dsv3serve.bench.model.roofline import mlp_decode_bytes
from dsv3serve.cli import build_parser
from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.layers.linear import Linear
from dsv3serve.model.deepseek_v3 import ModelOptions, MoE
from dsv3serve.model.weights import fill_randn_
from dsv3serve.moe import create_moe_backend
from dsv3serve.moe.experts import random_experts
from dsv3serve.moe.shared import NEVER, append_shared_expert, fusion_max_tokens
from dsv3serve.moe.shared import tie_shared_expert as tie

E, H, INTER, K = 16, 256, 128, 4


def test_append_gives_every_token_the_shared_slot_with_weight_one() -> None:
    w, ids = random_routing(5, E, K, 4, 2, "cpu")
    w2, ids2 = append_shared_expert(w, ids, E)
    assert w2.shape == ids2.shape == (5, K + 1) and ids2.dtype == ids.dtype
    assert torch.equal(w2[:, :K], w) and torch.equal(ids2[:, :K], ids)
    assert bool((w2[:, K] == 1.0).all()) and bool((ids2[:, K] == E).all())
    # the router scaled the routed weights by 2.5 (they sum to 2.5), not the shared one
    torch.testing.assert_close(w.sum(1), torch.full((5,), 2.5))


def _linears(fp8: bool, dtype: torch.dtype) -> list[Linear]:
    """Shared-expert gate, up, down linears with random values (independent of any stack)."""
    parts = [
        Linear(H, INTER, fp8, dtype),
        Linear(H, INTER, fp8, dtype),
        Linear(INTER, H, fp8, dtype),
    ]
    for lin in parts:
        lin.weight.data = torch.randn(lin.weight.shape).clamp(-448, 448).to(lin.weight.dtype)
        if lin.weight_scale_inv is not None:
            lin.weight_scale_inv.data.uniform_(0.01, 0.03)
        elif not fp8:
            lin.weight.data.mul_(0.02)
    return parts


def _shared_mlp(parts: list[Linear], x: torch.Tensor) -> torch.Tensor:
    gate, up, down = parts
    return down(torch.nn.functional.silu(gate(x)) * up(x))


def _tie(ex, parts: list[Linear]) -> None:
    scales = [p.weight_scale_inv for p in parts if p.weight_scale_inv is not None]
    tie(ex, [p.weight for p in parts], scales)


@pytest.mark.parametrize("fp8", [False, True])
def test_tie_moves_the_shared_weights_into_slot_e(fp8: bool) -> None:
    torch.manual_seed(1)
    ex = random_experts(E, H, INTER, fp8, torch.float32, "cpu", shared_slots=1)
    parts = _linears(fp8, torch.float32)
    before = [p.weight.data.clone() for p in parts]
    _tie(ex, parts)
    assert parts[0].weight.data_ptr() == ex.w13[E].data_ptr()
    assert parts[2].weight.data_ptr() == ex.w2[E].data_ptr()
    for p, b in zip(parts, before, strict=True):
        assert torch.equal(p.weight.data.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(ex.w13[E, INTER:].view(torch.uint8), before[1].view(torch.uint8))
    if fp8:
        assert parts[1].weight_scale_inv.data_ptr() == ex.w13_scale_inv[E, 1:].data_ptr()
    _tie(ex, parts)  # tying again (after a reload) keeps the views
    assert parts[0].weight.data_ptr() == ex.w13[E].data_ptr()


def test_tie_rejects_a_stack_without_a_slot() -> None:
    ex = random_experts(E, H, INTER, False, torch.float32, "cpu")
    with pytest.raises(ValueError, match="shared slot"):
        _tie(ex, _linears(False, torch.float32))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_call_equals_routed_plus_separate_shared(backend: str, fp8: bool) -> None:
    torch.manual_seed(2)
    ex = random_experts(E, H, INTER, fp8, torch.float32, "cpu", shared_slots=1)
    parts = _linears(fp8, torch.float32)
    x = torch.randn(7, H)
    w, ids = random_routing(7, E, K, 4, 2, "cpu")
    moe = create_moe_backend(backend)
    want = moe.forward(x, w, ids, ex) + _shared_mlp(parts, x)  # before tying: separate tensors
    _tie(ex, parts)
    got = moe.forward(x, *append_shared_expert(w, ids, E), ex, with_shared=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fusion_policy() -> None:
    ex = random_experts(E, H, INTER, True, torch.float32, "cpu", shared_slots=1)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert fusion_max_tokens("on", "torch", ex, cpu) > 1 << 30
    assert fusion_max_tokens("off", "triton", ex, cuda) == NEVER
    assert fusion_max_tokens("auto", "torch", ex, cuda) == NEVER  # measured for Triton only
    assert fusion_max_tokens("auto", "triton", ex, cpu) == NEVER


def _tiny_cfg(tiny_dir: Path, **changes: object) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_hf(tiny_dir), **changes)


def test_layer_slots_by_mode(tiny_fp8_dir: Path) -> None:
    cfg = _tiny_cfg(tiny_fp8_dir)
    slots = {
        (mode, be): MoE(cfg, "m", ModelOptions(torch.float32, shared_experts_fusion=mode,
                                               moe_backend=be)).experts.shared_slots
        for mode in ("auto", "on", "off")
        for be in ("torch", "triton")
    }  # fmt: skip
    assert slots == {
        ("auto", "torch"): 0, ("auto", "triton"): 1, ("on", "torch"): 1, ("on", "triton"): 1,
        ("off", "torch"): 0, ("off", "triton"): 0,
    }  # fmt: skip
    wide = _tiny_cfg(tiny_fp8_dir, n_shared_experts=2)
    with pytest.raises(ValueError, match="n_shared_experts 1"):
        MoE(wide, "m", ModelOptions(torch.float32, shared_experts_fusion="on"))
    assert (
        MoE(wide, "m", ModelOptions(torch.float32, moe_backend="triton")).experts.shared_slots == 0
    )


@pytest.mark.parametrize("fixture", ["tiny_bf16_dir", "tiny_fp8_dir"])
def test_model_logits_fusion_on_vs_off(fixture: str, request: pytest.FixtureRequest) -> None:
    tiny_dir = request.getfixturevalue(fixture)
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 1]]
    logits = {}
    for mode in ("off", "on"):
        model = load_ours(tiny_dir, dtype=torch.float32, shared_experts_fusion=mode)
        logits[mode] = prefill_logits(model, make_attn(model), prompts)
        if mode == "on":
            moe = next(m for m in model.modules() if isinstance(m, MoE))
            assert moe.fuses_shared(torch.zeros(3, 1)) and moe.experts.shared_slots == 1
            # the checkpoint's shared expert landed in slot E, which its linears now view
            w = moe.shared_experts.down_proj.weight
            assert w.data_ptr() == moe.experts.w2[moe.cfg.n_routed_experts].data_ptr()
    for off, on in zip(logits["off"], logits["on"], strict=True):
        torch.testing.assert_close(on, off, rtol=1e-4, atol=1e-4)


def test_engine_config_and_cli_flag() -> None:
    assert EngineConfig(model="tiny").shared_experts_fusion == "auto"
    args = build_parser().parse_args(["generate", "--prompt", "x", "--shared-experts-fusion", "on"])
    assert EngineConfig.from_args(args).shared_experts_fusion == "on"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--shared-experts-fusion", "yes"])


def _moe_pair(cfg: ModelConfig, dtype: torch.dtype, backend: str) -> tuple[MoE, MoE]:
    """Two MoE layers with the same random weights: shared expert separate, and fused."""
    off, on = (
        MoE(cfg, "m", ModelOptions(dtype, moe_backend=backend, shared_experts_fusion=mode))
        for mode in ("off", "on")
    )
    g = torch.Generator(device=next(off.parameters()).device).manual_seed(0)
    on_params = dict(on.named_parameters())
    for name, p in off.named_parameters():
        if name.endswith("scale_inv"):
            p.data.uniform_(0.01, 0.03, generator=g)
        else:
            fill_randn_(p.data, g, 1.0 if p.dtype == FP8_DTYPE else 0.05)
        on_params[name].data[: p.shape[0]].copy_(p.data)  # experts: the routed slots
    return off, on


@pytest.mark.parametrize(
    ("device", "backend", "dtype"),
    [
        ("cpu", "torch", torch.float32),
        pytest.param("cuda", "triton", torch.bfloat16, marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("t", [1, 37])
def test_moe_layer_fused_equals_separate(
    tiny_fp8_dir: Path, device: str, backend: str, dtype: torch.dtype, t: int
) -> None:
    """The model's MoE layer (router included; on CUDA the Triton gate and fused MoE)."""
    with torch.device(device):
        off, on = _moe_pair(_tiny_cfg(tiny_fp8_dir), dtype, backend)
        x = torch.randn(t, off.cfg.hidden_size, dtype=dtype)
    assert on.fuses_shared(x) and not off.fuses_shared(x)
    want, got = off(x), on(x)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


def test_bench_threshold_is_the_last_win_of_the_first_run() -> None:
    rows = [{"T": t, "speedup": s} for t, s in [(32, 1.1), (1, 1.5), (128, 0.9), (512, 1.2)]]
    assert bench_fusion_max_tokens(rows) == 32
    assert bench_fusion_max_tokens([{"T": 1, "speedup": 0.95}]) == -1


def test_roofline_bytes_do_not_change_with_fusion(tiny_fp8_dir: Path) -> None:
    """The shared expert's views into the stack are counted once, as its own weights."""
    cfg = _tiny_cfg(tiny_fp8_dir)
    off, on = _moe_pair(cfg, torch.float32, "torch")
    assert on.experts.shared_slots == 1
    for t in (1, 64):
        assert mlp_decode_bytes(on, t) == pytest.approx(mlp_decode_bytes(off, t), rel=1e-9)
