"""Engine configuration: one validated object with the flag names vLLM/SGLang users know."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DTypeName = Literal["auto", "bfloat16", "float32"]


class EngineConfig(BaseModel):
    """Everything an :class:`~dsv3serve.engine.engine.Engine` needs, validated once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="checkpoint directory, or 'tiny' for the built-in tiny model")
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    hf_overrides: dict[str, Any] | None = None  # config.json fields to replace (presets)
    dtype: DTypeName = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "cpu"
    seed: int = 0
    # KV cache
    page_size: int = Field(16, ge=1)
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    num_kv_tokens: int | None = Field(None, ge=1, description="explicit KV capacity in tokens")
    mem_fraction_static: float = Field(0.85, gt=0, le=1)
    enable_prefix_caching: bool = True
    # scheduling
    max_running_requests: int = Field(256, ge=1)
    chunked_prefill_size: int = 8192  # <= 0 disables chunking
    max_num_batched_tokens: int = Field(16384, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    # backends
    attention_backend: Literal["torch"] = "torch"
    moe_backend: Literal["torch"] = "torch"
    attn_impl: Literal["auto", "mha", "absorb"] = "auto"
    fp8_act_quant: bool = True

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.load_format != "dummy" and self.model == "":
            raise ValueError("model: a checkpoint directory or 'tiny' is required")
        if 0 < self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"chunked_prefill_size: found {self.chunked_prefill_size}, "
                f"expected <= 0 (off) or >= page_size {self.page_size}"
            )
        return self
