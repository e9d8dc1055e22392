"""Turning an engine and its ranks into a group: the leader's wrapper and a follower's life.

Every rank (in-process, a spawned process or a Ray actor) has joined the process group
before it builds its model: building a sharded model agrees on the KV capacity with the
other ranks.
"""

from __future__ import annotations

from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine, resolve_model_dir
from dsv3serve.engine.group.dp import DPGroupLeader, dp_follower_loop
from dsv3serve.engine.group.tp import GroupLeader, follower_loop
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.scheduler.dp import DPScheduler
from dsv3serve.engine.speculative.dp_group import DPSpecFollower, DPSpecForwards
from dsv3serve.engine.speculative.group import GroupSpecForwards, SpecFollower


def attach_leader(engine: Engine) -> GroupLeader | DPGroupLeader:
    """Make ``engine`` (rank 0, group joined) drive its group; returns the leader runner.

    DP attention also gives the engine one scheduler per DP rank. Speculative decoding runs
    its forwards on every rank: broadcast under TP, split by DP rank under DP attention.
    """
    parallel, spec, runner = engine.cfg.parallel, engine.spec, engine.runner
    if not isinstance(runner, ModelRunner):
        raise TypeError(f"attach_leader: expected the engine's ModelRunner, found {runner!r}")
    if parallel.enable_dp_attention:
        scheduler = DPScheduler(engine.scheduler.config, parallel.dp_size)
        leader: GroupLeader | DPGroupLeader = DPGroupLeader(runner, scheduler)
        dp_forwards = (
            None if spec is None else DPSpecForwards(spec.runner, spec.draft, parallel.dp_size)
        )
        engine.use_runner(leader, scheduler, spec_forwards=dp_forwards)
    else:
        leader = GroupLeader(runner, parallel.world_size)
        forwards = None if spec is None else GroupSpecForwards(spec.runner, spec.draft)
        engine.use_runner(leader, spec_forwards=forwards)
    return leader


def build_runner(cfg: EngineConfig) -> ModelRunner:
    """This rank's shard of the model and its KV pool."""
    model_dir = resolve_model_dir(cfg)
    return ModelRunner(cfg, model_dir, ModelConfig.from_hf(model_dir))


def follow(runner: ModelRunner, cfg: EngineConfig) -> int:
    """Run rank 0's steps on ``runner`` until it stops the group; returns the steps run."""
    quant = cfg.speculative_draft_model_quantization
    if cfg.parallel.enable_dp_attention:
        dp_spec = DPSpecFollower(runner, quant) if cfg.spec_num_steps else None
        return dp_follower_loop(runner, None if dp_spec is None else dp_spec.handlers())
    if cfg.spec_num_steps:
        spec = SpecFollower(runner, quant, cfg.spec_num_steps)
        return follower_loop(runner, spec.handlers())
    return follower_loop(runner)


def run_follower(cfg: EngineConfig) -> int:
    """A follower rank's whole life: build its shard, follow, and on rank 0's STOP release
    what the group holds together (as rank 0 does, :meth:`GroupLeader.stop`)."""
    runner = build_runner(cfg)
    steps = follow(runner, cfg)
    runner.close()
    return steps
