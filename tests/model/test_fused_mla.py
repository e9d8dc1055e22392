"""The MLA fusions' wiring, on CPU: the q/kv norms of the down-projection in one op
(:func:`qkv_a_rmsnorm`) and RoPE inside the KV-cache write
(:meth:`AttentionBackend.save_latent_roped`).

The switch: read from the environment through Settings, honoured by the model options, decided
once per layer after loading, and never taken on CPU by itself. The wiring: with the layers
forced onto the fused path on CPU (``mla_kernels_apply`` faked true; for the FP8 model also
``takes_quantized``, with the quantised GEMM faked by its dequantise-then-matmul reference:
named fakes below), the tiny models' logits

- with the fused ops' torch references (what they run on CPU) equal the reference path's:
  the same arithmetic, so any difference is a wiring fault (a wrong norm weight, the rope key
  rotated twice or not at all, q read unquantised);
- with the Triton kernels through the interpreter stay within ``INTERP_BOUND`` of it, the
  reference path's activation quantisation then taking its scale as CUDA's torch and our
  kernels do (``amax * fl32(1/448)``, :func:`_quant_gpu_like`; the CPU reference divides,
  which flips a few e4m3 values by one step, and the tiny random model amplifies a handful
  of such flips to ~10% of its logits). What is left is the norms' float32 summation order
  (a bf16 ulp here and there); a cache key left unrotated moved the logits by 0.31-0.34.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_utils import load_ours, make_attn, prefill_logits

import dsv3serve.attention.base as attn_base
import dsv3serve.kernels.fp8_ref as fp8_ref
import dsv3serve.layers.linear as linear_mod
import dsv3serve.model.deepseek_v3 as dsv3
from dsv3serve.attention.ref import TorchRefAttention
from dsv3serve.kernels.fp8_ref import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    dequant_per_token_group,
    dequant_weight_block,
)
from dsv3serve.kernels.mla_norm import qkv_a_rmsnorm
from dsv3serve.kernels.rope_kv import rope_kv_write
from dsv3serve.kvcache.pool import MLAKVPool
from dsv3serve.model.deepseek_v3 import MLAttention, ModelOptions
from dsv3serve.settings import FUSED_MLA_ENV, Settings

INTERP_BOUND = 0.02
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False)])
def test_env_switch(value: str | None, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {} if value is None else {FUSED_MLA_ENV: value}
    assert Settings.from_env(env).fused_mla is on
    if value is None:
        monkeypatch.delenv(FUSED_MLA_ENV, raising=False)
    else:
        monkeypatch.setenv(FUSED_MLA_ENV, value)
    assert ModelOptions().fuse_mla is on


def test_cpu_keeps_reference_path(tiny_fp8_dir: Path) -> None:
    model = load_ours(tiny_fp8_dir, fuse_mla=True)
    attn = next(m for m in model.modules() if isinstance(m, MLAttention))
    assert attn.fuse_mla and not attn.fuses_mla and not attn.q_b_quantized


def _fake_gemm_quantized(xq, xs, w, ws):  # fake: the reference of the quantised GEMM
    y = dequant_per_token_group(xq, xs) @ dequant_weight_block(w, ws).t()
    return y.to(torch.bfloat16)


def _quant_gpu_like(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~dsv3serve.kernels.fp8_ref.quant_per_token_group` with the scale computed as
    on CUDA (``max(amax, 1e-10) * fl32(1/448)``), as the fused kernels compute it."""
    m, k = x.shape
    xp = F.pad(x.float(), (0, -k % group)).view(m, -1, group)
    inv = torch.tensor(1 / FP8_MAX, dtype=torch.float32)
    scale = xp.abs().amax(dim=-1).clamp(min=1e-10) * inv
    q = (xp / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, -1)[:, :k].contiguous(), scale


def _fp8_pool_attn(model: dsv3.DeepseekV3ForCausalLM) -> TorchRefAttention:
    c = model.cfg
    pool = MLAKVPool(model.num_kv_layers, 256, 4, c.kv_cache_dim, torch.float8_e4m3fn, "cpu")
    return TorchRefAttention(pool, c.kv_lora_rank)


def _logits(
    model_dir: Path, fused: bool, attn_impl: str = "auto", fp8_pool: bool = False
) -> torch.Tensor:
    model = load_ours(model_dir, fuse_mla=fused, fuse_norm_quant=False, attn_impl=attn_impl)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (4, 7)]
    attn = _fp8_pool_attn(model) if fp8_pool else make_attn(model)
    return torch.cat(prefill_logits(model, attn, prompts)).float()


