"""Compare the FP8 kernel path of a model with its dequantised reference, teacher-forced.

The fast runner keeps the checkpoint's e4m3 weights and quantises activations per
(token, 128 channels); the reference runner holds the very same weights dequantised to the
compute dtype (:func:`dequantize_model_`) and runs without activation quantisation, on the
torch attention and MoE backends. Both see identical inputs: the prompts as one batched
prefill, then decode steps fed with the *reference's* greedy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.model_runner import ModelRunner, kv_slots
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kernels.fp8_ref import dequant_weight_block
from dsv3serve.layers.linear import Linear
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsv3serve.moe.experts import FusedExperts

PAGE_SIZE = 16


def _dequant_stack(w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [.., N, K] with block scales [.., N/128, K/128] -> ``dtype``, one matrix at a
    time (a full-width expert stack in float32 would be 30 GB)."""
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    flat_out, flat_w = out.view(-1, *w.shape[-2:]), w.view(-1, *w.shape[-2:])
    for o, m, sc in zip(flat_out, flat_w, s.view(-1, *s.shape[-2:]), strict=True):
        o.copy_(dequant_weight_block(m, sc))
    return out


def _dequant_param(module: nn.Module, weight: str, scale: str, dtype: torch.dtype) -> None:
    s = getattr(module, scale)
    if s is None:
        return
    deq = _dequant_stack(getattr(module, weight).data, s.data, dtype)
    setattr(module, weight, nn.Parameter(deq, requires_grad=False))
    setattr(module, scale, None)


@torch.no_grad()
def dequantize_model_(model: DeepseekV3ForCausalLM, dtype: torch.dtype) -> int:
    """Replace every e4m3 weight (linears and stacked experts) by its real values in
    ``dtype``, drop the block scales and switch activation quantisation off; then redo
    ``post_load`` (packed q_a/kv_a GEMM, absorbed W_UK / W_UV). Returns the tensors converted.
    """
    converted = 0
    for module in model.modules():
        if isinstance(module, Linear):
            converted += int(module.is_fp8)
            _dequant_param(module, "weight", "weight_scale_inv", dtype)
            module.act_quant = False
        elif isinstance(module, FusedExperts):
            converted += 2 * int(module.is_fp8)
            _dequant_param(module, "w13", "w13_scale_inv", dtype)
            _dequant_param(module, "w2", "w2_scale_inv", dtype)
    model.post_load()
    return converted


def make_runner(
    model_cfg: ModelConfig,
    device: str,
    attention: str,
    moe: str,
    act_quant: bool,
    tokens: int,
    fusion: str = "auto",
) -> ModelRunner:
    """A runner with dummy weights (seed 0) and room for ``tokens`` KV slots."""
    cfg = EngineConfig(
        model="fp8-compare",
        load_format="dummy",
        device=device,
        page_size=PAGE_SIZE,
        num_kv_tokens=tokens,
        enable_prefix_caching=False,
        attention_backend=attention,
        moe_backend=moe,
        fp8_act_quant=act_quant,
        shared_experts_fusion=fusion,
    )
    return ModelRunner(cfg, None, model_cfg)


def shared_expert_fused(runner: ModelRunner) -> bool:
    """Whether the runner's MoE layers hold the shared expert as expert E of the stack."""
    routed = runner.model_cfg.n_routed_experts
    state = runner.model.state_dict()
    return any(k.endswith("experts.w13") and v.shape[0] > routed for k, v in state.items())


def make_reference(fast: ModelRunner, tokens: int) -> ModelRunner:
    """Torch backends, no activation quantisation, the fast runner's weights dequantised."""
    fusion = "on" if shared_expert_fused(fast) else "off"  # same weight layout as ``fast``
    ref = make_runner(fast.model_cfg, str(fast.device), "torch", "torch", False, tokens, fusion)
    ref.model.load_state_dict(fast.model.state_dict())
    dequantize_model_(ref.model, ref.dtype)
    return ref


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` over all elements, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


@dataclass
class Comparison:
    """Logits of both paths, per phase: prefill rows (every prompt position), decode rows."""

    fast: dict[str, list[torch.Tensor]] = field(
        default_factory=lambda: {"prefill": [], "decode": []}
    )
    ref: dict[str, list[torch.Tensor]] = field(
        default_factory=lambda: {"prefill": [], "decode": []}
    )

    def add(self, phase: str, fast: torch.Tensor, ref: torch.Tensor) -> None:
        self.fast[phase].append(fast.float())
        self.ref[phase].append(ref.float())

    def rows(self, phase: str) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.fast[phase]), torch.cat(self.ref[phase])

    def stats(self, phase: str) -> dict[str, float]:
        """Relative error, top-1 agreement and the reference logits' spread."""
        a, b = self.rows(phase)
        top2 = b.topk(2, dim=-1).values
        return {
            "rows": float(b.shape[0]),
            "rel_err": rel_err(a, b),
            "max_row_rel_err": float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max()),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "ref_row_std": float(b.std(dim=-1).mean()),
            "ref_top1_gap": float((top2[:, 0] - top2[:, 1]).mean()),
            "finite": float(bool(torch.isfinite(a).all() and torch.isfinite(b).all())),
        }


def _seq_slots(seq_index: int, length: int, max_len: int) -> list[int]:
    """Slots of a sequence given pages ``seq_index * pages_per_seq ..`` (contiguous)."""
    per_seq = -(-max_len // PAGE_SIZE)
    pages = list(range(seq_index * per_seq, (seq_index + 1) * per_seq))
    return kv_slots(pages, PAGE_SIZE, length)


def _prefill_all_rows(runner: ModelRunner, spans: list[SeqSpan]) -> torch.Tensor:
    """Logits [T, V] at every prompt position (the runner itself keeps only the last)."""
    batch = ForwardBatch.build(spans, runner.device)
    hidden = runner.model(batch, runner.attn)
    return runner.model.compute_logits(hidden)


def compare(
    fast: ModelRunner, ref: ModelRunner, prompts: list[list[int]], decode_steps: int
) -> Comparison:
    """Prefill ``prompts`` in one batch on both runners, then ``decode_steps`` batched decode
    steps fed with the reference's greedy tokens; collect the logits of both."""
    max_len = max(len(p) for p in prompts) + decode_steps
    seqs = [list(p) for p in prompts]
    spans = [SeqSpan(p, 0, _seq_slots(i, len(p), max_len)) for i, p in enumerate(seqs)]
    out = Comparison()
    ref_logits = _prefill_all_rows(ref, spans)
    out.add("prefill", _prefill_all_rows(fast, spans), ref_logits)
    ends = torch.tensor([len(p) for p in prompts], device=ref_logits.device).cumsum(0) - 1
    last = ref_logits[ends]
    for _ in range(decode_steps):
        for seq, row in zip(seqs, last, strict=True):
            seq.append(int(row.argmax()))
        spans = [
            SeqSpan([s[-1]], len(s) - 1, _seq_slots(i, len(s), max_len)) for i, s in enumerate(seqs)
        ]
        last = ref.run_spans(spans, None).logits
        out.add("decode", fast.run_spans(spans, None).logits, last)
    return out


def kv_tokens_needed(prompts: list[list[int]], decode_steps: int) -> int:
    """KV slots :func:`compare` addresses (whole pages per sequence)."""
    max_len = max(len(p) for p in prompts) + decode_steps
    return len(prompts) * -(-max_len // PAGE_SIZE) * PAGE_SIZE
