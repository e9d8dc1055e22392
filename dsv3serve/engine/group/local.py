"""A worker group on this host without Ray: ``LLM(..., tp_size=2)`` and the CLI start it.

Rank 0 is the calling process; ranks 1..N-1 are child processes (forked from a server that
imported the engine once, or spawned: :mod:`dsv3serve.engine.group.rank_start`), one device
each (``cuda:r`` on GPU, the CPU with gloo otherwise). All ranks join one process group over
a rendezvous file, build their shard of the model, and follow rank 0's steps
(:mod:`dsv3serve.engine.group.tp` for TP, :mod:`dsv3serve.engine.group.dp` under DP
attention) until it stops them.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.group.rank_start import adopt_environ, caller_environ, rank_context
from dsv3serve.engine.group.tp import GroupSpec, init_group, rank_timeout_s
from dsv3serve.settings import Settings

FOLLOWER_JOIN_TIMEOUT_S = 600.0
FOLLOWER_KILL_WAIT_S = 10.0


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    """Rank ``rank``'s config: its own CUDA device (``cuda:r``) when the group is on GPU."""
    if not cfg.device.startswith("cuda"):
        return cfg
    return cfg.model_copy(update={"device": f"cuda:{rank}"})


def group_spec(cfg: EngineConfig, rank: int, rendezvous: Path, timeout_s: float) -> GroupSpec:
    """Where rank ``rank`` meets the others (a file rendezvous on this host); ``timeout_s``
    is the group timeout (rank 0's; followers wait for rank 0 as long as it idles)."""
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    timeout = rank_timeout_s(rank, timeout_s)
    return GroupSpec(rank, cfg.tp_size, "", 0, backend, timeout, f"file://{rendezvous}")


def _diagnosable(log_level: int) -> None:
    """A spawned rank logs like its leader and dumps every thread's stack on SIGUSR1, and
    every ``$DSV3SERVE_RANK_STACKS_S`` seconds when that is set (a stalled group then shows
    where each rank waits)."""
    logging.basicConfig(level=log_level, format="%(asctime)s rank %(process)d %(name)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    every = Settings.from_env().rank_stacks_s
    if every:
        faulthandler.dump_traceback_later(every, repeat=True)


def _follow(
    cfg_json: str,
    rank: int,
    rendezvous: str,
    timeout_s: float,
    threads: int,
    log_level: int,
    environ: dict[str, str],
) -> None:
    from dsv3serve.engine.group.rank import run_follower

    adopt_environ(environ)
    _diagnosable(log_level)
    if threads:
        torch.set_num_threads(threads)
    cfg = rank_config(EngineConfig.model_validate_json(cfg_json), rank)
    init_group(group_spec(cfg, rank, Path(rendezvous), timeout_s))
    run_follower(cfg)
    dist.destroy_process_group()


@dataclass
class LocalGroup:
    """Rank 0's handle on its spawned followers."""

    processes: list[Any]
    workdir: Any

    def join(self, timeout_s: float = FOLLOWER_JOIN_TIMEOUT_S) -> None:
        """Wait for the followers to exit (after the leader's STOP) and leave the group."""
        if dist.is_initialized():
            dist.destroy_process_group()
        for proc in self.processes:
            proc.join(timeout_s)
        failed = [p.exitcode for p in self.processes if p.exitcode != 0]
        self.workdir.cleanup()
        if failed:
            raise RuntimeError(f"group ranks exited with codes {failed}")

    def kill(self) -> None:
        """After a failure on rank 0: the followers may be waiting in a collective that will
        never come, so they are killed rather than stopped, then the group is left."""
        for proc in self.processes:
            proc.kill()
        for proc in self.processes:
            proc.join(FOLLOWER_KILL_WAIT_S)
        if dist.is_initialized():  # abort: a destroy can block on a communicator whose
            # peers are gone, or that CUDA graphs still hold (seen on two H100s)
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            (abort or dist.destroy_process_group)()
        self.workdir.cleanup()


def spawn_followers(cfg: EngineConfig, timeout_s: float = 600.0, threads: int = 1) -> LocalGroup:
    """Start ranks 1..N-1 and join rank 0 (this process) to their process group."""
    workdir = tempfile.TemporaryDirectory(prefix="dsv3serve-group-")
    rendezvous = Path(workdir.name) / "rendezvous"
    ctx = rank_context()
    level = logging.getLogger().getEffectiveLevel()
    environ = caller_environ()
    procs = [
        ctx.Process(  # type: ignore[attr-defined]
            target=_follow,
            args=(cfg.model_dump_json(), rank, str(rendezvous), timeout_s, threads, level, environ),
            daemon=True,
        )
        for rank in range(1, cfg.tp_size)
    ]
    for proc in procs:
        proc.start()
    init_group(group_spec(rank_config(cfg, 0), 0, rendezvous, timeout_s))
    return LocalGroup(procs, workdir)
