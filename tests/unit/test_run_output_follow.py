"""`qinglong run logs --follow` (R-OPS-1) against scripted RunServices: it follows every
Attempt in turn, prints each byte once, asks where the latest Attempt stands without
reading its bytes again, and waits (a bounded time) for output shipped after an ending."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import pytest
from qinglong.control.v1 import run_service_pb2 as rs
from qinglong_cli import run_output
from qinglong_protocol import bounds

RUN_ID = "00000000-0000-4000-8000-000000000001"


@pytest.fixture(autouse=True)
def no_waiting_between_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_output, "FOLLOW_POLL_SECONDS", 0.0)


async def follow(runs: Any, err: io.StringIO | None = None) -> tuple[str, str]:
    """`run logs RUN --follow` against ``runs``: what it printed, and its notes."""
    out, notes = io.StringIO(), err or io.StringIO()
    await run_output.print_run_output(
        runs, dict, "default", RUN_ID, attempt=None, follow=True, out=out, err=notes
    )
    return out.getvalue(), notes.getvalue()


@dataclass
class ScriptedRuns:
    """A Run whose first Attempt ended with its output stored; a retry's Attempt appears
    after a few polls and ends the Run."""

    attempts: dict[int, bytes] = field(default_factory=lambda: {1: b"one\n"})
    run_terminal: bool = False
    requests: list[rs.ReadRunOutputRequest] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)

    async def ReadRunOutput(self, request: rs.ReadRunOutputRequest, **_: Any) -> Any:
        self.requests.append(request)
        if len(self.requests) == 5:  # the retry ran meanwhile
            self.attempts[2] = b"two\n"
            self.run_terminal = True
        number = request.attempt_number if request.HasField("attempt_number") else None
        number = number or max(self.attempts)
        stored = self.attempts[number]
        limit = request.max_bytes or bounds.OUTPUT_READ_DEFAULT_BYTES
        data = stored[request.offset :][:limit]
        self.bytes_sent.append(len(data))
        return rs.ReadRunOutputResponse(
            attempt_number=number,
            attempt_id=f"attempt-{number}",
            data=data,
            offset=request.offset,
            next_offset=request.offset + len(data),
            end_offset=len(stored),
            complete=True,
            run_terminal=self.run_terminal and number == max(self.attempts),
        )


async def test_following_moves_to_the_retry_without_reading_bytes_to_wait() -> None:
    runs = ScriptedRuns()
    printed, notes = await follow(runs)
    assert printed == "one\ntwo\n"
    assert notes == "--- attempt 2\n"
    latest = [
        (request, sent)
        for request, sent in zip(runs.requests, runs.bytes_sent, strict=True)
        if not request.HasField("attempt_number")
    ][1:]  # after the first read
    assert latest, "the latest Attempt was asked for while following"
    for request, sent in latest:
        assert (request.offset, request.max_bytes, sent) == (bounds.MAX_SAFE_INTEGER, 1, 0)


@dataclass
class QueuedThenRunning:
    """A Run still queued when following starts; its Attempt has printed part of its
    output by the next poll, the rest and its end come after."""

    requests: list[rs.ReadRunOutputRequest] = field(default_factory=list)

    async def ReadRunOutput(self, request: rs.ReadRunOutputRequest, **_: Any) -> Any:
        self.requests.append(request)
        if len(self.requests) <= 2:  # the first read, and the first look for an Attempt
            return rs.ReadRunOutputResponse(run_terminal=False)
        done = len(self.requests) > 4
        stored = b"first\nsecond\n" if done else b"first\n"
        data = stored[request.offset :][: request.max_bytes or bounds.OUTPUT_READ_DEFAULT_BYTES]
        return rs.ReadRunOutputResponse(
            attempt_number=1,
            attempt_id="attempt-1",
            data=data,
            offset=min(request.offset, len(stored)),
            next_offset=min(request.offset, len(stored)) + len(data),
            end_offset=len(stored),
            complete=done,
            run_terminal=done,
        )


async def test_output_read_before_the_attempt_was_known_is_not_printed_again() -> None:
    """Following a queued Run: the poll that first finds the Attempt prints its bytes;
    learning that it is the latest Attempt must not start it over from byte 0 (it once
    printed those bytes twice)."""
    runs = QueuedThenRunning()
    printed, notes = await follow(runs)
    assert printed == "first\nsecond\n"
    assert notes == ""
    assert len(runs.requests) > 3, "the script never reached the Attempt's output"


@dataclass
class RetriesBetweenPolls:
    """A Run queued when following starts; by the first look, two Attempts have run,
    and two more run between two later polls: each Attempt's output must be printed."""

    attempts: dict[int, bytes] = field(default_factory=dict)
    requests: list[rs.ReadRunOutputRequest] = field(default_factory=list)

    async def ReadRunOutput(self, request: rs.ReadRunOutputRequest, **_: Any) -> Any:
        self.requests.append(request)
        if len(self.requests) == 2:  # the first look for an Attempt: two have run
            self.attempts.update({1: b"one\n", 2: b"two\n"})
        if len(self.requests) == 8:  # while Attempt 2 is followed, two more ran
            self.attempts.update({3: b"three\n", 4: b"four\n"})
        if not self.attempts:
            return rs.ReadRunOutputResponse(run_terminal=False)
        latest = max(self.attempts)
        number = request.attempt_number if request.HasField("attempt_number") else latest
        stored = self.attempts[number]
        start = min(request.offset, len(stored))
        data = stored[start:][: request.max_bytes or bounds.OUTPUT_READ_DEFAULT_BYTES]
        return rs.ReadRunOutputResponse(
            attempt_number=number,
            attempt_id=f"attempt-{number}",
            data=data,
            offset=start,
            next_offset=start + len(data),
            end_offset=len(stored),
            complete=True,
            run_terminal=latest == 4,
        )


