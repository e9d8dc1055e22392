"""Sharded streaming loading: each rank's slices against the full tensors (get_tensor)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rank_procs import start_ranks
from safetensors import safe_open
from shard_standin import ALIGNED_TP2, SMALL, LocalShapeStandIn, nextn_copies

from dsv3serve.model import shard_load
from dsv3serve.model.tiny import make_tiny_checkpoint
from dsv3serve.model.weights import WeightLoadError, init_dummy, load_checkpoint, shard_files
from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.shard import RankLayout

LAYOUTS = {
    "tp2": ParallelConfig(tp_size=2),
    "tp2_ep2": ParallelConfig(tp_size=2, ep_size=2),
    "dp2_ep2": ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2),
    "dp2_ep2_dp_head": ParallelConfig(
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        ep_size=2,
        moe_dense_tp_size=1,
        enable_dp_lm_head=True,
    ),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "fp8": make_tiny_checkpoint(root / "fp8", fp8=True, num_shards=3, overrides=ALIGNED_TP2),
        "bf16": make_tiny_checkpoint(root / "bf16", fp8=False, num_shards=2, overrides=SMALL),
        "fp8_unaligned": make_tiny_checkpoint(root / "fp8u", fp8=True, overrides=SMALL),
    }


def full_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The reference: every tensor whole, read with get_tensor."""
    out: dict[str, torch.Tensor] = {}
    for file in shard_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = f.get_tensor(name)
    return out


def load_ranks(model_dir: Path, parallel: ParallelConfig) -> list[LocalShapeStandIn]:
    models = []
    for rank in range(parallel.world_size):
        model = LocalShapeStandIn(model_dir, RankLayout(parallel, rank))
        load_checkpoint(model, model_dir, RankLayout(parallel, rank))
        models.append(model)
    return models


def pieces_of(models: list[LocalShapeStandIn], name: str) -> list[torch.Tensor]:
    return [m.targets[name].view() for m in models if name in m.targets]


def assert_pieces_make_full(name: str, pieces: list[torch.Tensor], full: torch.Tensor) -> None:
    """Whole copies equal the tensor; slices differ from it in one dim and, concatenated
    in rank order along it, give it back exactly."""
    assert pieces, f"{name}: held by no rank"
    if all(p.shape == full.shape for p in pieces):
        for p in pieces:
            assert torch.equal(p.view(torch.uint8), full.view(torch.uint8)), name
        return
    (dim,) = [d for d in range(full.dim()) if pieces[0].shape[d] != full.shape[d]]
    joined = torch.cat([p.view(torch.uint8) for p in pieces], dim)
    assert torch.equal(joined, full.view(torch.uint8)), name


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rank_slices_reassemble_every_tensor(ckpts, dtype: str, layout: str) -> None:
    model_dir, parallel = ckpts[dtype], LAYOUTS[layout]
    models = load_ranks(model_dir, parallel)
    skip = nextn_copies(models[0].cfg)
    for name, full in full_tensors(model_dir).items():
        if not name.startswith(skip):
            assert_pieces_make_full(name, pieces_of(models, name), full)
    for m in models:
        assert m.post_load_calls == 1
        for key, p in m.params.items():
            assert not p.float().isnan().any(), f"{key}: part left unloaded"


