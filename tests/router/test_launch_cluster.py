"""``router.launch_cluster``: the local Ray cluster's node gets longer than Ray's fixed 30 s
to register (issue 45 part 4), on a scripted clock; and Ray still looks its node up the way
the patch assumes."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import pytest
import ray._private.node
from ray._private import services

from router.launch_cluster import LOOKUP_POLL_S, patient_node_lookup, retrying


@dataclass
class LateGCS:
    """A GCS that does not know the node until ``registers_at`` on a scripted clock."""

    registers_at: float
    now: float = 0.0
    calls: list[float] = field(default_factory=list)

    def get_node(self, gcs_address: str, node_id: str) -> dict[str, str]:
        self.calls.append(self.now)
        if self.now < self.registers_at:
            raise RuntimeError("b'RPC error: Deadline Exceeded'")
        return {"node_id": node_id}

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_late_node_is_found_within_the_bound() -> None:
    gcs = LateGCS(registers_at=75.0)
    lookup = retrying(gcs.get_node, 180.0, clock=lambda: gcs.now, sleep=gcs.sleep)
    assert lookup("127.0.0.1:6379", "abc") == {"node_id": "abc"}
    assert gcs.now == 75.0 and len(gcs.calls) == 75 / LOOKUP_POLL_S + 1


def test_past_the_bound_the_lookup_fails_as_ray_expects() -> None:
    gcs = LateGCS(registers_at=1000.0)
    lookup = retrying(gcs.get_node, 180.0, clock=lambda: gcs.now, sleep=gcs.sleep)
    with pytest.raises(RuntimeError, match="Deadline Exceeded"):
        lookup("127.0.0.1:6379", "abc")
    assert gcs.now == 180.0
    with pytest.raises(RuntimeError):  # the bound counts from the first call, not each
        lookup("127.0.0.1:6379", "abc")
    assert gcs.now == 180.0


def test_the_patch_holds_only_inside_the_block() -> None:
    original = services.get_node
    with patient_node_lookup(5.0):
        assert services.get_node is not original
    assert services.get_node is original


def test_ray_still_gives_up_on_its_node_after_30_s_of_get_node_errors() -> None:
    """What the patch relies on (Ray 2.60): Node.__init__ looks the new node up through
    ``ray._private.services.get_node``, catches RuntimeError and stops after a fixed 30 s.
    If this fails, Ray changed: see whether the fixed bound or the look-up moved."""
    source = inspect.getsource(ray._private.node.Node.__init__)
    assert "ray._private.services.get_node(" in source
    assert "raylet_start_wait_time_s = 30" in source
    assert "except RuntimeError" in source
