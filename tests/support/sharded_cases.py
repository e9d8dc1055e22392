"""Scenarios for the sharded-model tests: the steps each DP group runs, the single-rank
reference, and the per-rank worker that spawned gloo processes run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from model_utils import load_ours, make_attn, scattered_slots
from shard_util import GatherAllDispatcher, copy_shards_from_full, read_full_checkpoint

from dsv3serve.config import ModelConfig
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, MLAttention, ModelOptions
from dsv3serve.moe.experts import FusedExperts
from dsv3serve.parallel.comm import GroupComm
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.shard import RankLayout, placement_of

DTYPE = torch.float32
Span = tuple[int, list[int], int]  # (sequence id, new token ids, start position)
Step = list[list[Span]]  # the spans of each DP group (one group under TP)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def tp_steps() -> list[Step]:
    """Prefill two prompts, a mixed extend + decode step (MHA form), two decode steps."""
    a, b = _tokens(7, 1), _tokens(4, 2)
    return [
        [[(0, a[:5], 0), (1, b[:3], 0)]],
        [[(0, a[5:7], 5), (1, b[3:4], 3)]],
        [[(0, _tokens(1, 3), 7), (1, _tokens(1, 4), 4)]],
        [[(0, _tokens(1, 5), 8), (1, _tokens(1, 6), 5)]],
    ]


def dp_steps() -> list[Step]:
    """Different sequences on the two DP ranks; rank 1, then rank 0, idle for one step."""
    return [
        [[(0, _tokens(5, 11), 0), (1, _tokens(3, 12), 0)], [(2, _tokens(4, 13), 0)]],
        [[(0, _tokens(1, 14), 5), (1, _tokens(1, 15), 3)], [(2, _tokens(1, 16), 4)]],
        [[(0, _tokens(1, 17), 6)], []],
        [[], [(2, _tokens(1, 18), 5)]],
    ]


@dataclass(frozen=True)
class Case:
    """One layout run on one checkpoint; ``break_o_proj_reduce`` drops the attention
    all-reduce on purpose (the comparison must then fail)."""

    name: str
    parallel: ParallelConfig
    model_dir: str
    steps: list[Step] = field(default_factory=tp_steps)
    break_o_proj_reduce: bool = False
    act_quant: bool = True  # FP8 checkpoints: quantise activations per 128 channels


def build_batch(spans: list[Span]) -> ForwardBatch:
    """A slot-list batch of ``spans`` with logits at every new token."""
    seq_spans = [
        SeqSpan(toks, start, scattered_slots(seq, start + len(toks))) for seq, toks, start in spans
    ]
    batch = ForwardBatch.build(seq_spans, "cpu")
    batch.logits_indices = torch.arange(batch.num_tokens)
    return batch


def run_steps(model: DeepseekV3ForCausalLM, steps: list[list[Span]]) -> list[torch.Tensor]:
    """Logits [tokens, V] of every step, the KV cache kept between steps."""
    attn, out = make_attn(model), []
    for spans in steps:
        batch = build_batch(spans)
        out.append(model.compute_logits(model(batch, attn)[batch.logits_indices]))
    return out


def reference_logits(case: Case) -> list[list[torch.Tensor]]:
    """[step][group] logits of the single-rank model, all groups' spans in one batch."""
    model = load_ours(Path(case.model_dir), dtype=DTYPE, fp8_act_quant=case.act_quant)
    flat = [[s for group in step for s in group] for step in case.steps]
    out = []
    for step, logits in zip(case.steps, run_steps(model, flat), strict=True):
        sizes = [sum(len(toks) for _, toks, _ in group) for group in step]
        out.append(list(logits.split(sizes)))
    return out


def build_rank_model(case: Case, rank: int, comm: GroupComm) -> DeepseekV3ForCausalLM:
    cfg = ModelConfig.from_hf(Path(case.model_dir))
    layout = RankLayout(case.parallel, rank)
    dispatcher = None
    if case.parallel.enable_dp_attention and case.parallel.ep_size > 1:
        dispatcher = GatherAllDispatcher(comm, layout, cfg.n_routed_experts)
    opts = ModelOptions(dtype=DTYPE, fp8_act_quant=case.act_quant, layout=layout)
    return DeepseekV3ForCausalLM(cfg, opts, comm, dispatcher)


def _held_bytes(model: DeepseekV3ForCausalLM, full: dict[str, torch.Tensor]) -> int:
    """Bytes of the checkpoint slices this rank holds, by placement_of (model dtypes)."""
    layout, total = model.opts.layout, 0
    assert layout is not None
    for name, t in full.items():
        placement = placement_of(name, layout, model.cfg.n_routed_experts)
        if name.startswith(model.ignored_checkpoint_names()) or not placement.held:
            continue
        dtype = DTYPE if t.dtype == torch.bfloat16 else t.dtype
        numel = torch.Size(placement.local_shape(tuple(t.shape))).numel()
        total += numel * (1 if dtype == FP8_DTYPE else torch.empty((), dtype=dtype).element_size())
    return total


def shard_facts(model: DeepseekV3ForCausalLM, full: dict[str, torch.Tensor]) -> dict:
    stacks = [m for m in model.modules() if isinstance(m, FusedExperts)]
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "held_bytes": _held_bytes(model, full),
        "stack_slots": sorted({m.w13.shape[0] for m in stacks}),
        "stack_experts": sorted({(m.first_expert, m.num_experts) for m in stacks}),
    }


def rank_worker(rank: int, cases: list[Case], result_dir: str) -> None:
    """Build this rank's shard of each case, fill it, run its DP group's steps, save."""
    comm, fulls = GroupComm(), {}
    for case in cases:
        full = fulls.setdefault(case.model_dir, read_full_checkpoint(Path(case.model_dir)))
        model = build_rank_model(case, rank, comm)
        copy_shards_from_full(model, full)
        if case.break_o_proj_reduce:
            for m in model.modules():
                if isinstance(m, MLAttention):
                    m.reduce = False
        group = model.opts.layout.dp_rank  # type: ignore[union-attr]
        logits = run_steps(model, [step[group] for step in case.steps])
        result = {"logits": logits, "group": group, **shard_facts(model, full)}
        torch.save(result, Path(result_dir) / f"{case.name}-rank{rank}.pt")