def test_slices_follow_the_published_layout(ckpts) -> None:
    """Spot checks written from the layout description, not from placement_of."""
    full = full_tensors(ckpts["fp8"])
    tp = load_ranks(ckpts["fp8"], LAYOUTS["tp2"])
    q_b = "model.layers.1.self_attn.q_b_proj.weight"
    o = "model.layers.1.self_attn.o_proj.weight"
    down = "model.layers.2.mlp.experts.5.down_proj.weight"
    rows, cols = full[q_b].shape[0] // 2, full[o].shape[1] // 2
    assert torch.equal(_bytes(tp[1].targets[q_b].view()), _bytes(full[q_b][rows:]))
    scale = full[q_b + "_scale_inv"][rows // 128 :]
    assert torch.equal(tp[1].targets[q_b + "_scale_inv"].view(), scale)
    assert torch.equal(_bytes(tp[1].targets[o].view()), _bytes(full[o][:, cols:]))
    half = full[down].shape[1] // 2
    assert torch.equal(_bytes(tp[0].targets[down].view()), _bytes(full[down][:, :half]))
    ep = load_ranks(ckpts["fp8"], LAYOUTS["dp2_ep2"])
    stack = ep[1].params["model__layers__2__down_proj__weight"]
    for slot, expert in enumerate(range(8, 16)):
        ref = full[f"model.layers.2.mlp.experts.{expert}.down_proj.weight"]
        assert torch.equal(_bytes(stack[slot]), _bytes(ref))
    assert torch.equal(ep[1].targets["lm_head.weight"].view(), full["lm_head.weight"][256:])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_layout_none_loads_everything_whole(ckpts) -> None:
    model = LocalShapeStandIn(ckpts["fp8"], None)
    load_checkpoint(model, ckpts["fp8"])
    for name, full in full_tensors(ckpts["fp8"]).items():
        if name in model.targets:
            assert torch.equal(_bytes(model.targets[name].view()), _bytes(full)), name


class SpyHandle:
    """Wraps a real safe_open handle; records which tensors are read and how."""

    def __init__(self, handle: Any, log: list[tuple[str, str]]) -> None:
        self.handle, self.log = handle, log

    def get_tensor(self, name: str) -> torch.Tensor:
        self.log.append(("tensor", name))
        return self.handle.get_tensor(name)

    def get_slice(self, name: str) -> Any:
        self.log.append(("slice", name))
        return self.handle.get_slice(name)


def spy_safe_open(monkeypatch, log: list[tuple[str, str]]) -> None:
    real = shard_load.safe_open

    class Opened:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.ctx = real(*args, **kwargs)

        def __enter__(self) -> SpyHandle:
            return SpyHandle(self.ctx.__enter__(), log)

        def __exit__(self, *exc: Any) -> None:
            self.ctx.__exit__(*exc)

    monkeypatch.setattr(shard_load, "safe_open", Opened)


@pytest.mark.parametrize("layout", ["tp2", "dp2_ep2"])
def test_rank_reads_only_what_it_holds(ckpts, monkeypatch, layout: str) -> None:
    parallel, log = LAYOUTS[layout], []
    spy_safe_open(monkeypatch, log)
    model = LocalShapeStandIn(ckpts["fp8"], RankLayout(parallel, 1))
    load_checkpoint(model, ckpts["fp8"], RankLayout(parallel, 1))
    full = full_tensors(ckpts["fp8"])
    read = [name for _, name in log]
    assert sorted(read) == sorted(model.targets), "read exactly the held tensors, once each"
    for how, name in log:
        split = tuple(model.targets[name].view().shape) != tuple(full[name].shape)
        assert how == ("slice" if split else "tensor"), f"{name} read with {how}"
    if parallel.ep_size == 2:
        other = [n for n in read if ".mlp.experts." in n and int(n.split(".")[5]) < 8]
        assert not other, f"rank 1 read experts of rank 0: {other[:3]}"


def test_fp8_split_off_a_128_boundary_is_refused_before_reading(ckpts, monkeypatch) -> None:
    log: list[tuple[str, str]] = []
    spy_safe_open(monkeypatch, log)
    layout = RankLayout(LAYOUTS["tp2"], 0)
    model = LocalShapeStandIn(ckpts["fp8_unaligned"], layout)
    # o_proj's input columns, 4 heads x 32 = 128, come first in the file: 64 per rank
    with pytest.raises(
        LayoutError,
        match=r"o_proj\.weight_scale_inv: its weight \S+o_proj\.weight "
        r"splits 128 / 2 = 64 along dim 1, not on a 128 boundary",
    ):
        load_checkpoint(model, ckpts["fp8_unaligned"], layout)
    assert log == []


def test_other_ranks_tensors_are_not_missing_but_held_ones_are(ckpts, tmp_path) -> None:
    """A checkpoint lacking an expert of rank 0 loads on rank 1 and is refused on rank 0."""
    from safetensors.torch import save_file

    src = ckpts["fp8"]
    gone = "model.layers.2.mlp.experts.3.up_proj.weight"
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = {n: t for n, t in full_tensors(src).items() if n != gone}
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((src / "config.json").read_text())
    parallel = LAYOUTS["dp2_ep2"]
    rank1 = LocalShapeStandIn(src, RankLayout(parallel, 1))
    load_checkpoint(rank1, bad, RankLayout(parallel, 1))
    rank0 = LocalShapeStandIn(src, RankLayout(parallel, 0))
    with pytest.raises(WeightLoadError, match=r"missing 1 tensors \['" + gone):
        load_checkpoint(rank0, bad, RankLayout(parallel, 0))


def test_init_dummy_fills_a_sharded_model(ckpts) -> None:
    model = LocalShapeStandIn(ckpts["fp8"], RankLayout(LAYOUTS["tp2_ep2"], 1))
    init_dummy(model)  # type: ignore[arg-type]
    for key, p in model.params.items():
        assert not p.float().isnan().any(), key
    assert model.post_load_calls == 1


def _load_and_gather(rank: int, model_dir: str, layout: str, init_file: str) -> None:
    """One process per rank: load its part, gather every rank's pieces over gloo, and on
    rank 0 check they reassemble the full tensors."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    parallel = LAYOUTS[layout]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = LocalShapeStandIn(Path(model_dir), RankLayout(parallel, rank))
        load_checkpoint(model, Path(model_dir), RankLayout(parallel, rank))
        # as raw bytes: fp8 tensors do not pickle through all_gather_object
        mine = {n: _bytes(t.view()).clone() for n, t in model.targets.items()}
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            for name, full in full_tensors(Path(model_dir)).items():
                if not name.startswith(nextn_copies(model.cfg)):
                    pieces = [g[name] for g in gathered if name in g]
                    assert_pieces_make_full(name, pieces, _bytes(full))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["tp2", "dp2_ep2"])
def test_two_processes_load_their_parts_and_gather_the_model(ckpts, tmp_path, layout) -> None:
    args = (str(ckpts["fp8"]), layout, str(tmp_path / "init"))
    start_ranks(_load_and_gather, args, 2)
