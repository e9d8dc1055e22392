"""The RoPE + KV-cache write kernel against its torch reference, on CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py without a GPU). Fresh random
inputs each session (the seed is in the test id); the pool starts NaN, so the test sees
that exactly the target rows were written and nothing else; bounds in
tests/support/mla_fusion_cases.py."""

from __future__ import annotations

import pytest
import torch
from fresh_seed import session_seed

pytest.importorskip("triton")
from interp_util import INTERPRETING, gpu_like_casts  # noqa: E402

if not INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts", allow_module_level=True)

from rope_kv_cases import (  # noqa: E402
    PAGE_SIZE,
    check_against_reference,
    check_layer_scaled,
    rope_inputs,
)

from dsv3serve.kernels.rope_kv import rope_kv_write_ref, rope_kv_write_triton  # noqa: E402
from dsv3serve.kvcache.pool import MLAKVPool  # noqa: E402
from dsv3serve.layers.rotary import RotaryEmbedding  # noqa: E402

SEED = session_seed()


@pytest.fixture(autouse=True)
def _casts():
    with gpu_like_casts():
        yield


@pytest.mark.parametrize("seed", [SEED])
@pytest.mark.parametrize(
    ("t", "r", "p", "heads", "dtype", "with_q"),
    [
        (3, 64, 16, 4, torch.bfloat16, True),  # the tiny model
        (2, 512, 64, 20, torch.bfloat16, True),  # DeepSeek-V3 widths; a partial head block
        (4, 64, 16, 4, torch.float8_e4m3fn, True),  # fp8 pool: per-token scales
        (1, 512, 64, 128, torch.float8_e4m3fn, True),  # DeepSeek-V3, one decode token
        (3, 128, 32, 0, torch.bfloat16, False),  # cache row only
    ],
)
def test_kernel_equals_reference(
    seed: int, t: int, r: int, p: int, heads: int, dtype: torch.dtype, with_q: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    case = rope_inputs(t, r, p, heads, dtype, "cpu", g, with_q)
    check_against_reference(case, rope_kv_write_triton, rope_kv_write_ref)


def test_reference_is_the_models_rotary_and_pool_write() -> None:
    """The reference is the model's path: RotaryEmbedding.rotate, concatenation and
    MLAKVPool.write, for both pool dtypes."""
    g = torch.Generator().manual_seed(SEED)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        case = rope_inputs(5, 64, 16, 4, dtype, "cpu", g, with_q=True)
        pool = MLAKVPool(1, case.kv.shape[0], PAGE_SIZE, 80, dtype, "cpu")
        r = 64
        k_pe = RotaryEmbedding.rotate(case.latent[:, r:], case.cos, case.sin)
        pool.write(0, case.slots, torch.cat([case.latent[:, :r], k_pe], -1))
        scales = pool.scale_buffer(0)
        q = rope_kv_write_ref(
            case.latent, case.cos, case.sin, case.slots, case.kv, case.scales, case.q_pe
        )
        kv, pool_kv = case.kv.view(-1, 80)[case.slots], pool.kv_buffer(0).view(-1, 80)[case.slots]
        assert torch.equal(kv.view(torch.uint8), pool_kv.view(torch.uint8))
        if scales is not None:
            assert case.scales is not None
            slots = case.slots
            assert torch.equal(case.scales.view(-1)[slots], scales.view(-1)[slots])
        assert q is not None and torch.equal(
            q, RotaryEmbedding.rotate(case.q_pe, case.cos, case.sin)
        )


@pytest.mark.parametrize("seed", [SEED])
def test_layer_scaled_e4m3_rows_are_what_the_pool_writes(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    case = rope_inputs(3, 512, 64, 20, torch.float8_e4m3fn, "cpu", g)
    for write in (rope_kv_write_triton, rope_kv_write_ref):
        check_layer_scaled(case, write)
