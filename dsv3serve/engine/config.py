"""Engine configuration: one validated object with the flag names vLLM/SGLang users know."""

from __future__ import annotations

import argparse
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsv3serve.kvcache.sizing import DEFAULT_CPU_KV_CACHE_SPACE_GIB
from dsv3serve.parallel.config import ParallelConfig

DTypeName = Literal["auto", "bfloat16", "float32"]
PARALLEL_FIELDS = tuple(ParallelConfig.model_fields)
# What each attention backend needs of the device, declared where the config is validated
# (the router validates configs without torch, so it cannot ask the backend classes).
ATTENTION_NEEDS_CUDA_BF16: dict[str, bool] = {"torch": False, "flashinfer": True, "flashmla": True}
# Page sizes a backend's kernels read (absent: any).
ATTENTION_PAGE_SIZES: dict[str, tuple[int, ...]] = {"flashmla": (64,)}
DEFAULT_SPEC_STEPS = 3  # DeepSeek-V3 MTP: 3 chained steps, 4 draft tokens (as SGLang)
DEFAULT_HICACHE_RATIO = 2.0  # host tier / device pool, as SGLang's default


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
    mem_fraction_static: float = Field(0.85, gt=0, le=1)  # GPU only: share of the device
    # CPU without num_kv_tokens: max_running_requests x the context, capped at this many GiB
    # per host, shared by the group's ranks on it (vLLM's VLLM_CPU_KVCACHE_SPACE)
    cpu_kv_cache_space_gib: float = Field(DEFAULT_CPU_KV_CACHE_SPACE_GIB, gt=0)
    enable_prefix_caching: bool = True
    # hierarchical cache (SGLang's names): a host-memory tier under the prefix cache, of
    # hicache_ratio times the device pool's pages (default 2.0) or hicache_size GB (1e9 B)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float | None = Field(None, gt=0)
    hicache_size: int | None = Field(None, ge=1, description="host tier in GB (1e9 bytes)")
    # scheduling
    max_running_requests: int = Field(256, ge=1)
    chunked_prefill_size: int = 8192  # <= 0 disables chunking
    max_num_batched_tokens: int = Field(16384, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    # structured output (vLLM's name): JSON of json_schema, json_object and tool-call
    # arguments holds no whitespace between elements but ", " and ": "; off (vLLM's
    # default), any whitespace, which a weak model can spend max_tokens on
    disable_any_whitespace: bool = True
    # backends
    # flashmla: FlashMLA decode / verify (page_size 64), flashinfer prefill; opt-in only
    attention_backend: Literal["torch", "flashinfer", "flashmla"] = "torch"
    moe_backend: Literal["torch", "triton"] = "torch"  # triton: fused kernels on CUDA
    shared_experts_fusion: Literal["auto", "on", "off"] = "auto"  # see dsv3serve.moe.shared
    attn_impl: Literal["auto", "mha", "absorb"] = "auto"
    # CUDA graphs for decode steps (CUDA with the flashinfer or flashmla attention backend)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = Field(64, ge=1, description="largest captured decode batch")
    fp8_act_quant: bool = True
    # overlap scheduler (SGLang's): the host schedules step n+1 while the device runs step n
    disable_overlap_schedule: bool = False
    force_overlap_schedule: bool = False  # also off CUDA (CPU tests); on CUDA it is the default
    # torch.compile of the CUDA-graph-captured decode forward, batch sizes <= torch_compile_max_bs
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = Field(32, ge=1)
    # parallel layout of the group (SGLang's names; see dsv3serve.parallel.config)
    tp_size: int = Field(1, ge=1, description="ranks in the group, one per device")
    dp_size: int = Field(1, ge=1)
    enable_dp_attention: bool = False
    ep_size: int = Field(1, ge=1)
    moe_dense_tp_size: int | None = None
    enable_dp_lm_head: bool = False
    moe_a2a_backend: Literal["none", "deepep"] = "none"
    deepep_mode: Literal["auto", "normal", "low_latency"] = "auto"
    enable_eplb: bool = False  # EPLB: docs/eplb.md
    ep_num_redundant_experts: int = Field(0, ge=0)
    init_expert_location: str | None = None
    eplb_rebalance_num_iterations: int = Field(1000, ge=1)
    # the expert-parallel dispatch / combine metrics (dsv3serve:moe_dispatch_*; on by default,
    # docs/metrics.md): two CUDA events per dispatch and per combine on eager steps
    disable_moe_dispatch_metrics: bool = False
    # speculative decoding with the checkpoint's NextN (MTP) layer as the draft
    speculative_algorithm: Literal["NEXTN", "EAGLE"] | None = None  # EAGLE: alias of NEXTN
    speculative_num_steps: int | None = Field(None, ge=1, description="draft steps per round")
    speculative_eagle_topk: int | None = Field(None, description="draft branching; only 1")
    speculative_num_draft_tokens: int | None = Field(None, description="num_steps + 1")
    speculative_draft_model_quantization: Literal["fp8", "unquant"] | None = None

    @property
    def spec_num_steps(self) -> int:
        """Draft steps per round; 0 when speculative decoding is off.

        Unset, it follows ``speculative_num_draft_tokens - 1``, else the default 3.
        """
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_num_draft_tokens is not None:
            return max(1, self.speculative_num_draft_tokens - 1)
        return DEFAULT_SPEC_STEPS

    @property
    def parallel(self) -> ParallelConfig:
        """The group's layout, validated (an impossible combination names the fields)."""
        return ParallelConfig(**{name: getattr(self, name) for name in PARALLEL_FIELDS})

    @property
    def overlap_schedule(self) -> bool:
        """Whether the engine overlaps host scheduling with device steps.

        On by default on CUDA (``disable_overlap_schedule`` turns it off), off elsewhere
        unless ``force_overlap_schedule``; speculative decoding always runs without it.
        """
        if self.disable_overlap_schedule or self.spec_num_steps:
            return False
        return self.force_overlap_schedule or self.device.startswith("cuda")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.load_format != "dummy" and self.model == "":
            raise ValueError("model: a checkpoint directory or 'tiny' is required")
        if 0 < self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"chunked_prefill_size: found {self.chunked_prefill_size}, "
                f"expected <= 0 (off) or >= page_size {self.page_size}"
            )
        if self.disable_overlap_schedule and self.force_overlap_schedule:
            raise ValueError(
                "force_overlap_schedule: found it set together with disable_overlap_schedule, "
                "expected at most one of them"
            )
        self._check_attention()
        self._check_speculative()
        self._check_hicache()
        self.parallel  # noqa: B018 - validates the layout fields
        return self

    def _check_attention(self) -> None:
        name = self.attention_backend
        sizes = ATTENTION_PAGE_SIZES.get(name)
        if sizes is not None and self.page_size not in sizes:
            raise ValueError(
                f"attention_backend {name!r}: found page_size {self.page_size}, expected "
                f"{' or '.join(map(str, sizes))} (the pages its kernels read)"
            )
        if not ATTENTION_NEEDS_CUDA_BF16.get(name, False):
            return
        if not self.device.startswith("cuda"):
            raise ValueError(
                f"attention_backend {name!r}: found device {self.device!r}, expected a CUDA device"
            )
        if self.dtype == "float32":
            raise ValueError(
                f"attention_backend {name!r}: found dtype 'float32', expected 'auto' or 'bfloat16'"
            )

    def _check_hicache(self) -> None:
        given = [n for n in ("hicache_ratio", "hicache_size") if getattr(self, n) is not None]
        if not self.enable_hierarchical_cache:
            if given:
                raise ValueError(f"{given[0]}: set enable_hierarchical_cache to use it")
            return
        if len(given) > 1:
            raise ValueError("hicache_ratio and hicache_size: found both, expected at most one")
        if not self.enable_prefix_caching:
            raise ValueError(
                "enable_hierarchical_cache: found prefix caching disabled, expected it on "
                "(the host tier holds the prefix cache's evicted pages)"
            )
        if self.tp_size > 1:
            raise ValueError(
                f"enable_hierarchical_cache: found tp_size {self.tp_size}, expected 1 (the "
                f"host tier is not built for multi-rank groups)"
            )

    def host_tier_pages(self, device_pages: int, page_bytes: int) -> int:
        """Host-tier pages for a device pool of ``device_pages`` pages of ``page_bytes``
        bytes: ``hicache_size`` GB of pages, else ``hicache_ratio`` (default 2.0) times
        the pool; 0 when the hierarchical cache is off."""
        if not self.enable_hierarchical_cache:
            return 0
        if self.hicache_size is not None:
            return max(1, self.hicache_size * 10**9 // page_bytes)
        return max(1, int(device_pages * (self.hicache_ratio or DEFAULT_HICACHE_RATIO)))

    def _check_speculative(self) -> None:
        spec_fields = (
            "speculative_num_steps",
            "speculative_eagle_topk",
            "speculative_num_draft_tokens",
            "speculative_draft_model_quantization",
        )
        if self.speculative_algorithm is None:
            given = [name for name in spec_fields if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{given[0]}: set speculative_algorithm (NEXTN) to use it")
            return
        topk = self.speculative_eagle_topk
        if topk is not None and topk != 1:
            raise ValueError(
                f"speculative_eagle_topk: found {topk}, expected 1 (only chain drafts, "
                f"topk=1, are supported)"
            )
        draft_tokens, steps = self.speculative_num_draft_tokens, self.spec_num_steps
        if draft_tokens is not None and draft_tokens != steps + 1:
            raise ValueError(
                f"speculative_num_draft_tokens: found {draft_tokens}, expected "
                f"speculative_num_steps + 1 = {steps + 1} for a chain draft (topk=1)"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace, **extra: Any) -> EngineConfig:
        """The config from parsed ``dsv3serve`` engine flags; ``extra`` wins over a flag.

        Each flag in ``FLAG_FIELDS`` sets the field of its name, and
        ``--disable-prefix-caching`` clears ``enable_prefix_caching``.
        """
        fields = {name: getattr(args, name) for name in FLAG_FIELDS}
        fields["enable_prefix_caching"] = not args.disable_prefix_caching
        return cls(**(fields | extra))


FLAG_FIELDS = (  # engine flags (dsv3serve.cli) named exactly as their EngineConfig field
    "model",
    "load_format",
    "dtype",
    "device",
    "page_size",
    "num_kv_tokens",
    "mem_fraction_static",
    "cpu_kv_cache_space_gib",
    "kv_cache_dtype",
    "chunked_prefill_size",
    "max_running_requests",
    "max_num_batched_tokens",
    "moe_backend",
    "shared_experts_fusion",
    "attention_backend",
    "disable_cuda_graph",
    "cuda_graph_max_bs",
    "disable_overlap_schedule",
    "enable_torch_compile",
    "torch_compile_max_bs",
    "hf_overrides",
    "enable_hierarchical_cache",
    "hicache_ratio",
    "hicache_size",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_model_quantization",
    "disable_moe_dispatch_metrics",
    "disable_any_whitespace",
    *PARALLEL_FIELDS,
)
