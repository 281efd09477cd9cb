"""`qinglong run events` reads every page (a Run retried many times has more Events than
one page holds), and `qinglong run watch` resumes a broken stream after the last Event,
against a scripted RunService (the real stack: tests/integration/test_cli_watch.py)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from qinglong.control.v1 import run_pb2
from qinglong.control.v1 import run_service_pb2 as rs
from qinglong_cli import run_events
from qinglong_cli.run_events import every_run_event, watched_run_events
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


class BreakingStream:
    """Each WatchRunEvents call yields the next scripted Events, then fails with the
    next scripted code (None: ends normally, the Run terminal)."""

    def __init__(self, script: list[tuple[list[int], grpc.StatusCode | None]]) -> None:
        self.script = script
        self.afters: list[int] = []

    def __call__(self, request: rs.WatchRunEventsRequest, **_: Any) -> AsyncIterator[Any]:
        self.afters.append(request.after_sequence)
        sequences, code = self.script[len(self.afters) - 1]

        async def stream() -> AsyncIterator[Any]:
            for sequence in sequences:
                yield rs.WatchRunEventsResponse(event=run_pb2.RunEvent(sequence=sequence))
            if code is not None:
                raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")

        return stream()


async def watch_all(stream: BreakingStream) -> tuple[list[int], str]:
    err = io.StringIO()
    sequences = [
        event.sequence async for event in watched_run_events(stream, "default", RUN_ID, err=err)
    ]
    return sequences, err.getvalue()


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


async def test_a_watch_resumes_after_the_last_event_it_got(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_events, "WATCH_RESUME_SECONDS", 0.0)
    stream = BreakingStream([([1, 2], UNAVAILABLE), ([], UNAVAILABLE), ([3, 4], None)])
    sequences, notes = await watch_all(stream)
    assert sequences == [1, 2, 3, 4]
    assert stream.afters == [0, 2, 2]
    assert notes.count("resuming after event 2") == 2


async def test_a_watch_gives_up_after_breaks_in_a_row_and_on_any_other_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(run_events, "WATCH_RESUME_SECONDS", 0.0)
    broken = [([], UNAVAILABLE)] * (run_events.WATCH_RESUMES + 1)
    with pytest.raises(grpc.aio.AioRpcError):
        await watch_all(BreakingStream(broken))
    # An Event between breaks starts the count again.
    recovering = [([n], UNAVAILABLE) for n in range(1, 2 * run_events.WATCH_RESUMES)]
    sequences, _ = await watch_all(BreakingStream([*recovering, ([], None)]))
    assert sequences == list(range(1, 2 * run_events.WATCH_RESUMES))
    refused = BreakingStream([([1], grpc.StatusCode.PERMISSION_DENIED)])
    with pytest.raises(grpc.aio.AioRpcError):
        await watch_all(refused)
    assert refused.afters == [0]
    # A DEADLINE_EXCEEDED at once is no stream lifetime run out: a break like the others.
    quick = [([], grpc.StatusCode.DEADLINE_EXCEEDED)] * (run_events.WATCH_RESUMES + 1)
    with pytest.raises(grpc.aio.AioRpcError):
        await watch_all(BreakingStream(quick))
