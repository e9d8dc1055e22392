"""docs/ holds prose and recorded results; programs live in benchmarks/ (issue 30); test
modules have unique names."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_programs_under_docs() -> None:
    programs = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*") if p.suffix in {".py", ".sh"}
    )
    assert programs == [], f"move these to benchmarks/: {programs}"


def test_test_modules_have_unique_names() -> None:
    """Test folders share one import namespace (tests/conftest.py puts each on sys.path, no
    packages), so two test files of one name make pytest refuse the second."""
    names: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert clashes == {}, f"rename one of each: {clashes}"
