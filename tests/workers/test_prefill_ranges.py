"""The bookkeeping of an overlapped transfer, alone: the prefill side's ranges (over a
recording stand-in for a connector and for the engine's progress: both fakes, named so)
and the decode side's checks of what a range or a handoff may cover."""

from __future__ import annotations

from typing import Any

from dsv3serve.engine.scheduler.pd import KVReservation
from dsv3serve.kvcache.radix_cache import PrefixMatch
from kv_transfer.handle import KVHandle
from workers.ranges import PrefillRanges
from workers.reservations import range_mismatch, staged_mismatch

PAGE = 16


def handle(rid: str, num_pages: int, first_page: int = 0) -> KVHandle:
    return KVHandle(
        request_id=rid, connector="fake", num_tokens=num_pages * PAGE, num_pages=num_pages,
        page_size=PAGE, num_layers=1, kv_dim=576, dtype="bfloat16", nbytes=0,
        first_page=first_page,
    )  # fmt: skip


class RecordingConnectorFake:
    """Records publish / release (a fake: only the calls matter here)."""

    def __init__(self) -> None:
        self.staged: dict[str, list[int]] = {}

    def publish(self, request_id: str, pages: list[int], num_tokens: int) -> KVHandle:
        assert num_tokens == len(pages) * PAGE
        self.staged[request_id] = pages
        return handle(request_id, len(pages))

    def release(self, request_id: str) -> None:
        self.staged.pop(request_id, None)


class ProgressFake:
    """Stands in for ``Engine.prefill_ready_pages`` (a fake: a list the test grows)."""

    def __init__(self) -> None:
        self.ready: list[int] = []

    def prefill_ready_pages(self, request_id: str) -> list[int]:
        return list(self.ready)


def test_ranges_cover_new_ready_pages_in_order_and_go_with_close() -> None:
    connector, engine = RecordingConnectorFake(), ProgressFake()
    ranges = PrefillRanges(connector, PAGE)
    ranges.open("a.p0.x", skip_pages=2)
    e: Any = engine
    assert ranges.publish_ready(e, "a.p0.x") is None  # nothing ready
    engine.ready = [10, 11, 12, 13]
    first = ranges.publish_ready(e, "a.p0.x")
    assert first is not None and (first.first_page, first.num_pages) == (2, 2)
    assert ranges.publish_ready(e, "a.p0.x") is None  # nothing new
    engine.ready += [14, 15, 16]
    second = ranges.publish_ready(e, "a.p0.x")
    assert second is not None and (second.first_page, second.num_pages) == (4, 3)
    assert connector.staged == {"a.p0.x.r0": [12, 13], "a.p0.x.r1": [14, 15, 16]}
    assert ranges.staged_end("a.p0.x", 2) == 7
    ranges.close("a.p0.x")
    assert connector.staged == {} and len(ranges) == 0
    assert ranges.staged_end("a.p0.x", 2) == 2


def test_a_drop_releases_the_ranges_and_stops_them() -> None:
    connector, engine = RecordingConnectorFake(), ProgressFake()
    ranges, e = PrefillRanges(connector, PAGE), engine
    ranges.open("b", skip_pages=0)
    ranges.drop("b")  # no range yet: nothing to undo, ranges may still come
    engine.ready = [1, 2]
    assert ranges.publish_ready(e, "b") is not None  # type: ignore[arg-type]
    ranges.drop("b")
    assert connector.staged == {} and ranges.staged_end("b", 0) == 0
    engine.ready = [1, 2, 3]
    assert ranges.publish_ready(e, "b") is None  # type: ignore[arg-type]
    assert ranges.publish_ready(e, "unknown") is None  # type: ignore[arg-type]


def reservation(cached: int, pages: int) -> KVReservation:
    return KVReservation(list(range(100, 100 + pages)), PrefixMatch(list(range(cached)), 0, None))


def test_a_range_must_be_the_next_one_and_leave_the_last_page() -> None:
    res = reservation(cached=2, pages=6)
    assert range_mismatch(handle("r", 3, first_page=2), res, pulled=0) is None
    assert range_mismatch(handle("r", 2, first_page=5), res, pulled=3) is None
    assert range_mismatch(handle("r", 3, first_page=5), res, pulled=3)  # the last page
    assert range_mismatch(handle("r", 1, first_page=4), res, pulled=3)  # overlaps
    assert range_mismatch(handle("r", 1, first_page=6), res, pulled=3)  # leaves a gap


def test_a_handoff_ends_with_the_reservation_and_starts_within_what_landed() -> None:
    res = reservation(cached=2, pages=6)
    assert staged_mismatch(handle("r", 6, first_page=2), res) is None
    assert staged_mismatch(handle("r", 2, first_page=6), res, pulled=4) is None
    assert staged_mismatch(handle("r", 6, first_page=2), res, pulled=4) is None  # restaged
    assert staged_mismatch(handle("r", 2, first_page=6), res, pulled=3)  # a gap
    assert staged_mismatch(handle("r", 1, first_page=6), res, pulled=4)  # short
