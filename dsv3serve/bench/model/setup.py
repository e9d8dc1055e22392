"""The bench model: DeepSeek-V3 at a chosen width with one dense and a few MoE layers.

Weights are dummy FP8 (e4m3 + 128x128 block scales, bf16 embedding / head / router)
drawn directly on the device by the model runner's ``load_format="dummy"``; no checkpoint
is read. The KV pool is filled with random latents so decode steps read a real context.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dsv3serve.attention import attention_backend_class
from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.kvcache.pool import MLAKVPool, bytes_per_page
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions
from dsv3serve.model.presets import DEEPSEEK_V3_CONFIG
from dsv3serve.model.tiny import FP8_QUANT_CONFIG, TINY_CONFIG
from dsv3serve.model.weights import fill_randn_

# A reduced width for quick GPU smoke runs: the full model's head dims, a quarter of the rest.
SMALL_OVERRIDES: dict[str, Any] = {
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 768,
    "intermediate_size": 4096,
    "moe_intermediate_size": 512,
    "n_routed_experts": 64,
}
BENCH_PRESETS: dict[str, dict[str, Any]] = {
    "full": DEEPSEEK_V3_CONFIG,
    "small": {**DEEPSEEK_V3_CONFIG, **SMALL_OVERRIDES},
    "tiny": {**TINY_CONFIG, "vocab_size": 8192, "quantization_config": FP8_QUANT_CONFIG},
}
MAX_MOE_LAYERS = 58  # DeepSeek-V3's own count: no point in more
BASE_RESERVE_BYTES = 8 << 30  # workspaces, allocator slack, MoE / MLP intermediates


def bench_model_config(preset: str, num_moe_layers: int, mtp: bool) -> ModelConfig:
    """The preset's width with layer 0 dense, ``num_moe_layers`` MoE layers, NextN if ``mtp``."""
    if preset not in BENCH_PRESETS:
        raise ValueError(f"unknown bench preset {preset!r}; known: {sorted(BENCH_PRESETS)}")
    if num_moe_layers < 1:
        raise ValueError(f"num_moe_layers: expected >= 1, got {num_moe_layers}")
    raw = {
        **BENCH_PRESETS[preset],
        "num_hidden_layers": 1 + num_moe_layers,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1 if mtp else 0,
    }
    return ModelConfig.from_dict(raw)


def _meta_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Parameter bytes of the model built on the meta device (nothing allocated), plus the
    absorbed MLA weights (W_UK, W_UV) that ``post_load`` derives in the compute dtype."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg, ModelOptions(dtype=dtype))
    params = sum(p.nbytes for p in model.parameters())
    per_layer = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    absorbed = per_layer * cfg.kv_lora_rank * dtype.itemsize * model.num_kv_layers
    return params + absorbed


@dataclass(frozen=True)
class Footprint:
    """Device bytes of the bench model: the part every size has and each added MoE layer."""

    fixed_bytes: int  # embedding, head, the dense layer, the NextN layer
    moe_layer_bytes: int
    kv_layer_bytes: int  # one layer's KV pool
    fixed_kv_layers: int  # dense + NextN

    def total(self, num_moe_layers: int) -> int:
        layers = self.fixed_kv_layers + num_moe_layers
        return (
            self.fixed_bytes + num_moe_layers * self.moe_layer_bytes + layers * self.kv_layer_bytes
        )


def footprint(
    preset: str, mtp: bool, dtype: torch.dtype, kv_tokens: int, kv_dtype: torch.dtype
) -> Footprint:
    """Sizes from two meta builds (1 and 2 MoE layers), so they follow the model code."""
    one = _meta_bytes(bench_model_config(preset, 1, mtp), dtype)
    two = _meta_bytes(bench_model_config(preset, 2, mtp), dtype)
    kv_dim = bench_model_config(preset, 1, mtp).kv_cache_dim
    kv_layer = kv_tokens * bytes_per_page(1, 1, kv_dtype, kv_dim)
    return Footprint(one - (two - one), two - one, kv_layer, 1 + int(mtp))