async def test_following_reads_every_attempt_however_many_ran_between_polls() -> None:
    runs = RetriesBetweenPolls()
    printed, notes = await follow(runs)
    assert printed == "one\ntwo\nthree\nfour\n"
    assert notes == "--- attempt 2\n--- attempt 3\n--- attempt 4\n"


@dataclass
class ShippedAfterTheEnd:
    """An Attempt that ended (its Worker was stopping) with 12 bytes of output of which
    the control plane held 6; the rest arrives ``arrives_after`` reads later (never, if
    None)."""

    arrives_after: int | None
    requests: list[rs.ReadRunOutputRequest] = field(default_factory=list)

    async def ReadRunOutput(self, request: rs.ReadRunOutputRequest, **_: Any) -> Any:
        self.requests.append(request)
        arrived = self.arrives_after is not None and len(self.requests) > self.arrives_after
        stored = b"early\nlater\n" if arrived else b"early\n"
        start = min(request.offset, len(stored))
        data = stored[start:][: request.max_bytes or bounds.OUTPUT_READ_DEFAULT_BYTES]
        return rs.ReadRunOutputResponse(
            attempt_number=1,
            attempt_id="attempt-1",
            data=data,
            offset=start,
            next_offset=start + len(data),
            end_offset=len(stored),
            complete=True,
            run_terminal=True,
            output_bytes=12,
        )


async def test_following_waits_for_output_shipped_after_the_attempt_ended() -> None:
    """The Run is terminal and the Attempt complete, but its Worker reported 12 bytes and
    6 are held: following waits for the rest instead of ending without it."""
    printed, notes = await follow(ShippedAfterTheEnd(arrives_after=5))
    assert printed == "early\nlater\n"
    assert notes == "[attempt 1 ended; its Worker is still shipping 6 bytes]\n"


async def test_following_gives_up_on_output_that_never_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(run_output, "SHIPPING_PATIENCE_SECONDS", 0.05)
    runs = ShippedAfterTheEnd(arrives_after=None)
    printed, notes = await follow(runs)
    assert printed == "early\n"
    assert notes.splitlines() == [
        "[attempt 1 ended; its Worker is still shipping 6 bytes]",
        "[attempt 1: 6 bytes not shipped after 0 s without progress; they may arrive later"
        " (`qinglong run logs` prints what is stored), or never, if the Worker is gone or"
        " could not ship them]",
    ]
    assert len(runs.requests) > 2, "it gave up without waiting"


@dataclass
class ShortThenRetried(ShippedAfterTheEnd):
    """Attempt 1 ended short (its missing bytes never come) and the Run waits for a retry;
    Attempt 2 appears a few polls after following gave up on those bytes."""

    notes: io.StringIO = field(default_factory=io.StringIO)
    given_up_at: int = 0

    async def ReadRunOutput(self, request: rs.ReadRunOutputRequest, **_: Any) -> Any:
        if not self.given_up_at and "not shipped" in self.notes.getvalue():
            self.given_up_at = len(self.requests)
        retried = self.given_up_at and len(self.requests) > self.given_up_at + 3
        wanted = request.attempt_number if request.HasField("attempt_number") else None
        if retried and wanted in (None, 2):
            self.requests.append(request)
            data = b"two\n"[min(request.offset, 4) :]
            return rs.ReadRunOutputResponse(
                attempt_number=2,
                attempt_id="attempt-2",
                data=data,
                offset=min(request.offset, 4),
                next_offset=4,
                end_offset=4,
                complete=True,
                run_terminal=True,
                output_bytes=4,
            )
        answer = await super().ReadRunOutput(request)
        answer.run_terminal = False
        return answer


async def test_bytes_given_up_on_are_not_waited_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once following gave up on an Attempt's missing bytes, it looks for the next
    Attempt at each poll, without waiting for those bytes (or saying so) again."""
    monkeypatch.setattr(run_output, "SHIPPING_PATIENCE_SECONDS", 0.05)
    runs = ShortThenRetried(arrives_after=None)
    printed, notes = await follow(runs, runs.notes)
    assert printed == "early\ntwo\n"
    assert [note.split(";")[0].split(":")[0] for note in notes.splitlines()] == [
        "[attempt 1 ended",
        "[attempt 1",
        "--- attempt 2",
    ]
