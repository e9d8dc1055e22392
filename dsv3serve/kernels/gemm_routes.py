"""Which FP8 GEMM the ``auto`` dispatch runs where: for each linear's N x K, the backend over
M as ranges of M, for the engine's startup log and ``dsv3serve plan``.

The ranges are exact, not sampled: the dispatch changes backend only at the Triton/cuBLAS
threshold (:func:`~dsv3serve.kernels.fp8_gemm.is_large_m`) and next to the table's measured
points (:func:`~dsv3serve.kernels.gemm_table.change_points`), so one lookup per stretch
between those cut points answers for every M in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dsv3serve.kernels.fp8_gemm import CUBLAS_FROM_M, CUBLAS_FROM_M_DEFAULT, choose_backend
from dsv3serve.kernels.gemm_table import DeepGemmTable, change_points, dense_key

Range = tuple[int, int, str]  # first M, last M, backend


def backend_ranges(
    n: int, k: int, max_m: int, table: DeepGemmTable | None, deepgemm_usable: bool
) -> list[Range]:
    """The backend for every M in ``1 .. max_m`` of an M x N x K GEMM, as ranges."""
    points = table.points("dense", dense_key(n, k)) if table is not None else ()
    fixed = {1, max_m + 1, CUBLAS_FROM_M.get((n, k), CUBLAS_FROM_M_DEFAULT)}
    cuts = sorted(c for c in fixed | change_points(points) if 1 <= c <= max_m + 1)
    ranges: list[Range] = []
    for lo, nxt in zip(cuts, cuts[1:], strict=False):
        use = deepgemm_usable and table is not None and table.dense_wins(lo, n, k)
        backend = choose_backend(lo, n, k, use)
        if ranges and ranges[-1][2] == backend:
            ranges[-1] = (ranges[-1][0], nxt - 1, backend)
        else:
            ranges.append((lo, nxt - 1, backend))
    return ranges


def format_ranges(ranges: Iterable[Range]) -> str:
    """``triton M 1-511, cublas M 512-8192``."""
    return ", ".join(f"{b} M {lo}-{hi}" if lo != hi else f"{b} M {lo}" for lo, hi, b in ranges)


def route_lines(
    shapes: Mapping[str, tuple[int, int]],
    max_m: int,
    table: DeepGemmTable | None,
    deepgemm_usable: bool,
) -> list[str]:
    """One line per linear (``name``: its local N x K): the backend's M ranges."""
    width = max((len(name) for name in shapes), default=0)
    return [
        f"{name:<{width}} N={n:<6} K={k:<6} "
        + format_ranges(backend_ranges(n, k, max_m, table, deepgemm_usable))
        for name, (n, k) in shapes.items()
    ]


def table_note(device: str | None, table: DeepGemmTable | None, deepgemm_state: str) -> str:
    """The header line: which GPU's table applies and whether DeepGEMM can run."""
    if device is None:
        return "FP8 GEMM backends (no GPU named: DeepGEMM tables not consulted)"
    if table is None:
        return f"FP8 GEMM backends on {device}: no measured DeepGEMM table, DeepGEMM never runs"
    when = table.environment.get("date", "date not recorded")
    return f"FP8 GEMM backends on {device}: DeepGEMM table measured {when}; {deepgemm_state}"
