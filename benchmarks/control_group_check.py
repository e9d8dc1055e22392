"""The group wire's two channels on this host, before a group run: two ranks join through
``init_group`` (NCCL + its gloo control group on CUDA, gloo + gloo on CPU), rank 0 sends
commands (header + host payload) and device tensors, rank 1 checks what arrives, and the
round trip of one command is timed. Prints one JSON line; exits non-zero when a rank fails.

    python benchmarks/control_group_check.py [--device cuda|cpu] [--rounds 200] [--commands-only]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv3serve.engine.group.tp import GroupSpec, Wire, init_group

PAYLOAD = 512  # int64 values: about a decode step's spans at 64 sequences


def _rank(rank: int, device: str, rendezvous: str, rounds: int, out: str, ids_too: bool) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    init_group(GroupSpec(rank, 2, "", 0, backend, 120.0, f"file://{rendezvous}"))
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    wire = Wire(dev)
    ids = torch.arange(64, dtype=torch.int64, device=dev)
    t0 = time.perf_counter()
    for i in range(rounds):
        if rank == 0:
            wire.send(7, torch.full((PAYLOAD,), i, dtype=torch.int64))
            if ids_too:
                wire.send_device(ids + i)
        else:
            op, n = wire.recv_header()
            got = wire.recv(n)
            if op != 7 or n != PAYLOAD or not bool((got == i).all()):
                raise RuntimeError(f"round {i}: op {op}, n {n}: wrong command")
            if ids_too and not bool(
                (wire.recv_device(64, torch.int64).cpu() == ids.cpu() + i).all()
            ):
                raise RuntimeError(f"round {i}: wrong ids")
    if device == "cuda":
        torch.cuda.synchronize()
    per_round_us = 1e6 * (time.perf_counter() - t0) / rounds
    if rank == 0:
        Path(out).write_text(json.dumps({"device": device, "rounds": rounds, "us": per_round_us}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--commands-only", action="store_true", help="no device tensors")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        rendezvous = str(Path(tmp) / "rendezvous")
        ids_too = not args.commands_only
        mp.spawn(_rank, args=(args.device, rendezvous, args.rounds, out, ids_too), nprocs=2)
        result = json.loads(Path(out).read_text())
    what = "one command (header + 512 int64)" + (" + 64 ids" if ids_too else "")
    print(json.dumps(result | {"per_round": what}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
