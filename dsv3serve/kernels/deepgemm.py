"""Optional DeepGEMM FP8 block GEMM: the ``auto`` dispatch runs it only for shapes where this
GPU's measured table (:mod:`dsv3serve.kernels.gemm_table`) says it is at least 1.05x faster
than the GEMM that would run instead, and only where ``import deep_gemm`` works and a
self-check passes. When the table wants it and it is unusable, a WARNING says why, once per
reason, and cuBLAS / Triton run as without a table. How to build it: docs/deepgemm.md.

There is no wheel for our torch (``benchmarks/deepgemm/build.sh`` builds it from source; an
older repackaged sdist built on an H200 segfaulted in its first call), so the check is
defensive: on CUDA the real module is first
exercised in a child process (``python -m dsv3serve.kernels.deepgemm``), so a crash costs the
child, not the server; then the same small GEMM runs in-process and is compared with the
torch reference by relative error (``SELF_CHECK_RTOL``). The result is cached per device.

The API used (deepseek-ai/DeepGEMM ``csrc/apis/gemm.hpp`` and ``tests/test_fp8.py``)::

    deep_gemm.fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims="nk",
                          disable_ue8m0_cast=False) -> None   # D = C + A @ B.T, in place

- ``a = (x_fp8, x_scale)``: e4m3 [M, K] K-major (row-major) and float32 [M, K/128], one scale
  per (row, 128 channels). On SM90 the scales are float32 (SM100 wants packed UE8M0) and the
  kernel reads them MN-major and TMA-aligned (M padded to 4 floats = 16 bytes); we pass them
  M-major, strides ``(1, M)``, and the library transforms any other layout itself
  (``transform_sf_into_required_layout``);
- ``b = (w_fp8, w_scale)``: e4m3 [N, K] row-major and float32 [N/128, K/128] (the checkpoint's
  ``weight_scale_inv``), i.e. the 1x128 / 128x128 recipe, the default on SM90;
- ``d``: bf16 [M, N] row-major, written in place.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from dsv3serve.kernels.fp8_ref import (
    BLOCK,
    dequant_per_token_group,
    dequant_weight_block,
    quant_per_token_group,
    quant_weight_block,
)
from dsv3serve.kernels.gemm_table import DeepGemmTable, load_table

log = logging.getLogger(__name__)

MODULE_NAME = "deep_gemm"
SELF_CHECK_SHAPE = (50, 256, 512)  # M (not a multiple of 4: exercises the scale padding), N, K
SELF_CHECK_RTOL = 1e-2  # bf16 output: expected ~2e-3
PROBE_TIMEOUT_S = 300.0  # the first call JIT-compiles


@dataclass(frozen=True)
class DeepGemmStatus:
    """Whether DeepGEMM may be used on a device, and why not when it may not."""

    usable: bool
    reason: str


def supported(n: int, k: int) -> bool:
    """Shapes the 1x128 / 128x128 recipe takes: whole 128-wide K blocks, N a multiple of 64."""
    return k % BLOCK == 0 and n % 64 == 0


def deepgemm_gemm(
    module: ModuleType, xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor
) -> torch.Tensor:
    """``dequant(xq, xs) @ dequant(w, ws).T`` in bf16 [M, N] through ``module.fp8_gemm_nt``."""
    out = torch.empty((xq.shape[0], w.shape[0]), dtype=torch.bfloat16, device=xq.device)
    module.fp8_gemm_nt((xq, xs), (w, ws), out)
    return out


def _check_inputs(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Fresh-seeded operands and the float32 reference of the self-check GEMM."""
    m, n, k = SELF_CHECK_SHAPE
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(m, k, generator=g)
    xq, xs = quant_per_token_group(x)
    wq, ws = quant_weight_block(torch.randn(n, k, generator=g) * 0.02)
    ref = dequant_per_token_group(xq, xs) @ dequant_weight_block(wq, ws).t()
    xs_m_major = xs.t().contiguous().t()
    return tuple(t.to(device) for t in (xq, xs_m_major, wq, ws, ref))


