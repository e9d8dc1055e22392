"""The README is the front door: short, the CI command verbatim, the GPU start early."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text().splitlines()


def test_readme_is_short() -> None:
    assert len(README) <= 150, f"expected README.md within 150 lines, found {len(README)}"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert command in README, f"expected .ci/run's command as a README line, found none: {command}"


def test_gpu_start_command_within_80_lines() -> None:
    first = [n for n, line in enumerate(README, 1) if line.startswith("dsv3serve serve --config")]
    assert first and first[0] <= 80, f"expected a GPU start command by line 80, found {first}"


def test_readme_links_resolve() -> None:
    targets = [part.split(")")[0] for line in README for part in line.split("](")[1:]]
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, f"expected every README link to exist, found missing {missing}"
