"""The MoE Triton kernels compile for Hopper (sm_90) within its shared memory, without a GPU.

Every launch that ``fused_moe`` and the gate would make, for each default config tier and
every tuned table shipped in ``dsv3serve/moe/configs``, is compiled down to a cubin with the
``ptxas`` in Triton's wheel (:mod:`aot_util`). Runs where Triton is installed and not in
interpreter mode; marked slow (about a minute on two CPU cores).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from aot_util import HOPPER_SMEM_BYTES, compile_launch, recorded  # noqa: E402
from interp_util import INTERPRETING  # noqa: E402

if INTERPRETING:
    pytest.skip("compiles real kernels: run without TRITON_INTERPRET", allow_module_level=True)

import dsv3serve.moe.align as align_mod  # noqa: E402
import dsv3serve.moe.gate_triton as gate_mod  # noqa: E402
import dsv3serve.moe.triton_moe as moe_mod  # noqa: E402
from dsv3serve.kernels.fp8_ref import FP8_DTYPE  # noqa: E402
from dsv3serve.moe.moe_config import CONFIG_DIR, MoEConfig, default_config, load_table  # noqa: E402

pytestmark = pytest.mark.slow

MOE_KERNELS = ["gate_up_kernel", "down_kernel", "combine_kernel"]
ALIGN_KERNELS = ["_count_kernel", "_plan_kernel", "_scatter_kernel"]
DEEPSEEK = (256, 7168, 2048, 8)  # E, H, I, top_k


def _launches(shape, t: int, fp8: bool, act_quant: bool, cfg: MoEConfig | None) -> list:
    """The launches of one fused_moe call (CPU tensors stand in for device ones)."""
    e, hidden, inter, top_k = shape
    wdt = FP8_DTYPE if fp8 else torch.bfloat16
    w13, w2 = torch.empty(e, 2 * inter, hidden, dtype=wdt), torch.empty(e, hidden, inter, dtype=wdt)
    s13 = torch.ones(e, 2 * inter // 128, -(-hidden // 128)) if fp8 else None
    s2 = torch.ones(e, -(-hidden // 128), inter // 128) if fp8 else None
    x = torch.randn(t, hidden, dtype=torch.bfloat16)
    ids, w = torch.randint(0, e, (t, top_k)), torch.rand(t, top_k)
    with recorded(moe_mod, MOE_KERNELS) as moe, recorded(align_mod, ALIGN_KERNELS) as align:
        moe_mod.fused_moe(x, w, ids, w13, w2, s13, s2, act_quant, cfg)
    assert len(moe) == 3 and len(align) == 3
    return moe + align


def _compile_all(launches: list) -> None:
    for launch in launches:
        kernel = compile_launch(launch)
        name = launch.kernel.fn.__name__
        assert kernel.metadata.shared <= HOPPER_SMEM_BYTES, f"{name}: {kernel.metadata.shared} B"


@pytest.mark.parametrize("t", [1, 512, 4096])  # the three default tiers at DeepSeek-V3 shapes
@pytest.mark.parametrize(("fp8", "act_quant"), [(True, True), (False, True), (True, False)])
def test_default_configs_compile_for_sm90(t: int, fp8: bool, act_quant: bool) -> None:
    _compile_all(_launches(DEEPSEEK, t, fp8, act_quant, None))


@pytest.mark.parametrize("hidden", [256, 320, 200])
@pytest.mark.parametrize("fp8", [True, False])
def test_small_shapes_compile_for_sm90(hidden: int, fp8: bool) -> None:
    for t in (1, 128, 1024):  # the three default tiers with 16 experts, top-4
        cfg = default_config(t, 16, 4, fp8)
        _compile_all(_launches((16, hidden, 128, 4), t, fp8, True, cfg))


def test_shipped_tables_compile_for_sm90() -> None:
    for path in sorted(CONFIG_DIR.glob("E=*.json")):
        fields = dict(part.split("=", 1) for part in path.stem.split(","))
        e, inter, hidden = int(fields["E"]), int(fields["N"]), int(fields["K"])
        table = load_table(path)
        assert table, f"{path.name}: empty table"
        for t, cfg in table.items():
            shape = (e, hidden, inter, 8)
            _compile_all(_launches(shape, t, fields["dtype"] == "fp8", True, cfg))


@pytest.mark.parametrize(("e", "n_group", "topk_group", "top_k"), [(256, 8, 4, 8), (16, 4, 2, 4)])
def test_gate_compiles_for_sm90(e: int, n_group: int, topk_group: int, top_k: int) -> None:
    logits, bias = torch.randn(4, e), torch.randn(e)
    with recorded(gate_mod, ["_grouped_topk_kernel"]) as launches:
        gate_mod.grouped_topk_triton(
            logits, bias, top_k, n_group, topk_group, 2.5, libdevice_exp=True
        )
    _compile_all(launches)
