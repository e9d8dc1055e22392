"""Device bytes of DeepEP's buffers, from the layout alone (no ``deep_ep`` import), so the
planner can count them and refuse a layout before anything is allocated.

The formulas follow DeepEP v1.2.1's published sizing (``csrc/config.hpp``:
``Config::get_nvl_buffer_size_hint`` and ``LowLatencyLayout``; the chunk sizes of
``Buffer.get_dispatch_config`` / ``get_combine_config``; ``Buffer.num_sms`` 20).
:class:`~dsv3serve.parallel.dispatch_deepep.DeepEPDispatcher` sizes its real buffer with
DeepEP's own hints and logs when they differ from these.

* **normal** (NVLink) buffer: per channel (``num_sms / 2``) and NVLink peer, a ring of
  ``num_max_nvl_chunked_recv_tokens`` rows (bf16 hidden, source metadata, 128 top-k ids,
  weights and scales) plus counters; at least 256 MiB, as SGLang sizes it.
* **low-latency** (RDMA, NVSHMEM) buffer: two send, two receive and two signalling
  buffers; the receive side holds ``num_experts * max_tokens_per_rank`` messages. It grows
  with the per-rank decode bound times the expert count: 3.8 GB per rank at 256 tokens,
  256 experts, hidden 7168.
* **low-latency activations** (torch memory, per MoE layer while it runs; a CUDA graph's
  pool keeps the largest): the ``[E_local, W * T, H]`` receive tensor (e4m3 + scales, or
  bf16), the masked MoE's intermediate and its bf16 output.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv3serve.config import ModelConfig
from dsv3serve.parallel.config import ParallelConfig

NUM_SMS = 20  # deep_ep.Buffer.num_sms
NVL_PEERS = 8  # NUM_MAX_NVL_PEERS
ALIGN = 128  # NUM_BUFFER_ALIGNMENT_BYTES
NORMAL_BUFFER_FLOOR = 1 << 28  # 256 MiB of NVLink buffer at least, as SGLang sizes it
MAX_TOPK_SLOTS, MAX_SCALE_SLOTS, SOURCE_META_BYTES = 128, 128, 8
# num_max_nvl_chunked_recv_tokens of DeepEP's recommended dispatch and combine configs
NVL_RECV_TOKENS = {2: 256, 4: 256, 8: 256, 16: 288, 24: 288, 32: 288, 64: 288, 128: 560}


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def normal_nvl_bytes(hidden: int, ranks: int) -> int:
    """The NVLink buffer of normal mode for bf16 rows of ``hidden`` over ``ranks`` ranks."""
    if ranks not in NVL_RECV_TOKENS:
        raise ValueError(f"DeepEP's normal mode takes {sorted(NVL_RECV_TOKENS)} ranks, got {ranks}")
    channels, nvl = NUM_SMS // 2, min(ranks, NVL_PEERS)
    rdma = max(ranks // NVL_PEERS, 1)
    row = 2 * hidden + SOURCE_META_BYTES + MAX_TOPK_SLOTS * 8 + MAX_TOPK_SLOTS * 4
    row += MAX_SCALE_SLOTS * 4
    n = channels * nvl * (2 * rdma + 3) * 4 + channels * nvl * NVL_RECV_TOKENS[ranks] * row
    return max(NORMAL_BUFFER_FLOOR, _round_up(n, ALIGN))


def low_latency_rdma_bytes(max_tokens: int, hidden: int, experts: int) -> int:
    """The NVSHMEM buffer of low-latency mode for ``max_tokens`` tokens per rank."""
    scales = hidden // 128
    dispatch_msg = 16 + max(2 * hidden, hidden + 4 * scales)
    combine_msg = 4 * scales + 2 * hidden
    send = max(max_tokens * dispatch_msg, experts * max_tokens * combine_msg)
    recv = experts * max_tokens * max(dispatch_msg, combine_msg)
    signal = _round_up(experts * 4, ALIGN)
    total = 2 * (send + recv + signal)
    return (total + ALIGN) // ALIGN * ALIGN


def low_latency_activation_bytes(
    max_tokens: int, hidden: int, experts: int, ranks: int, inter: int, fp8: bool
) -> int:
    """One MoE layer's low-latency tensors on a rank: the received rows, the masked MoE's
    intermediate (``inter`` per expert on this rank) and its bf16 output."""
    rows = experts // ranks * ranks * max_tokens
    if fp8:
        # e4m3 rows, their scales (as received and a contiguous copy), e4m3 intermediate
        return rows * (hidden + 2 * (hidden // 32) + inter + inter // 32 + 2 * hidden)
    return rows * (2 * hidden + 2 * inter + 2 * hidden)


@dataclass(frozen=True)
class DeepEPBytes:
    """A rank's DeepEP memory: ``nvl`` (normal mode), ``rdma`` (low-latency, NVSHMEM)
    and ``activations`` (low-latency, per MoE layer)."""

    nvl: int
    rdma: int
    activations: int

    @property
    def total(self) -> int:
        return self.nvl + self.rdma + self.activations


def deepep_bytes(
    mode: str, hidden: int, experts: int, ranks: int, inter: int, max_tokens: int, fp8: bool
) -> DeepEPBytes:
    """The buffers ``deepep_mode`` ``mode`` allocates (``normal`` no low-latency part,
    ``low_latency`` no NVLink part, ``auto`` both), ``max_tokens`` the per-rank decode
    bound (``max_running_requests``)."""
    low = mode != "normal"
    return DeepEPBytes(
        nvl=normal_nvl_bytes(hidden, ranks) if mode != "low_latency" else 0,
        rdma=low_latency_rdma_bytes(max_tokens, hidden, experts) if low else 0,
        activations=(
            low_latency_activation_bytes(max_tokens, hidden, experts, ranks, inter, fp8)
            if low
            else 0
        ),
    )


def planned_deepep(
    model_cfg: ModelConfig, parallel: ParallelConfig, max_running_requests: int
) -> DeepEPBytes | None:
    """DeepEP's buffers on each rank under ``moe_a2a_backend`` ``deepep`` (None otherwise):
    the low-latency part sized by ``max_running_requests`` per rank; rows travel as e4m3
    with an FP8 checkpoint (the engine's default activation quantisation)."""
    if parallel.moe_a2a_backend != "deepep" or parallel.ep_size == 1:
        return None
    moe_tp = max(parallel.tp_size // parallel.ep_size, 1)
    return deepep_bytes(
        parallel.deepep_mode,
        model_cfg.hidden_size,
        model_cfg.n_routed_experts,
        parallel.ep_size,
        model_cfg.moe_intermediate_size // moe_tp,
        max_running_requests,
        model_cfg.quant_method == "fp8",
    )
