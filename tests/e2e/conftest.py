"""The live e2e modules share one local Ray cluster with Serve (``serving_util.local_serve``):
started by the first module that asks for it, shut down after the last test of this folder.
Each module deploys its apps under names of its own and deletes them when it ends, so a
module finds the cluster as the one before it left it, less that module's apps."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serving_util import ServeCluster, local_serve


@pytest.fixture(scope="package")
def serve_cluster() -> Iterator[ServeCluster]:
    with local_serve() as cluster:
        yield cluster
