"""The fused MoE kernels with the shared expert as expert E, on CPU through Triton's interpreter.

Run with ``TRITON_INTERPRET=1`` (see ``test_moe_kernels_interp.py`` for why, and for the
tolerances). The oracle is the separate form the model runs without fusion: the torch
reference MoE over the routed experts plus the shared expert as its own SiLU-gated MLP of
torch linears, on weights drawn independently of the stack and then tied into slot E.
16-bit weights are tested in fp16 (the interpreter cannot multiply bf16; same kernel path).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from interp_util import INTERPRETING, gpu_like_casts  # noqa: E402

if not INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts", allow_module_level=True)

from moe_util import random_routing  # noqa: E402

from dsv3serve.layers.linear import Linear  # noqa: E402
from dsv3serve.moe.experts import random_experts  # noqa: E402
from dsv3serve.moe.moe_config import GemmTile, MoEConfig  # noqa: E402
from dsv3serve.moe.ref import TorchRefMoE  # noqa: E402
from dsv3serve.moe.shared import append_shared_expert, tie_shared_expert  # noqa: E402
from dsv3serve.moe.triton_moe import fused_moe  # noqa: E402

E, H, INTER, K = 16, 256, 128, 4
RTOL = {"fp8": 1e-2, torch.float16: 2e-3}
CONFIGS = {
    "bm16-swap": MoEConfig(16, GemmTile(128, 128, 4, 3, True), GemmTile(64, 128, 4, 3, True)),
    "bm64": MoEConfig(64, GemmTile(128, 128, 8, 3, False), GemmTile(128, 128, 4, 3, False)),
}


@pytest.fixture(autouse=True)
def _casts():
    with gpu_like_casts():
        yield


def _shared_linears(fp8: bool, dtype: torch.dtype) -> list[Linear]:
    shapes = [(H, INTER), (H, INTER), (INTER, H)]
    parts = [Linear(k, n, fp8, dtype) for k, n in shapes]
    for lin in parts:
        if lin.weight_scale_inv is None:
            lin.weight.data = (torch.randn(lin.weight.shape) * 0.05).to(dtype)
        else:
            lin.weight.data = torch.randn(lin.weight.shape).to(lin.weight.dtype)
            lin.weight_scale_inv.data.uniform_(0.01, 0.03)
    return parts


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert bool(torch.isfinite(y).all()), "non-finite output"
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize(
    ("t", "fp8", "dtype", "cfg"),
    [
        (1, True, torch.bfloat16, None),  # default config: 16-row blocks, swapped
        (19, True, torch.bfloat16, "bm16-swap"),  # two blocks of the shared expert
        (19, True, torch.bfloat16, "bm64"),
        (1, False, torch.float16, None),
        (19, False, torch.float16, "bm64"),
    ],
)
def test_fused_shared_equals_separate(t: int, fp8: bool, dtype: torch.dtype, cfg: str | None):
    torch.manual_seed(t + 7 * fp8)
    ex = random_experts(E, H, INTER, fp8, dtype, "cpu", shared_slots=1)
    if not fp8:
        ex.w13.data.mul_(2.5)  # std 0.05, so the fp16 outputs are not dominated by rounding
        ex.w2.data.mul_(2.5)
    parts = _shared_linears(fp8, dtype)
    x = torch.randn(t, H).to(dtype)
    w, ids = random_routing(t, E, K, 4, 2, "cpu")
    gate, up, down = parts
    shared = down(F.silu(gate(x)) * up(x))
    want = TorchRefMoE().forward(x, w, ids, ex) + shared
    scales = [p.weight_scale_inv for p in parts if p.weight_scale_inv is not None]
    tie_shared_expert(ex, [p.weight for p in parts], scales)
    w_all, ids_all = append_shared_expert(w, ids, E)
    config = CONFIGS[cfg] if cfg else None
    got = fused_moe(x, w_all, ids_all, *ex.stack(True), act_quant=True, config=config)
    assert got.dtype == dtype and got.shape == x.shape
    assert _rel_err(got, want) < RTOL["fp8" if fp8 else dtype]
    # and the shared expert really contributed (not just routed experts matching)
    assert _rel_err(got, want - shared) > 10 * RTOL["fp8" if fp8 else dtype]
