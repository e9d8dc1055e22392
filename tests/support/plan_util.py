"""The memory planner on the published DeepSeek-V3 for a serving config's engine (tests of the
deploy YAMLs and the Helm values files)."""

from __future__ import annotations

from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.model.presets import PRESETS
from dsv3serve.plan.planner import Plan, plan


def plan_published(engine: EngineConfig, gpu_memory_gb: float) -> Plan:
    """``engine``'s layout and memory knobs (as the engine's own check on a GPU rank, plus
    its prefill chunk) on GPUs of ``gpu_memory_gb``, with the engine's ``hf_overrides``
    (e.g. fewer layers) applied; raises ``PlanError`` if it won't fit."""
    chunk = engine.chunked_prefill_size
    return plan(
        ModelConfig.from_dict(PRESETS["deepseek-v3"] | (engine.hf_overrides or {})),
        engine.parallel,
        gpu_memory_gb,
        engine.mem_fraction_static,
        engine.page_size,
        engine.kv_cache_dtype,
        engine.cuda_graph_max_bs,
        disable_cuda_graph=engine.disable_cuda_graph,
        max_running_requests=engine.max_running_requests,
        **({"chunked_prefill_size": chunk} if chunk > 0 else {}),
    )
