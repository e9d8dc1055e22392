"""The 'triton' MoE backend's wiring: registry, config and CLI, and the CPU fallback (which
runs the torch reference, so an engine built with it decodes exactly as with 'torch')."""

from __future__ import annotations

import pytest
import torch
from moe_util import random_routing
from pydantic import ValidationError

from dsv3serve.cli import build_parser
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.moe import MOE_BACKENDS, create_moe_backend
from dsv3serve.moe.experts import random_experts
from dsv3serve.moe.gate import grouped_topk
from dsv3serve.moe.gate_triton import grouped_topk_fused
from dsv3serve.moe.ref import TorchRefMoE
from dsv3serve.moe.triton_moe import TritonMoE
from dsv3serve.sampling.sampling_params import SamplingParams


def test_registry_names_both_backends() -> None:
    assert MOE_BACKENDS == ("torch", "triton")
    assert isinstance(create_moe_backend("triton", act_quant=False), TritonMoE)
    with pytest.raises(ValueError, match=r"'torch', 'triton'"):
        create_moe_backend("cutlass")


@pytest.mark.parametrize("fp8", [False, True])
def test_cpu_tensors_take_the_reference(fp8: bool) -> None:
    torch.manual_seed(0)
    ex = random_experts(16, 256, 128, fp8, torch.float32, "cpu")
    w, ids = random_routing(5, 16, 4, 4, 2, "cpu")
    x = torch.randn(5, 256)
    y = create_moe_backend("triton").forward(x, w, ids, ex)
    assert torch.equal(y, TorchRefMoE().forward(x, w, ids, ex))


def test_fused_gate_on_cpu_is_the_reference() -> None:
    logits, bias = torch.randn(7, 256), torch.randn(256) * 0.1
    args = (logits, bias, 8, 8, 4, 2.5)
    for got, want in zip(grouped_topk_fused(*args), grouped_topk(*args), strict=True):
        assert torch.equal(got, want)


def test_config_and_cli_accept_triton() -> None:
    assert EngineConfig(model="tiny", moe_backend="triton").moe_backend == "triton"
    with pytest.raises(ValidationError, match="moe_backend"):
        EngineConfig(model="tiny", moe_backend="cutlass")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--moe-backend", "triton"])
    assert EngineConfig.from_args(args).moe_backend == "triton"
    plain = build_parser().parse_args(["generate", "--prompt", "x"])
    assert EngineConfig.from_args(plain).moe_backend == "torch"


def _greedy_tokens(moe_backend: str) -> list[int]:
    cfg = EngineConfig(model="tiny", num_kv_tokens=256, page_size=4, moe_backend=moe_backend)
    engine = Engine(cfg)
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    engine.add_request(Request("r", params, prompt_ids=list(range(100, 120))))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
    return tokens


def test_engine_on_cpu_decodes_the_same_with_either_backend() -> None:
    assert _greedy_tokens("triton") == _greedy_tokens("torch")
