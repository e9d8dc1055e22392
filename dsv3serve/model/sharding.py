"""One rank's place in a parallel layout and the collectives its sharded layers call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from dsv3serve.config import ModelConfig
from dsv3serve.eplb.state import EplbState
from dsv3serve.layers.linear import Linear
from dsv3serve.layers.parallel_linear import is_row_parallel, sharded_linear
from dsv3serve.parallel.comm import Comm, SingleRank
from dsv3serve.parallel.config import LayoutError
from dsv3serve.parallel.dispatch_base import Dispatcher
from dsv3serve.parallel.shard import RankLayout


@dataclass(frozen=True)
class Sharding:
    """``layout`` (None: one rank, every tensor whole), the group's collectives and, for DP
    attention with expert parallelism, the dispatcher the MoE layers send tokens through;
    ``eplb`` (dispatching layouts only): the logical -> physical expert map and load counts."""

    layout: RankLayout | None = None
    comm: Comm = field(default_factory=SingleRank)
    dispatcher: Dispatcher | None = None
    eplb: EplbState | None = None

    @property
    def world_size(self) -> int:
        return 1 if self.layout is None else self.layout.world_size

    @property
    def dispatches(self) -> bool:
        """Whether routed experts are reached by dispatch / combine (DP attention with EP)."""
        p = None if self.layout is None else self.layout.parallel
        return p is not None and p.enable_dp_attention and p.ep_size > 1

    @property
    def linear(self) -> Callable[..., Linear]:
        """:func:`sharded_linear` for this rank's layout: ``linear(cfg, prefix, in_features,
        out_features, dtype, act_quant=True)`` builds the linear ``prefix`` of full shape
        ``[out, in]`` with this rank's local shape."""
        return partial(sharded_linear, layout=self.layout)

    def row_parallel(self, cfg: ModelConfig, prefix: str) -> bool:
        """Whether linear ``prefix`` yields a partial sum (split along its input)."""
        return is_row_parallel(cfg, prefix, self.layout)

    def check(self, cfg: ModelConfig) -> None:
        """Refuse collectives or a dispatcher that do not match the layout."""
        if self.comm.world_size != self.world_size:
            raise LayoutError(
                f"expected a comm over the layout's {self.world_size} ranks, "
                f"found one over {self.comm.world_size}"
            )
        if self.layout is not None and self.comm.rank != self.layout.rank:
            raise LayoutError(f"layout rank {self.layout.rank} but comm rank {self.comm.rank}")
        if self.dispatches:
            self._check_dispatcher(cfg)
        elif self.eplb is not None:
            raise LayoutError("EPLB needs DP attention with ep_size > 1 (expert dispatch)")

    def _check_dispatcher(self, cfg: ModelConfig) -> None:
        assert self.layout is not None
        ep = self.layout.parallel.ep_size
        if self.dispatcher is None:
            raise LayoutError(
                f"DP attention with ep_size {ep} sends tokens to their experts through a "
                "Dispatcher; none was given"
            )
        experts = cfg.n_routed_experts if self.eplb is None else self.eplb.num_physical
        want = experts // ep
        if self.dispatcher.num_local_experts != want:
            raise LayoutError(
                f"expected a dispatcher with {want} local experts, "
                f"found {self.dispatcher.num_local_experts}"
            )


def part_sharding(layout: RankLayout | None, shard: Sharding | None) -> Sharding:
    """The sharding a model part is built with: the model's ``shard``, or for a part built on
    its own (tests, benchmarks) one without collectives for ``layout``. The layout has one
    source: a ``shard`` whose layout differs from the options' is refused."""
    if shard is None:
        return Sharding(layout)
    if shard.layout != layout:
        raise LayoutError(
            f"expected the part's sharding for the options' layout {layout}, found {shard.layout}"
        )
    return shard
