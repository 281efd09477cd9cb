"""`qinglong run events RUN`: every Event of a Run, oldest first.

ListRunEvents answers a page at a time (by sequence); a Run that was retried many times
has more Events than one page holds, and the newest of them — how it ended — matter
most. So this reads page after page, as large as the contract allows, until it has the
sequence the Run had when it answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from qinglong.control.v1 import run_pb2, run_service_pb2
from qinglong_protocol import bounds

ListRunEvents = Callable[..., Awaitable[run_service_pb2.ListRunEventsResponse]]


async def every_run_event(
    list_events: ListRunEvents, project_id: str, run_id: str, **call: Any
) -> AsyncIterator[run_pb2.RunEvent]:
    after = 0
    while True:
        page = await list_events(
            run_service_pb2.ListRunEventsRequest(
                project_id=project_id,
                run_id=run_id,
                after_sequence=after,
                page_size=bounds.EVENTS_PAGE_SIZE_MAX,
            ),
            **call,
        )
        for event in page.events:
            yield event
        if not page.events or page.next_after_sequence >= page.run_event_sequence:
            return
        after = page.next_after_sequence
