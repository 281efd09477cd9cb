"""A Run's Events for `qinglong run events RUN` and `qinglong run watch RUN`.

`run events`: ListRunEvents answers a page at a time (by sequence); a Run that was
retried many times has more Events than one page holds, and the newest of them — how it
ended — matter most. So this reads page after page, as large as the contract allows,
until it has the sequence the Run had when it answered.

`run watch`: WatchRunEvents streams the history, then each Event as it is committed,
until the Run is terminal. The stream is opened again after the last Event printed — the
server streams from any sequence, so nothing is printed twice or skipped — when it ends
DEADLINE_EXCEEDED (ingress bounds every stream's lifetime; the watch itself sets no
deadline), and when it breaks UNAVAILABLE (an ingress pod restarted by a rolling deploy,
a connection lost): the latter after a pause, giving up after a few breaks in a row with
no Event between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, Final, TextIO

import grpc
from qinglong.control.v1 import run_pb2, run_service_pb2
from qinglong_protocol import bounds

ListRunEvents = Callable[..., Awaitable[run_service_pb2.ListRunEventsResponse]]
WatchRunEvents = Callable[..., AsyncIterable[run_service_pb2.WatchRunEventsResponse]]

#: Breaks of the watch stream in a row, with no Event between them, that are resumed.
WATCH_RESUMES: Final = 5
#: The wait before resuming, times the breaks in a row so far.
WATCH_RESUME_SECONDS: Final = 1.0
#: A stream ended DEADLINE_EXCEEDED after at least this long ran its lifetime and is
#: resumed at once; one that ended so sooner failed, and counts as a break.
WATCH_STREAM_MIN_SECONDS: Final = 1.0

#: The last Event of a Run that succeeded (the contract's dotted type: run.<state>).
SUCCEEDED_EVENT: Final = "run.succeeded"


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


async def watched_run_events(
    watch: WatchRunEvents, project_id: str, run_id: str, *, err: TextIO, **call: Any
) -> AsyncIterator[run_pb2.RunEvent]:
    after, breaks = 0, 0
    clock = asyncio.get_running_loop().time
    while True:
        opened = clock()
        stream = watch(
            run_service_pb2.WatchRunEventsRequest(
                project_id=project_id, run_id=run_id, after_sequence=after
            ),
            **call,
        )
        try:
            async for watched in stream:
                after, breaks = watched.event.sequence, 0
                yield watched.event
            return  # the Run is terminal: the server ended the stream
        except grpc.aio.AioRpcError as error:
            code = error.code()
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                if clock() - opened >= WATCH_STREAM_MIN_SECONDS:
                    continue  # the stream's lifetime ran out, not the watch's: go on
            elif code is not grpc.StatusCode.UNAVAILABLE:
                raise
            if breaks >= WATCH_RESUMES:
                raise
            breaks += 1
            note = f"[the event stream broke ({code.name}); resuming after event {after}]"
            print(note, file=err)
            await asyncio.sleep(WATCH_RESUME_SECONDS * breaks)
