"""``bench group --profile-steps``: device ops sorted into what they are, and per-step sums.

The kernel names are ones the H200 profiles of `bench model` recorded (cuBLAS, flashinfer,
PyTorch and our Triton kernels, ``docs/perf/latency_h200_run11.json``); each category is
labelled here by hand.
"""

from __future__ import annotations

import pytest

from dsv3serve.bench.engine.group_profile import by_category, category, profile_line
from dsv3serve.bench.model.profile import DeviceOp

RECORDED = {
    "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT": "gemm",
    "nvjet_sm90_tss_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>": "gemm",
    "std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float>": "gemm",
    "_gemm_kernel_body": "gemm",
    "_splitk_reduce_body": "gemm",
    "_gate_up_body": "moe_experts",
    "_down_body": "moe_experts",
    "_combine_body": "moe_experts",
    "_count_body": "moe_routing",
    "_plan_body": "moe_routing",
    "_scatter_body": "moe_routing",
    "_grouped_topk_body": "moe_routing",
    "void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<flashinfer::mla::hopper"
    "::HopperKernelTraits<false, 2u, 512u, 64u, 64u, 64u, __nv_bfloat16>": "attention",
    "_stage1_kernel": "attention",
    "_merge_kernel": "attention",
    "_norm_quant_body": "norm_rope_quant",
    "_qkv_norm_body": "norm_rope_quant",
    "_quant_kernel_body": "norm_rope_quant",
    "_rope_kv_body": "norm_rope_quant",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
    "at::native::ArgMaxOps<float>, unsigned int, long, 4, 4> >": "sampling",
    "Memcpy HtoD (Pinned -> Device)": "copy",
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memset (Unknown)": "copy",
    "void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous namespace)"
    "::silu_kernel(at::TensorIteratorBase&)": "other",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
    "at::native::MaxOps<float>, unsigned int, float, 4, 4> >": "other",
    # NCCL's and DeepEP's kernels (names as their libraries define them)
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "collective",
    "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*)": "collective",
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_every_recorded_kernel_lands_in_its_category(name: str) -> None:
    assert category(name) == RECORDED[name]


def test_category_sums_per_step_largest_first() -> None:
    ops = [
        DeviceOp("_gate_up_body", 0.0, 300.0),
        DeviceOp("ncclDevKernel_AllGather_RING_LL", 300.0, 1100.0),
        DeviceOp("_down_body", 1100.0, 1300.0),
        DeviceOp("nvjet_sm90_tst_128x8", 1300.0, 1400.0),
    ]
    got = by_category(ops, calls=2)
    assert list(got) == ["collective", "moe_experts", "gemm"]
    assert got == {"collective": 0.4, "moe_experts": 0.25, "gemm": 0.05}


def test_printed_line_names_each_category_and_the_host_part() -> None:
    p = {
        "calls": 3,
        "wall_ms": 12.5,
        "span_ms": 11.0,
        "kernel_ms": 9.0,
        "ops_per_call": 410.0,
        "categories_ms": {"moe_experts": 5.0, "collective": 4.0},
    }
    line = profile_line(p)
    assert "wall 12.50" in line and "span 11.00" in line and "410 ops" in line
    assert "moe_experts 5.00, collective 4.00" in line
    skipped = profile_line({"calls": 3, "wall_ms": 4.0, "skipped": "CUDA only"})
    assert skipped.endswith("device ops skipped: CUDA only")
