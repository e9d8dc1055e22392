"""Whether a prefill group's KV pages can land, byte for byte, in a decode group's pool.

The connectors copy raw page bytes (``kv_transfer.pages.PageLayout``): the two roles must
agree on the page size, the KV storage dtype and the checkpoint (layers, latent width).
The parallel layouts may differ: the MLA latent cache is not split by heads, so a page
from any prefill layout (one rank or TP) lands whole on the decode group's chosen DP rank.
Checked when the serving config is validated, before anything starts; no torch here.
"""

from __future__ import annotations

from dsv3serve.engine.config import EngineConfig
from dsv3serve.json_types import JSONObject
from workers.config import WorkerConfig

# the storage dtype of the KV pool, by kv_cache_dtype, then by dtype (model_runner's rules)
_FP8_STORAGE = "float8_e4m3fn"


def kv_storage_dtype(engine: EngineConfig) -> str:
    """The torch dtype name the KV pool of ``engine`` stores (no torch import).

    ``kv_cache_dtype: fp8_e4m3`` stores fp8; otherwise the model dtype, where ``auto`` is
    float32 on CPU and bfloat16 on GPU (``dsv3serve.engine.model_runner.resolve_dtype``).
    """
    if engine.kv_cache_dtype == "fp8_e4m3":
        return _FP8_STORAGE
    if engine.dtype != "auto":
        return engine.dtype
    return "float32" if engine.device.split(":")[0] == "cpu" else "bfloat16"


def _kv_fields(engine: EngineConfig) -> JSONObject:
    """What a KV page's bytes depend on, by the config fields a user sets."""
    return {
        "engine.page_size": engine.page_size,
        "KV storage dtype (engine.kv_cache_dtype, engine.dtype, engine.device)": (
            kv_storage_dtype(engine)
        ),
        "engine.model": engine.model,
        "engine.hf_overrides": engine.hf_overrides,
    }


def pd_kv_mismatches(prefill: WorkerConfig, decode: WorkerConfig) -> list[str]:
    """Each KV-layout field on which ``prefill`` and ``decode`` differ, with both values."""
    p, d = _kv_fields(prefill.engine), _kv_fields(decode.engine)
    return [f"{name}: prefill {p[name]!r}, decode {d[name]!r}" for name in p if p[name] != d[name]]


def check_pd_kv_compatible(prefill: WorkerConfig, decode: WorkerConfig) -> None:
    """Raise ValueError naming every field on which the two roles' KV pages would differ.

    Pages are moved as raw bytes, never converted, so a mismatch is refused here rather
    than failing (or corrupting) the first transfer.
    """
    mismatches = pd_kv_mismatches(prefill, decode)
    if mismatches:
        raise ValueError(
            "prefill and decode must store KV pages alike (pages move byte for byte, "
            "without conversion): "
            + "; ".join(mismatches)
            + ". Set these in the shared `engine` section, not in `prefill.engine` or "
            "`decode.engine` (the parallel layout fields may differ per role)"
        )