def self_check(module: ModuleType, device: torch.device) -> str | None:
    """Run a small GEMM through ``module``; None when it matches the reference, else why not."""
    if not callable(getattr(module, "fp8_gemm_nt", None)):
        return f"{MODULE_NAME} has no fp8_gemm_nt (expected the DeepGEMM >= 2.0 API)"
    xq, xs, wq, ws, ref = _check_inputs(device)
    try:
        out = deepgemm_gemm(module, xq, xs, wq, ws)
    except Exception as e:  # any failure of an optional library means: do not use it
        return f"fp8_gemm_nt raised {type(e).__name__}: {e}"
    if out.shape != ref.shape or not bool(torch.isfinite(out).all()):
        return f"fp8_gemm_nt wrote a non-finite or misshapen result {list(out.shape)}"
    err = float((out.float() - ref).norm() / ref.norm())
    if err > SELF_CHECK_RTOL:
        return f"fp8_gemm_nt relative error {err:.2e}, expected <= {SELF_CHECK_RTOL:.0e}"
    return None


def _probe_in_child(device: torch.device) -> str | None:
    """Run the self-check in a child process (a segfault there must not take us down)."""
    cmd = [sys.executable, "-m", __name__, str(device.index or 0)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the self-check in a child process took over {PROBE_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        return f"the self-check in a child process exited {done.returncode}: {tail[0]}"
    return None


def _import() -> tuple[ModuleType | None, str]:
    try:
        import deep_gemm
    except Exception as e:  # ImportError, or a broken build failing at import
        return None, f"import {MODULE_NAME} failed: {type(e).__name__}: {e}"
    return deep_gemm, ""


@functools.cache
def deepgemm_status(device_type: str, index: int = 0) -> DeepGemmStatus:
    """Import and self-check DeepGEMM once per device (``"cuda", 0``); logs why it is unused."""
    device = torch.device(device_type, index) if device_type == "cuda" else torch.device("cpu")
    module, reason = _import()
    if module is not None:
        on_disk = getattr(module, "__file__", None) is not None
        child = _probe_in_child(device) if device.type == "cuda" and on_disk else None
        reason = child or self_check(module, device) or ""
    status = DeepGemmStatus(module is not None and not reason, reason or "self-check passed")
    if status.usable:
        log.info("DeepGEMM on %s passed its self-check", device)
    else:
        _warn_unusable(reason)
    return status


@functools.cache
def _warn_unusable(reason: str) -> None:
    """One WARNING per distinct reason (every device of a process fails the same way)."""
    log.warning(
        "DeepGEMM not used: %s; where a measured GEMM table prefers it, cuBLAS / Triton run "
        "instead (build it: docs/deepgemm.md)",
        reason,
    )


@functools.cache
def cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table_for(device: torch.device) -> DeepGemmTable | None:
    """The measured table of ``device``'s GPU model (None off CUDA or without one)."""
    if device.type != "cuda":
        return None
    return load_table(cuda_device_name(device.index or 0))


def dense_pick(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether ``auto`` runs DeepGEMM for an M x N x K GEMM on ``device``: its GPU's table
    says DeepGEMM wins there and it passed its self-check (:func:`picks`)."""
    return picks(table_for(device), m, n, k, lambda: usable_on(device))


def picks(table: DeepGemmTable | None, m: int, n: int, k: int, usable: Callable[[], bool]) -> bool:
    """The rule: the table wins at M x N x K and then (only then, so a GPU whose table never
    wants DeepGEMM never probes it) ``usable()``."""
    if table is None or not supported(n, k) or not table.dense_wins(m, n, k):
        return False
    return usable()


def deepgemm_module() -> ModuleType:
    """The imported module (call only after :func:`deepgemm_status` said usable)."""
    module, reason = _import()
    if module is None:
        raise RuntimeError(reason)
    return module


def usable_on(device: torch.device) -> bool:
    """Whether the ``auto`` dispatch may pick DeepGEMM on ``device``. Never probes while a CUDA
    graph is being captured (the probe allocates and synchronises) unless it already ran."""
    if device.type != "cuda":
        return False
    if torch.cuda.is_current_stream_capturing() and deepgemm_status.cache_info().currsize == 0:
        return False
    return deepgemm_status("cuda", device.index or 0).usable


def main(argv: list[str] | None = None) -> int:
    """Child-process probe: exit 0 when the self-check passes on ``cuda:<index>``."""
    index = int((argv or sys.argv[1:] or ["0"])[0])
    module, reason = _import()
    if module is not None:
        reason = self_check(module, torch.device("cuda", index)) or ""
        torch.cuda.synchronize()
    print(reason or "ok")
    return 1 if reason else 0


if __name__ == "__main__":
    raise SystemExit(main())
