"""The KV pool a layout gets on CPU (``dsv3serve plan --device cpu``): the engine's own rule
(:func:`~dsv3serve.kvcache.sizing.cpu_kv_size`), every rank of the group on one host as
``LLM`` and ``dsv3serve`` start them. Weights are not planned on CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dsv3serve.config import ModelConfig
from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.pool import bytes_per_page
from dsv3serve.kvcache.sizing import DEFAULT_CPU_KV_CACHE_SPACE_GIB, GIB, KVSize, cpu_kv_size
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.plan.planner import KVCacheDType, describe, kv_layers

CpuDType = Literal["auto", "bfloat16", "float32"]
# the engine's pool dtype on CPU: the model's (``auto`` is float32 there), or e4m3
_KV_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CpuSettings:
    """The engine fields the CPU pool depends on (their names and defaults)."""

    page_size: int = 16
    dtype: CpuDType = "auto"
    kv_cache_dtype: KVCacheDType = "auto"
    max_running_requests: int = 256
    max_model_len: int | None = None
    cpu_kv_cache_space_gib: float = DEFAULT_CPU_KV_CACHE_SPACE_GIB

    def kv_dtype(self) -> torch.dtype:
        fp8 = self.kv_cache_dtype == "fp8_e4m3"
        return torch.float8_e4m3fn if fp8 else _KV_DTYPES[self.dtype]


@dataclass(frozen=True)
class CpuPlan:
    """Each rank's KV pool of ``parallel`` on one host (every rank the same)."""

    parallel: ParallelConfig
    settings: CpuSettings
    kv: KVSize


def cpu_plan(model_cfg: ModelConfig, parallel: ParallelConfig, s: CpuSettings) -> CpuPlan:
    """The pool each rank of ``parallel`` sizes on CPU without ``num_kv_tokens``."""
    page_bytes = bytes_per_page(
        kv_layers(model_cfg), s.page_size, s.kv_dtype(), model_cfg.kv_cache_dim
    )
    kv = cpu_kv_size(
        max_running_requests=s.max_running_requests,
        context_len=s.max_model_len or model_cfg.max_position_embeddings,
        space_gib=s.cpu_kv_cache_space_gib,
        ranks_on_host=parallel.world_size,
        page_size=s.page_size,
        page_bytes=page_bytes,
    )
    return CpuPlan(parallel, s, kv)


def cpu_plan_table(p: CpuPlan, model: str) -> str:
    """The layout, then each rank's pool in one line and the group's bytes."""
    n = p.parallel.world_size
    return "\n".join(
        [
            f"model {model}, layout {describe(p.parallel)}: {n} ranks on one host (CPU)",
            f"KV pool per rank: {p.kv.describe()}",
            f"KV pools of the group: {n * p.kv.nbytes} bytes ({n * p.kv.nbytes / GIB:.2f} GiB)",
        ]
    )


def cpu_plan_json(p: CpuPlan, model: str) -> JSONObject:
    """The plan as JSON-ready data (bytes)."""
    return {
        "model": model,
        "device": "cpu",
        "parallel": p.parallel.model_dump(),
        "kv_pages": p.kv.pages,
        "kv_tokens": p.kv.tokens,
        "kv_bytes": p.kv.nbytes,
        "kv_page_bytes": p.kv.page_bytes,
        "kv_reason": p.kv.reason,
        "group_kv_bytes": p.parallel.world_size * p.kv.nbytes,
    }