def activation_reserve_bytes(
    cfg: ModelConfig, max_prefill: int, attention_backend: str, kv_dtype: torch.dtype
) -> int:
    """Rough device memory kept free for the forwards. A backend that materialises scores
    (the torch reference) holds float32 [heads, L, L] about three times in a prefill of L
    tokens."""
    reserve = BASE_RESERVE_BYTES
    if attention_backend_class(attention_backend, kv_dtype).materialises_scores:
        reserve += 3 * cfg.num_attention_heads * max_prefill**2 * 4
    return reserve


def auto_num_moe_layers(free_bytes: int, fp: Footprint, reserve_bytes: int) -> int:
    """The most MoE layers (1 .. 58) whose weights and KV fit beside ``reserve_bytes``."""
    room = free_bytes - reserve_bytes - fp.total(0)
    n = min(MAX_MOE_LAYERS, room // (fp.moe_layer_bytes + fp.kv_layer_bytes))
    if n < 1:
        need = (fp.total(1) + reserve_bytes) / 1e9
        raise ValueError(
            f"the bench model needs at least {need:.1f} GB with one MoE layer "
            f"(reserve {reserve_bytes / 1e9:.1f} GB included), found {free_bytes / 1e9:.1f} GB free"
        )
    return int(n)


def build_runner(
    cfg: ModelConfig, device: str, attention_backend: str, moe_backend: str, kv: dict[str, Any]
) -> ModelRunner:
    """A model runner with dummy weights; ``kv`` holds ``page_size``, ``num_kv_tokens``
    and ``kv_cache_dtype``.

    The backend names go to the runner as given, unchecked by the config's list of names
    (backends are being added on other branches); the runner's ``create_*`` functions
    reject unknown names with the list they support.
    """
    engine_cfg = EngineConfig(
        model="bench-model",
        load_format="dummy",
        device=device,
        enable_prefix_caching=False,
        **kv,
    ).model_copy(update={"attention_backend": attention_backend, "moe_backend": moe_backend})
    return ModelRunner(engine_cfg, None, cfg)


def build_fitting_runner(
    make: Callable[[int], ModelRunner], num_moe_layers: int, shrink_on_oom: bool
) -> ModelRunner:
    """``make(num_moe_layers)``; on a CUDA out-of-memory with ``shrink_on_oom``, one MoE
    layer fewer until it fits (the layer count was an estimate)."""
    while True:
        try:
            return make(num_moe_layers)
        except torch.cuda.OutOfMemoryError:
            if not shrink_on_oom or num_moe_layers == 1:
                raise
        gc.collect()  # outside the handler: the traceback no longer pins the partial model
        torch.cuda.empty_cache()
        print(f"out of memory with {num_moe_layers} MoE layers; trying {num_moe_layers - 1}")
        num_moe_layers -= 1


def _host_copy_TBps(nbytes: int = 64 << 20, reps: int = 5) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e12


def run_ceilings(device: torch.device, replays: int) -> dict[str, float]:
    """``bench kernels``' ceilings on a GPU (copy, bf16 and fp8 GEMM); on the CPU only a
    host copy bandwidth, so the roofline ratios stay defined."""
    if device.type != "cuda":
        return {"copy_TBps": _host_copy_TBps()}
    from dsv3serve.bench.kernels.timing import measure_ceilings

    ceilings = measure_ceilings(replays)
    torch.cuda.empty_cache()
    return ceilings


@torch.no_grad()
def fill_kv_random(pool: MLAKVPool, seed: int = 1) -> None:
    """Every slot of every layer gets a random latent ~N(0, 1) (fp8 pools: scale 1)."""
    g = torch.Generator(device=pool.device).manual_seed(seed)
    for layer in range(pool.num_layers):
        fill_randn_(pool.kv_buffer(layer), g)
        scale = pool.scale_buffer(layer)
        if scale is not None:
            scale.fill_(1.0)