def _force(monkeypatch: pytest.MonkeyPatch, norms: Callable, write: Callable) -> list[str]:
    """Force the fused path on CPU (named fakes above) with ``norms`` and ``write`` as the
    fused ops; returns their call log."""
    calls: list[str] = []

    def counted_norms(*args, **kwargs):
        calls.append("norms")
        return norms(*args, **kwargs)

    def counted_write(*args, **kwargs):
        calls.append("rope_write")
        return write(*args, **kwargs)

    monkeypatch.setattr(dsv3, "mla_kernels_apply", lambda device, dtype: True)
    monkeypatch.setattr(linear_mod.Linear, "takes_quantized", lambda self, *where: self.is_fp8)
    monkeypatch.setattr(linear_mod, "fp8_block_gemm_quantized", _fake_gemm_quantized)
    monkeypatch.setattr(dsv3, "qkv_a_rmsnorm", counted_norms)
    monkeypatch.setattr(attn_base, "rope_kv_write", counted_write)
    return calls


def _compare(
    model_dir: Path, attn_impl: str, fp8_pool: bool, monkeypatch: pytest.MonkeyPatch,
    norms: Callable, write: Callable,
) -> float:  # fmt: skip
    """Relative logit difference of the forced fused path (``norms``, ``write``) to the
    reference path, after checking each fused op ran once per layer per forward."""
    ref = _logits(model_dir, False, attn_impl, fp8_pool)
    calls = _force(monkeypatch, norms, write)
    fused = _logits(model_dir, True, attn_impl, fp8_pool)
    expected = ["norms", "rope_write"] * load_ours(model_dir).cfg.num_hidden_layers
    assert calls == expected, f"expected {expected}, got {calls}"
    return float((fused - ref).norm() / ref.norm())


CASES = [
    ("tiny_fp8_dir", "auto", False),  # prefill in the MHA form, FP8 q for q_b_proj
    ("tiny_bf16_dir", "absorb", False),  # the decode form, bf16 q_b_proj
    ("tiny_fp8_dir", "absorb", True),  # an fp8 pool: per-token scales
]


@pytest.mark.parametrize(("ckpt", "attn_impl", "fp8_pool"), CASES)
def test_fused_wiring_equals_reference_path(
    ckpt: str,
    attn_impl: str,
    fp8_pool: bool,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir: Path = request.getfixturevalue(ckpt)
    rel = _compare(model_dir, attn_impl, fp8_pool, monkeypatch, qkv_a_rmsnorm, rope_kv_write)
    print(f"fused (reference ops) vs reference path: relative logit difference {rel:.2e}")
    # the fused ops' references do the reference path's arithmetic: equal, not merely close
    assert rel == 0.0, f"expected fused == reference path, relative difference {rel:.2e}"


@pytest.mark.parametrize(("ckpt", "attn_impl", "fp8_pool"), CASES)
def test_interpreted_kernels_track_reference_path(
    ckpt: str,
    attn_impl: str,
    fp8_pool: bool,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton kernels themselves (through the interpreter) in the forced fused path."""
    pytest.importorskip("triton")
    from interp_util import INTERPRETING, gpu_like_casts

    if not INTERPRETING:
        pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts")
    from dsv3serve.kernels.mla_norm import qkv_a_rmsnorm_triton
    from dsv3serve.kernels.rope_kv import rope_kv_write_triton

    model_dir: Path = request.getfixturevalue(ckpt)
    kernels = (qkv_a_rmsnorm_triton, rope_kv_write_triton)
    monkeypatch.setattr(fp8_ref, "quant_per_token_group", _quant_gpu_like)
    with gpu_like_casts():
        rel = _compare(model_dir, attn_impl, fp8_pool, monkeypatch, *kernels)
    print(f"fused (interpreted kernels) vs reference path: relative logit difference {rel:.2e}")
    assert rel < INTERP_BOUND, f"expected relative difference < {INTERP_BOUND}, got {rel:.3f}"


def test_fusion_decided_once_not_per_step(
    tiny_fp8_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused-path choices are made by ``post_load`` / ``set_fusions`` and only read by
    ``forward``: a forward asks nothing about devices or dtypes; ``set_fusions`` flips them."""
    asked: list[bool] = []

    def apply(device: torch.device, dtype: torch.dtype) -> bool:
        asked.append(True)
        return True

    monkeypatch.setattr(dsv3, "mla_kernels_apply", apply)
    model = load_ours(tiny_fp8_dir, fuse_mla=True)
    attn_layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    assert asked and all(m.fuses_mla for m in attn_layers)
    asked.clear()
    monkeypatch.setattr(linear_mod.Linear, "takes_quantized", _never_per_step)
    prefill_logits(model, make_attn(model), [[1, 2, 3]])
    assert not asked, "forward re-decided the fused MLA path"
    monkeypatch.setattr(linear_mod.Linear, "takes_quantized", TAKES_QUANTIZED)
    model.set_fusions(mla=False)  # the kernels still "apply": only the switch turns them off
    assert not any(m.fuses_mla for m in attn_layers)
    assert not any(m.fuses_norm_quant for m in model.modules() if isinstance(m, dsv3.DecoderLayer))
    model.set_fusions(mla=True)
    assert all(m.fuses_mla for m in attn_layers)


TAKES_QUANTIZED = linear_mod.Linear.takes_quantized


def _never_per_step(self: linear_mod.Linear, *where: object) -> bool:
    raise AssertionError("takes_quantized asked during a forward")
