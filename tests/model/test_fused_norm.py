"""The one-kernel RMSNorm's wiring, on CPU: every RMSNorm a fused layer does not replace (the
final norm, the MTP layer's enorm / hnorm / shared-head norm, an unfused layer's own) takes
the fused add + norm kernel (:func:`~dsv3serve.kernels.norm_quant.add_rmsnorm_quant_triton`,
no residual, no quantisation) where it applies, switched by ``fuse_norm_quant``, decided once
by ``set_fusions``.

CPU never takes it by itself. With ``norm_kernel_applies`` faked true (a named fake below),
the kernel runs through Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py without a GPU):
- each norm's output is the reference ops' on the same input within the fused norm's bound
  (two bf16 ulps: float32 summation order, tests/support/norm_quant_cases.py);
- the tiny bf16 model's logits stay within ``NORM_LOGIT_BOUND`` of the reference path's. The
  random tiny model amplifies those ulps: 0.021 measured (deterministic: fixed weights and
  prompts); the kernel given eps 1e-2 instead gave 0.126, all-ones weights 0.44.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import load_ours, make_attn, prefill_logits
from norm_quant_cases import NORM_BOUND

import dsv3serve.layers.norm as norm_mod
from dsv3serve.kernels.norm_quant import rms_norm_ref
from dsv3serve.layers.norm import RMSNorm
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

pytest.importorskip("triton")
from interp_util import INTERPRETING  # noqa: E402

NORM_LOGIT_BOUND = 0.06
pytestmark = pytest.mark.usefixtures("one_thread")


def _norms(model: DeepseekV3ForCausalLM) -> list[RMSNorm]:
    return [m for m in model.modules() if isinstance(m, RMSNorm)]


def _fake_applies(weight: torch.Tensor) -> bool:  # fake: the CUDA decision, taken on CPU
    return True


def _each_norm_checked(model: DeepseekV3ForCausalLM) -> list[RMSNorm]:
    """Hooks that compare every fused norm's output with the reference on its input; returns
    the list each checked norm is appended to."""
    checked: list[RMSNorm] = []

    def check(norm: torch.nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
        assert isinstance(norm, RMSNorm)
        if norm.fused and args[0].is_contiguous():
            ref = rms_norm_ref(args[0], norm.weight, norm.eps)
            torch.testing.assert_close(out.float(), ref.float(), rtol=NORM_BOUND, atol=1e-30)
            checked.append(norm)

    for norm in _norms(model):
        norm.register_forward_hook(check)
    return checked


def _logits(model: DeepseekV3ForCausalLM) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 6)]
    return torch.cat(prefill_logits(model, make_attn(model), prompts)).float()


def test_cpu_keeps_the_reference_norms(tiny_bf16_dir: Path) -> None:
    model = load_ours(tiny_bf16_dir, fuse_norm_quant=True)
    assert model.nextn is not None and not any(n.fused for n in _norms(model))


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1 set before pytest starts")
def test_fused_norms_match_the_reference(
    tiny_bf16_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(norm_mod, "norm_kernel_applies", _fake_applies)
    model = load_ours(tiny_bf16_dir, fuse_norm_quant=True)
    nextn = model.nextn
    assert nextn is not None
    outer = [model.norm, nextn.enorm, nextn.hnorm, nextn.shared_head_norm]
    assert all(n.fused for n in _norms(model)) and all(n.fused for n in outer)
    checked = _each_norm_checked(model)
    fused = _logits(model)
    assert model.norm in checked
    model.set_fusions(norm_quant=False)
    assert not any(n.fused for n in _norms(model))
    ref = _logits(model)
    rel = ((fused - ref).norm() / ref.norm()).item()
    print(f"one-kernel norms vs reference ops: relative logit difference {rel:.2e}")
    assert rel < NORM_LOGIT_BOUND, f"expected < {NORM_LOGIT_BOUND}, got {rel:.3f}"
    model.set_fusions(norm_quant=True)
    assert model.norm.fused
