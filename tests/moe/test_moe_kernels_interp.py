"""The MoE Triton kernels (gate, expert blocking, fused MoE) on CPU through Triton's interpreter.

Run with ``TRITON_INTERPRET=1`` (Triton builds the kernels when their modules are imported,
so the variable must be set before pytest starts); skipped otherwise and where Triton is not
installed. Float conversions the interpreter gets wrong are done as on the GPU
(:func:`interp_util.gpu_like_casts`); 16-bit dots use fp16 since the interpreter cannot
multiply bf16 (the kernels take the same path for both).

Tolerances, against the torch reference on CPU: 16/32-bit paths agree to float32 summation
order, so ``FLOAT_RTOL``; the e4m3 path differs more because the CPU reference divides by 448
where the kernel (like CUDA's torch) multiplies by the float32 reciprocal, which moves some
activation scales by one ulp and flips the odd e4m3 rounding tie (``FP8_RTOL``, measured
~2e-3). :func:`test_gate_up_quant_epilogue_bytes` checks the e4m3 intermediate bytes exactly
against the CUDA formula.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from interp_util import INTERPRETING, gpu_like_casts  # noqa: E402

if not INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts", allow_module_level=True)

from moe_util import check_blocks, drop_remote, random_routing  # noqa: E402

from dsv3serve.kernels.fp8_ref import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    fp8_block_linear_ref,
    quant_per_token_group,
)
from dsv3serve.moe.align import moe_align_block_size  # noqa: E402
from dsv3serve.moe.experts import random_experts  # noqa: E402
from dsv3serve.moe.gate import grouped_topk  # noqa: E402
from dsv3serve.moe.gate_triton import grouped_topk_triton  # noqa: E402
from dsv3serve.moe.moe_config import GemmTile, MoEConfig, default_config  # noqa: E402
from dsv3serve.moe.ref import TorchRefMoE  # noqa: E402
from dsv3serve.moe.triton_moe import fused_moe, moe_combine, moe_gate_up  # noqa: E402

FLOAT_RTOL = {torch.float16: 2e-3, torch.float32: 1e-5}
FP8_RTOL = 1e-2
TINY = {"e": 16, "top_k": 4, "n_group": 4, "topk_group": 2}  # the tiny model's router


@pytest.fixture(autouse=True)
def _casts():
    with gpu_like_casts():
        yield


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert bool(torch.isfinite(y).all()), "non-finite output"
    return float((y.float() - ref.float()).norm() / ref.float().norm())


# --- gate ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t", "e", "n_group", "topk_group", "top_k", "renorm"),
    [
        (5, 256, 8, 4, 8, True),
        (9, 16, 4, 2, 4, True),
        (4, 24, 3, 2, 5, True),
        (3, 64, 8, 3, 6, False),
    ],
)
def test_gate_matches_reference(t, e, n_group, topk_group, top_k, renorm) -> None:
    torch.manual_seed(e + t)
    logits, bias = torch.randn(t, e), torch.randn(e) * 0.1
    args = (logits, bias, top_k, n_group, topk_group, 2.5, renorm)
    w_ref, ids_ref = grouped_topk(*args)
    w, ids = grouped_topk_triton(*args)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids.sort(dim=1).values, ids_ref.sort(dim=1).values)
    order_ref, order = ids_ref.argsort(dim=1), ids.argsort(dim=1)
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-5, atol=0)


def test_gate_int32_ids_and_empty() -> None:
    logits, bias = torch.randn(3, 16), torch.zeros(16)
    w, ids = grouped_topk_triton(logits, bias, 4, 4, 2, 1.0, ids_dtype=torch.int32)
    assert ids.dtype == torch.int32 and torch.equal(
        ids.long(), grouped_topk(logits, bias, 4, 4, 2, 1.0)[1]
    )
    w, ids = grouped_topk_triton(torch.randn(0, 16), bias, 4, 4, 2, 1.0)
    assert w.shape == ids.shape == (0, 4)


# --- expert blocking -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t", "k", "e", "bm"),
    [(1, 8, 256, 16), (7, 4, 16, 16), (50, 4, 16, 32), (40, 8, 256, 64), (3, 2, 5, 4)],
)
def test_align_meets_the_spec(t: int, k: int, e: int, bm: int) -> None:
    torch.manual_seed(t)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    check_blocks(moe_align_block_size(ids, e, bm), ids, e)


def test_align_skips_negative_ids() -> None:
    torch.manual_seed(1)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(40)])
    ids[ids >= 8] = -1  # experts 8..15 live on another EP rank
    check_blocks(moe_align_block_size(ids, 16, 16), ids, 16)


def test_align_skewed_int32() -> None:
    ids = torch.zeros(70, 2, dtype=torch.int32)
    ids[:, 1] = 5
    check_blocks(moe_align_block_size(ids, 8, 16), ids, 8)


# --- fused MoE -------------------------------------------------------------------------

CONFIGS = {  # the three default tiers, and a 64-wide K step for 16-bit weights
    "bm16-swap": MoEConfig(16, GemmTile(128, 128, 4, 3, True), GemmTile(64, 128, 4, 3, True)),
    "bm32-swap": MoEConfig(32, GemmTile(128, 128, 4, 3, True), GemmTile(64, 128, 4, 3, True)),
    "bm64": MoEConfig(64, GemmTile(128, 128, 8, 3, False), GemmTile(128, 128, 4, 3, False)),
    "bk64": MoEConfig(16, GemmTile(64, 64, 4, 3, False), GemmTile(32, 64, 4, 3, True)),
}


def _run(t, hidden, fp8, dtype, act_quant, cfg_name) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(t + hidden)
    ex = random_experts(TINY["e"], hidden, 128, fp8, dtype, "cpu")
    w, ids = random_routing(t, TINY["e"], TINY["top_k"], TINY["n_group"], TINY["topk_group"], "cpu")
    x = torch.randn(t, hidden).to(dtype)
    cfg = CONFIGS[cfg_name] if cfg_name else None
    y = fused_moe(x, w, ids, ex.w13, ex.w2, ex.w13_scale_inv, ex.w2_scale_inv, act_quant, cfg)
    assert y.shape == x.shape and y.dtype == dtype
    return y, TorchRefMoE(act_quant).forward(x, w, ids, ex)


@pytest.mark.parametrize("cfg", ["bm16-swap", "bm32-swap", "bm64", "bk64", None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_moe_16_32_bit_weights(dtype: torch.dtype, cfg: str | None) -> None:
    y, ref = _run(9, 256, False, dtype, True, cfg)
    assert _rel_err(y, ref) < FLOAT_RTOL[dtype]


@pytest.mark.parametrize("cfg", ["bm16-swap", "bm32-swap", "bm64", None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 33])
def test_fused_moe_fp8_weights(t: int, dtype: torch.dtype, cfg: str | None) -> None:
    y, ref = _run(t, 256, True, dtype, True, cfg)
    assert _rel_err(y, ref) < FP8_RTOL


@pytest.mark.parametrize("cfg", ["bm16-swap", "bm64"])
def test_fused_moe_fp8_weights_16_bit_activations(cfg: str) -> None:
    y, ref = _run(9, 256, True, torch.float16, False, cfg)
    assert _rel_err(y, ref) < FLOAT_RTOL[torch.float16]


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_ragged_hidden(fp8: bool) -> None:
    """Hidden 200: the gate/up K loop and the down N tiles end part-way through a block."""
    dtype = torch.bfloat16 if fp8 else torch.float16
    y, ref = _run(6, 200, fp8, dtype, True, "bm16-swap")
    assert _rel_err(y, ref) < (FP8_RTOL if fp8 else FLOAT_RTOL[dtype])


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_skips_other_ranks_experts(fp8: bool) -> None:
    """An EP rank's view: choices outside experts 4..11 are -1 with weight 0; the result equals
    the reference running every chosen expert with those weights zeroed."""
    torch.manual_seed(5)
    dtype = torch.bfloat16 if fp8 else torch.float16
    ex = random_experts(16, 256, 128, fp8, dtype, "cpu")
    w, ids = random_routing(11, 16, 4, 4, 2, "cpu")
    x = torch.randn(11, 256).to(dtype)
    w_here, ids_here = drop_remote(w, ids, range(4, 12))
    y = fused_moe(x, w_here, ids_here, ex.w13, ex.w2, ex.w13_scale_inv, ex.w2_scale_inv)
    w_ref, ids_ref = drop_remote(w, ids, range(4, 12), local=False)
    ref = TorchRefMoE().forward(x, w_ref, ids_ref, ex)
    assert _rel_err(y, ref) < (FP8_RTOL if fp8 else FLOAT_RTOL[dtype])


def test_combine_reads_no_row_of_zero_weight() -> None:
    """Skipped assignments leave their rows of y unwritten (NaN here): they must not be read."""
    torch.manual_seed(6)
    w = torch.rand(5, 4)
    w[w < 0.4] = 0.0
    y = torch.randn(20, 64)
    y[(w == 0).flatten()] = float("nan")
    out = moe_combine(y, w, torch.empty(5, 64))
    ref = (w[:, :, None] * torch.nan_to_num(y).view(5, 4, 64)).sum(1)
    assert _rel_err(out, ref) < FLOAT_RTOL[torch.float32]


def test_fused_moe_empty_batch() -> None:
    ex = random_experts(16, 256, 128, True, torch.bfloat16, "cpu")
    x = torch.randn(0, 256).bfloat16()
    ids, w = torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4)
    assert fused_moe(x, w, ids, ex.w13, ex.w2, ex.w13_scale_inv, ex.w2_scale_inv).shape == (0, 256)


def test_default_config_is_used_without_a_table() -> None:
    assert default_config(9, 16, 4, True).block_m == 16
    y, ref = _run(9, 256, True, torch.bfloat16, True, None)
    assert _rel_err(y, ref) < FP8_RTOL


def test_gate_up_quant_epilogue_bytes() -> None:
    """The e4m3 intermediate equals the CUDA-formula quantisation of the reference's
    ``silu(gate) * up`` (rounded to bf16 at each step), byte for byte, and so do the scales."""
    torch.manual_seed(0)
    ex = random_experts(16, 256, 128, True, torch.bfloat16, "cpu")
    _, ids = random_routing(5, 16, 4, 4, 2, "cpu")
    x = torch.randn(5, 256).bfloat16()
    xq, xs = quant_per_token_group(x)
    blocks = moe_align_block_size(ids, 16, 16)
    h, hs = moe_gate_up(xq, xs, ex.w13, ex.w13_scale_inv, blocks, 4, GemmTile(128), x.dtype)
    assert h.dtype == FP8_DTYPE and hs is not None
    flat = ids.reshape(-1)
    gate, up = torch.cat(
        [
            fp8_block_linear_ref(x[a // 4 : a // 4 + 1], ex.w13[e], ex.w13_scale_inv[e])
            for a, e in enumerate(flat.tolist())
        ]
    ).chunk(2, dim=-1)
    ref = (F.silu(gate) * up).float()
    scale = ref.abs().amax(dim=1).clamp(min=1e-10) * torch.tensor(1 / FP8_MAX)
    q = (ref / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert torch.equal(hs[:, 0], scale)
    assert torch.equal(h.view(torch.uint8), q.view(torch.uint8))
