"""Replica choice: least outstanding tokens, and prefix affinity for prefill."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

# rank_aware: (replica, DP rank) by reported load and prefix cache (router.routing.rank_routing)
Policy = Literal["least_outstanding", "prefix_affinity", "rank_aware"]


class ReplicaSet:
    """The replicas of one role, with the tokens this router has outstanding on each.

    The count is this router's own view (requests it sent and has not seen finish); with
    several router replicas each balances its own share. ``down`` holds the replicas whose
    last call failed and that have not answered since (``router.routing.replica_health``);
    ``out`` the replicas that are not members now (an autoscaled deployment at zero
    replicas, or leaving): they are never chosen nor polled (``set_members``).
    """

    def __init__(self, names: Sequence[str], handles: Sequence[Any]) -> None:
        if len(names) != len(handles):
            raise ValueError("one name per handle")
        self.names = list(names)
        self.handles = list(handles)
        self.outstanding = [0] * len(handles)
        self.down: set[int] = set()
        self.out: set[int] = set()

    def __len__(self) -> int:
        return len(self.handles)

    def members(self) -> list[int]:
        """Indices of the replicas that may be chosen (not ``out``), in order."""
        return [i for i in range(len(self)) if i not in self.out]

    def set_members(self, running: Mapping[str, int]) -> None:
        """Follow the replica set: a replica whose deployment runs no replica now
        (``running[name]`` 0) leaves; one that runs one (again) joins. Names missing from
        ``running`` keep their state."""
        for index, name in enumerate(self.names):
            if name in running:
                (self.out.add if running[name] < 1 else self.out.discard)(index)

    def by_load(self) -> list[int]:
        """Member indices: up before down, then least outstanding tokens (ties: lowest
        index)."""
        return sorted(self.members(), key=lambda i: (i in self.down, self.outstanding[i], i))

    def acquire(self, index: int, tokens: int) -> None:
        self.outstanding[index] += tokens

    def release(self, index: int, tokens: int) -> None:
        self.outstanding[index] -= tokens


def affinity_index(prompt_ids: Sequence[int], block_tokens: int, num_replicas: int) -> int | None:
    """The replica a prompt's leading ``block_tokens`` tokens map to (None: prompt too short).

    A stable hash (not Python's salted ``hash``), so every router replica agrees.
    """
    if len(prompt_ids) < block_tokens or num_replicas == 0:
        return None
    lead = ",".join(map(str, prompt_ids[:block_tokens])).encode()
    digest = hashlib.blake2b(lead, digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_replicas


def prefill_order(
    replicas: ReplicaSet,
    prompt_ids: Sequence[int],
    policy: Policy,
    block_tokens: int,
    imbalance_tokens: int,
) -> list[int]:
    """Prefill replicas to try, best first: the affine one (if any), then by load.

    Affinity yields to load when the affine replica has more than ``imbalance_tokens``
    outstanding beyond the least loaded one (a hot prefix must not pin one replica), and
    when it is down.
    """
    order = replicas.by_load()
    if policy != "prefix_affinity":
        return order
    home = affinity_index(prompt_ids, block_tokens, len(replicas))
    if home is None or home in replicas.down or home in replicas.out:
        return order
    if replicas.outstanding[home] - replicas.outstanding[order[0]] <= imbalance_tokens:
        order.remove(home)
        order.insert(0, home)
    return order
