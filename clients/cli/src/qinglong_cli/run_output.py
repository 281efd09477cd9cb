"""`qinglong run logs RUN [--follow] [--attempt N]`: a Run's output, as the executor
wrote it (R-OPS-1).

The bytes go to stdout unchanged (no table, no JSON: output is whatever the executor
wrote); notes — an Attempt changing while following, bytes retention removed — go to
stderr. Without ``--follow`` it prints what is stored and ends. With it, it polls
RunService.ReadRunOutput and ends by itself once the Run is terminal and the output of
its last Attempt is complete and printed; without ``--attempt`` it goes on to each later
Attempt (a retry's) in turn, from the latest at the start — or from the first, if the Run
had none yet. Each poll is one short call: the control plane holds nothing open for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, TextIO

from qinglong.control.v1 import run_service_pb2, run_service_pb2_grpc
from qinglong_protocol import bounds

#: How long following waits before asking again when nothing new was there.
FOLLOW_POLL_SECONDS: Final = 0.5
#: How long following waits, with no new byte arriving, for the rest of an ended
#: Attempt's output that its Worker still has to ship (it reported the ending while
#: stopping, or its lease ran out): the Worker may be gone for good.
SHIPPING_PATIENCE_SECONDS: Final = 60.0

_Page = run_service_pb2.ReadRunOutputResponse


class _Shipping:
    """Whether to keep following an ended Attempt whose Worker reported more output
    (``output_bytes``) than the control plane holds yet; notes what it waits for, and
    what it gave up on, on stderr."""

    def __init__(self, err: TextIO) -> None:
        self._err = err
        self._waiting: tuple[int, int] | None = None  # (Attempt, offset) of the last byte seen
        self._since = 0.0
        self._given_up: set[int] = set()  # Attempts not waited for again

    def awaited(self, number: int, page: _Page, offset: int) -> bool:
        missing = page.output_bytes - offset if page.HasField("output_bytes") else 0
        if missing <= 0 or number in self._given_up:
            self._waiting = None
            return False
        now = asyncio.get_running_loop().time()
        if self._waiting != (number, offset):  # first seen short, or bytes arrived since
            if self._waiting is None or self._waiting[0] != number:
                note = f"[attempt {number} ended; its Worker is still shipping {missing} bytes]"
                print(note, file=self._err)
            self._waiting, self._since = (number, offset), now
            return True
        if now - self._since < SHIPPING_PATIENCE_SECONDS:
            return True
        print(
            f"[attempt {number}: {missing} bytes not shipped after"
            f" {SHIPPING_PATIENCE_SECONDS:.0f} s without progress; they may arrive later"
            " (`qinglong run logs` prints what is stored), or never, if the Worker is gone"
            " or could not ship them]",
            file=self._err,
        )
        self._waiting = None
        self._given_up.add(number)
        return False


class _Sink:
    """Raw bytes to stdout (its binary buffer); text streams without one (tests) get
    the bytes decoded, undecodable ones replaced."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._buffer = getattr(out, "buffer", None)

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._buffer is None:
            self._out.write(data.decode("utf-8", errors="replace"))
            return
        self._out.flush()
        self._buffer.write(data)
        self._buffer.flush()


async def print_run_output(
    runs: run_service_pb2_grpc.RunServiceAsyncStub,
    call_options: Callable[[], dict[str, Any]],
    project_id: str,
    run_id: str,
    *,
    attempt: int | None,
    follow: bool,
    out: TextIO,
    err: TextIO,
) -> None:
    sink = _Sink(out)
    shipping = _Shipping(err)

    async def read(number: int | None, offset: int, max_bytes: int = 0) -> _Page:
        request = run_service_pb2.ReadRunOutputRequest(
            project_id=project_id, run_id=run_id, offset=offset, max_bytes=max_bytes
        )
        if number is not None:
            request.attempt_number = number
        return await runs.ReadRunOutput(request, **call_options())

    offset = 0
    number = attempt  # the Attempt being read; None: the Run had none when asked
    page = await read(number, offset)
    if number is None and page.attempt_number:
        number = page.attempt_number  # the latest when asked: where reading begins
    while True:
        if number is not None:  # a page of that Attempt's output
            if page.offset > offset:
                print(f"[{page.offset - offset} bytes removed by retention]", file=err)
            sink.write(page.data)
            offset = page.next_offset
            if offset < page.end_offset:
                page = await read(number, offset)
                continue
        if not follow:
            return
        # Ended, and all its output printed — unless its Worker still ships some.
        ended = number is not None and page.complete and not shipping.awaited(number, page, offset)
        if number is None or (attempt is None and ended):
            # Is there a next Attempt (a retry), or a first one? Asked past any end, the
            # answer is the latest one's metadata only: no bytes are read to find out.
            latest = await read(None, bounds.MAX_SAFE_INTEGER, 1)
            if latest.attempt_number > (number or 0):
                # One Attempt after another, never straight to the latest: several may
                # have begun (and ended) since the last look, each with its own output.
                number, offset = (number or 0) + 1, 0
                if number > 1:
                    print(f"--- attempt {number}", file=err)
                page = await read(number, offset)
                continue
            if latest.run_terminal:
                return  # no Attempt follows, and this one's output is all printed
        elif ended:
            return  # the Attempt asked for has ended, and its output is all printed
        await asyncio.sleep(FOLLOW_POLL_SECONDS)
        if number is not None:
            page = await read(number, offset)
