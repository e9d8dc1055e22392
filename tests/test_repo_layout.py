"""docs/ holds prose and recorded results; programs live in benchmarks/ (issue 30)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_programs_under_docs() -> None:
    programs = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*") if p.suffix in {".py", ".sh"}
    )
    assert programs == [], f"move these to benchmarks/: {programs}"
