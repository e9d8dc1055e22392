"""Helpers for running Triton kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter (triton 3.6) gets float conversions wrong where the GPU does not: fp32 -> e4m3
drops the carry when rounding up crosses a power of two (126.4 becomes 64, not 128), and
fp32 -> bf16 truncates instead of rounding to nearest even. :func:`gpu_like_casts` replaces
those conversions, while a test runs, by torch's (round to nearest even, as the GPU's ``cvt``;
our kernels clamp to +-448 before any e4m3 conversion, so saturation never matters). The
interpreter also multiplies bf16 operands of ``tl.dot`` as raw integers, so CPU tests of
16-bit dots use fp16, which takes the same code path in our kernels.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _torch_dtypes() -> dict:
    import triton.language as tl

    return {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
    }


# how the interpreter stores each dtype: a numpy dtype of that width, and torch's equivalent
_STORAGE = {
    torch.float32: (np.float32, torch.float32),
    torch.float16: (np.float16, torch.float16),
    torch.bfloat16: (np.int16, torch.int16),
    torch.float8_e4m3fn: (np.uint8, torch.uint8),
}


def _to_torch(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    np_storage = _STORAGE[dtype][0]
    return torch.from_numpy(np.ascontiguousarray(data).view(np_storage)).view(dtype)


def _to_numpy(t: torch.Tensor, like: np.dtype) -> np.ndarray:
    return t.view(_STORAGE[t.dtype][1]).numpy().view(like)


@contextmanager
def gpu_like_casts() -> Iterator[None]:
    """Within the block, the interpreter converts between fp32, fp16, bf16 and e4m3 as torch."""
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    dtypes = _torch_dtypes()
    orig_fp_to_fp, orig_cast = builder.create_fp_to_fp, builder.cast_impl

    def convert(src, dst_type):
        src_t, dst_t = dtypes.get(src.dtype.scalar), dtypes.get(dst_type.scalar)
        if src_t is None or dst_t is None:
            return None
        out = _to_torch(src.data, src_t).to(dst_t)
        like = interp._get_np_dtype(dst_type.scalar)
        return interp.TensorHandle(_to_numpy(out, like).reshape(src.data.shape), dst_type.scalar)

    def fp_to_fp(self, src, dst_type, rounding_mode):
        out = convert(src, dst_type)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode) if out is None else out

    def cast(self, src, dst_type):
        out = convert(src, dst_type)
        return orig_cast(self, src, dst_type) if out is None else out

    builder.create_fp_to_fp, builder.cast_impl = fp_to_fp, cast
    try:
        yield
    finally:
        builder.create_fp_to_fp, builder.cast_impl = orig_fp_to_fp, orig_cast
