"""`qinglong run events` reads every page (a Run retried many times has more Events than
one page holds), against a scripted RunService that pages as the contract says."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qinglong.control.v1 import run_pb2
from qinglong.control.v1 import run_service_pb2 as rs
from qinglong_cli.run_events import every_run_event
from qinglong_protocol import bounds

RUN_ID = "00000000-0000-4000-8000-000000000001"


@dataclass
class PagedEvents:
    """``total`` Events; each page at most ``server_page`` of them (the server's cap may
    be below what was asked for); ``grows_to`` more are appended after the first page."""

    total: int
    server_page: int
    grows_to: int = 0
    requests: list[rs.ListRunEventsRequest] = field(default_factory=list)

    async def __call__(self, request: rs.ListRunEventsRequest, **_: Any) -> Any:
        self.requests.append(request)
        if len(self.requests) == 2 and self.grows_to:
            self.total = self.grows_to
        size = min(request.page_size or bounds.PAGE_SIZE_DEFAULT, self.server_page)
        sequences = range(
            request.after_sequence + 1, min(self.total, request.after_sequence + size) + 1
        )
        events = [run_pb2.RunEvent(sequence=n, run_id=RUN_ID) for n in sequences]
        return rs.ListRunEventsResponse(
            events=events,
            next_after_sequence=sequences[-1] if events else request.after_sequence,
            run_event_sequence=self.total,
        )


async def collect(events: PagedEvents) -> list[int]:
    return [event.sequence async for event in every_run_event(events, "default", RUN_ID)]


async def test_every_page_is_read_oldest_first_without_gaps_or_repeats() -> None:
    events = PagedEvents(total=1234, server_page=100)
    assert await collect(events) == list(range(1, 1235))
    assert {r.page_size for r in events.requests} == {bounds.EVENTS_PAGE_SIZE_MAX}
    assert len(events.requests) == 13  # 12 full pages and one of 34


async def test_one_page_and_no_events_take_one_call() -> None:
    small = PagedEvents(total=7, server_page=500)
    assert await collect(small) == list(range(1, 8))
    assert len(small.requests) == 1
    empty = PagedEvents(total=0, server_page=500)
    assert await collect(empty) == []
    assert len(empty.requests) == 1


async def test_events_appended_while_reading_are_read_too() -> None:
    events = PagedEvents(total=150, server_page=100, grows_to=230)
    assert await collect(events) == list(range(1, 231))
