"""row_argmax on the GPU against torch.argmax (fresh random logits, bf16 and float32)."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.kernels.argmax import row_argmax

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_row_argmax_equals_torch_on_the_gpu(dtype: torch.dtype, rows: int) -> None:
    logits = torch.randn(rows, 129280, device="cuda").to(dtype)
    assert torch.equal(row_argmax(logits), logits.argmax(-1))
