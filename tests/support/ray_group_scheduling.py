"""How pytest-xdist shares the suite out between its workers (``-n 2``).

The modules that start a Ray cluster (``tests/conftest.py``: ``RAY_MODULES``, ``RAY_TESTS``)
are one unit of work: one worker runs them one after another, while the other workers take
the rest, a module at a time. Two clusters at once would share two cores, and
``ray.init("auto")`` (``test_chaos_connect``) must find exactly one. xdist's own
``--dist loadgroup`` does not group under pytest 9.2 (it renames node ids, which pytest 9.2
no longer reads), so the unit is drawn here from the node ids themselves.
"""

from __future__ import annotations

from collections.abc import Callable

from xdist.scheduler import LoadScopeScheduling

RAY_UNIT = "ray"


def ray_scheduler(starts_ray: Callable[[str], bool]) -> type[LoadScopeScheduling]:
    """A scheduler whose unit of work is the Ray group or one test module."""

    class RayGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return RAY_UNIT if starts_ray(nodeid) else nodeid.split("::", 1)[0]

    return RayGroupScheduling
