"""The engine's startup line on which FP8 GEMM backend runs where (``dsv3serve plan
--gpu-name`` prints the same from the config alone)."""

from __future__ import annotations

import logging

import torch

from dsv3serve.config import ModelConfig
from dsv3serve.kernels import deepgemm
from dsv3serve.kernels.gemm_table import DeepGemmTable, dense_key
from dsv3serve.layers.linear import fp8_kernels_run
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.plan.gemm import dense_gemm_shapes, gemm_report

logger = logging.getLogger(__name__)


def deepgemm_state(
    cfg: ModelConfig, layout: RankLayout | None, device: torch.device, table: DeepGemmTable | None
) -> tuple[bool, str]:
    """Self-checks DeepGEMM now (warning once when unusable) if this GPU's table has an
    entry for one of the rank's GEMMs; otherwise it is never asked for."""
    shapes = dense_gemm_shapes(cfg, layout).values()
    if table is None or not any(table.points("dense", dense_key(n, k)) for n, k in shapes):
        return False, "no table entry for these GEMMs: DeepGEMM not consulted"
    status = deepgemm.deepgemm_status("cuda", device.index or 0)
    if status.usable:
        return True, "DeepGEMM passed its self-check"
    return False, f"DeepGEMM unusable ({status.reason})"


def log_gemm_backends(
    cfg: ModelConfig,
    layout: RankLayout | None,
    device: torch.device,
    dtype: torch.dtype,
    act_quant: bool,
    max_m: int,
) -> None:
    """Log, per FP8 linear of this rank, the backend ``auto`` runs for each range of M."""
    if cfg.quant_method != "fp8" or not fp8_kernels_run(device, dtype, act_quant):
        return
    name, table = deepgemm.cuda_device_name(device.index or 0), deepgemm.table_for(device)
    state = deepgemm_state(cfg, layout, device, table)
    logger.info("%s", "\n".join(gemm_report(cfg, layout, max_m, name, table, state)))
