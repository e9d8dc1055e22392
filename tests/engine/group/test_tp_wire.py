"""The group's command wire (``dsv3serve/engine/group/tp.py`` ``Wire``) between two real gloo
ranks joined by ``init_group``: commands (header and host payload) travel on the gloo
control group, device tensors on the default group.

On CPU both groups are gloo, so a wire that sent its commands on the default group would
deliver them just as well; each rank therefore records the group of every broadcast the
wire makes (``torch.distributed.broadcast`` wrapped in the spawned rank) besides checking
what arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from dispatch_util import save_rank_results, spawn_for_results

from dsv3serve.engine.group.tp import OP_STEP, OP_STOP, GroupSpec, Wire, control_group, init_group

PAYLOAD = [7, 0, -3, 2**40, 5]
DEVICE_IDS = [11, 12, 13]


def _group_name(group: dist.ProcessGroup | None) -> str:
    control = control_group()
    if control is not None and group is control:
        return "control"
    if group is None or group is dist.group.WORLD:
        return "default"
    return f"other: {group}"


def _recording(calls: list[str]) -> Callable[..., object]:
    """``dist.broadcast`` that appends the name of each call's group to ``calls``."""
    broadcast = dist.broadcast

    def recorded(tensor: torch.Tensor, src: int, group: object = None, **kw: object) -> object:
        calls.append(_group_name(group))  # type: ignore[arg-type]
        return broadcast(tensor, src, group=group, **kw)  # type: ignore[arg-type]

    return recorded


def _wire_rank(rank: int, workdir: str) -> None:
    torch.set_num_threads(1)
    root = Path(workdir)
    init_group(GroupSpec(rank, 2, "", 0, "gloo", 60.0, f"file://{root / 'pg'}"))
    control = control_group()
    results: dict[str, object] = {
        "control_is_its_own_gloo_group": control is not None
        and control is not dist.group.WORLD
        and dist.get_backend(control) == "gloo"
        and dist.get_world_size(control) == 2,
    }
    calls: list[str] = []
    dist.broadcast = _recording(calls)  # this spawned rank's only
    wire = Wire(torch.device("cpu"))
    if rank == 0:
        wire.send(OP_STEP, torch.tensor(PAYLOAD))
        wire.send_device(torch.tensor(DEVICE_IDS))
        wire.send(OP_STOP)
    else:
        op, n = wire.recv_header()
        results["step"] = (op, n, wire.recv(n).tolist())
        results["device"] = wire.recv_device(len(DEVICE_IDS), torch.int64).tolist()
        results["stop"] = wire.recv_header()
    results["calls"] = calls
    save_rank_results(results, root, rank)
    dist.destroy_process_group()


def test_commands_go_on_the_control_group_and_device_tensors_on_the_default(
    tmp_path: Path,
) -> None:
    leader, follower = spawn_for_results(_wire_rank, (str(tmp_path),), 2, tmp_path)
    assert leader["control_is_its_own_gloo_group"] and follower["control_is_its_own_gloo_group"]
    assert follower["step"] == (OP_STEP, len(PAYLOAD), PAYLOAD)
    assert follower["device"] == DEVICE_IDS
    assert follower["stop"] == (OP_STOP, 0)
    # header + payload, the device ids, a header alone: the same order on both ranks
    expected = ["control", "control", "default", "control"]
    assert leader["calls"] == expected and follower["calls"] == expected
