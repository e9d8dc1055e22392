"""One fresh random seed per test run, shared by every pytest-xdist worker.

Kernel tests draw fresh random inputs each run and put the seed in the test id, so that a
failure can be replayed (``DSV3SERVE_TEST_SEED=N``). xdist's workers must collect the same
ids, so the seed is drawn once, in the controlling process (``tests/conftest.py``), and the
workers it starts inherit it.
"""

from __future__ import annotations

import os

SEED_ENV = "DSV3SERVE_TEST_SEED"


def draw_session_seed() -> None:
    """Draw the run's seed unless one is set already (by hand, or by the controller)."""
    os.environ.setdefault(SEED_ENV, str(int.from_bytes(os.urandom(4), "little")))


def session_seed() -> int:
    """The run's seed (drawn now if this process runs outside the test suite's conftest)."""
    draw_session_seed()
    return int(os.environ[SEED_ENV])
