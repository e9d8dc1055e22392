"""On a GPU: the collectives a graphed group step uses can be captured in a CUDA graph over
NCCL, with the group's fault settings (blocking wait), and replays equal eager runs.

One GPU makes a one-rank NCCL group, so the values are trivial sums; what this checks is that
capture works at all through ``GroupComm`` and the all-gather dispatcher (a host sync or a
blocking wait inside capture raises), and that replays read new inputs. The cross-GPU values
are the multi-GPU run's (issue 16); CPU tests cover them over gloo.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

from dsv3serve.engine.group.tp import GroupSpec, init_group  # noqa: E402
from dsv3serve.parallel.comm import GroupComm  # noqa: E402
from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher  # noqa: E402
from dsv3serve.parallel.dispatch_gather import UniformGatherDispatcher  # noqa: E402
from dsv3serve.parallel.uniform import uniform_batch  # noqa: E402

ROWS, HIDDEN, EXPERTS, TOPK = 8, 256, 4, 2


@pytest.fixture(scope="module")
def nccl_group():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    init_group(GroupSpec(0, 1, "127.0.0.1", port, "nccl", timeout_s=60))
    yield GroupComm()
    dist.destroy_process_group()


def _step(comm: GroupComm, d: UniformGatherDispatcher, x, ids, w, mats) -> torch.Tensor:
    """One group step's collectives: TP all-reduce, lm-head gathers, MoE gather/scatter."""
    with uniform_batch(ROWS):
        h = comm.all_reduce(x.clone())
        rows, _ = comm.all_gather_rows(h)
        h = comm.all_gather(rows, dim=-1)[:, :HIDDEN]
        sent = d.dispatch(h, ids, w)
        safe = sent.topk_ids.clamp(min=0)
        per = torch.einsum("rh,rkhd->rkd", sent.x, mats[safe])
        y = (per * sent.topk_weights[..., None]).sum(1).to(h.dtype)
        return d.combine(y, sent)


def test_group_step_collectives_capture_and_replay(nccl_group: GroupComm) -> None:
    comm = nccl_group
    assert comm.graph_safe
    d = UniformGatherDispatcher(AllToAllDispatcher(EXPERTS), comm)
    dev = torch.device("cuda")
    mats = torch.randn(EXPERTS, HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16) / 16
    x = torch.randn(ROWS, HIDDEN, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, EXPERTS, (ROWS, TOPK), device=dev)
    w = torch.rand(ROWS, TOPK, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(comm, d, x, ids, w, mats)  # warm-up, as GraphCache does
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(comm, d, x, ids, w, mats)
    for _ in range(3):  # new inputs each replay
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randint(0, EXPERTS, ids.shape, device=dev))
        graph.replay()
        torch.cuda.synchronize()
        want = _step(comm, d, x, ids, w, mats)
        assert torch.allclose(out.float(), want.float(), atol=1e-2, rtol=1e-2)
