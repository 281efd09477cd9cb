"""Shipping an executor's output to the control plane (R-OPS-1).

The executor writes to its local file (one per offer, beside the inbox) and never waits
for the network: the Worker reads the file afterwards, in chunks of at most the
contract's 64 KiB, and appends each one at its byte offset (WorkerService.AppendOutput).
The offset the control plane holds is persisted in the inbox record after each pass,
so a restarted Worker resumes from it; a chunk whose answer was lost (or whose offset
was not persisted yet) is sent again and answered as a replay, never stored twice.

Shipping is bounded per reconcile pass (:data:`CHUNKS_PER_PASS`, :data:`PASS_SECONDS`,
and a deadline: when the record's lease control next falls due), so one chatty Run
cannot hold up lease control; the rest goes at the next tick. A refusal no retry
changes gives shipping up (the caller persists that, so it is not sent again). This
module reads the file and makes the calls; when to ship, and persisting, is the
reconcile's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from qinglong.rpc.v1 import fence_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol import bounds
from qinglong_protocol.errors import EXPECTED_OFFSET

from qinglong_worker.client import CallFailed, WorkerClient
from qinglong_worker.inbox import InboxRecord

log = logging.getLogger(__name__)

#: Chunks one reconcile pass ships at most (4 MiB at the contract's chunk size). A pass
#: comes once a tick, so this is most of the shipping rate: at 16 chunks a Run that
#: printed 16 MiB ended 9.4 s after its executor (1.7 MiB/s through ingress on this
#: 2-core machine), 64 MiB about 40 s.
CHUNKS_PER_PASS: Final = 64
#: And no pass ships for longer than this: a tick waits up to 2 s for its reconciles
#: (``LifecycleSettings.reconcile_wait_seconds``), and a slow control plane should not
#: make one record's pass outlast it.
PASS_SECONDS: Final = 1.0
#: Retries of one chunk stay short: the same reconcile also keeps the record's lease.
CALL_BUDGET_SECONDS: Final = 2.0
#: No chunk is sent with less time than this left (before the pass's deadline, or on
#: the lease): it could not be answered in time anyway.
MIN_CHUNK_SECONDS: Final = 0.1


def log_file(log_dir: Path, offer_id: str) -> Path:
    """Where an offer's executor writes its stdout and stderr (shipped from there)."""
    return log_dir / f"{offer_id}.log"


def output_stream_id(attempt_id: str) -> str:
    """The log artifact id the Worker reports with `running` (R-ACK-5): it names the
    Attempt's output stream, which the control plane keeps by Attempt."""
    return f"attempts/{attempt_id}/output"


def output_size(path: Path | None) -> int:
    """How many bytes the executor has written so far (0 without a file)."""
    if path is None:
        return 0
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def read_chunk(path: Path, offset: int, size: int = bounds.OUTPUT_CHUNK_MAX_BYTES) -> bytes:
    with path.open("rb") as file:
        file.seek(offset)
        return file.read(size)


@dataclass(frozen=True)
class Shipped:
    record: InboxRecord
    """The record as persisted after the last answered chunk."""
    pending: bool
    """Bytes are left that may still be shipped (at the next pass)."""
    refused: str | None = None
    """A refusal no retry changes (the file differs from what was shipped, the Attempt
    is not this Worker's): the rest is given up, so completion does not wait for it and
    nothing is sent again."""
    unanswered: str | None = None
    """The pass ended on a failure a retry may mend (no answer, the output store
    unavailable, an internal error): the bytes are still to ship, later."""


async def ship_output(
    client: WorkerClient,
    record: InboxRecord,
    path: Path,
    fence: Callable[[InboxRecord], fence_pb2.Fence],
    persist: Callable[[InboxRecord, int], InboxRecord],
    *,
    max_chunks: int = CHUNKS_PER_PASS,
    seconds_left: Callable[[], float] | None = None,
    lease_seconds_left: Callable[[], float] | None = None,
) -> Shipped:
    """Ship up to ``max_chunks`` chunks from ``record.output_offset``; ``persist`` records
    a new offset (a compare-and-set) and returns the record written — once a pass, not
    once a chunk: each persist is a write on the event loop's thread (not waited for on
    the disk, the inbox's docstring says why). A Worker that stops mid-pass, or loses the
    last offsets with the power, sends those chunks again, and each is answered as a
    replay.

    ``seconds_left``: the time left before the pass must end (when lease control falls
    due), checked before each chunk, as :data:`PASS_SECONDS` is. ``lease_seconds_left``:
    the time left on the local lease; no chunk's retries go beyond it (nor beyond
    :data:`CALL_BUDGET_SECONDS`). Without either (a closed record: no lease to keep) the
    count and :data:`PASS_SECONDS` bound the pass."""
    offset = record.output_offset
    pass_ends = time.monotonic() + PASS_SECONDS

    def persisted() -> InboxRecord:
        return record if offset == record.output_offset else persist(record, offset)

    for _ in range(max_chunks):
        size = output_size(path)
        if offset >= size:
            if offset > size:
                log.warning("offer %s: output file is shorter than shipped", record.offer_id)
            return Shipped(persisted(), pending=False)
        budget = CALL_BUDGET_SECONDS
        if lease_seconds_left is not None:
            budget = min(budget, lease_seconds_left())
        if (
            budget < MIN_CHUNK_SECONDS
            or (seconds_left is not None and seconds_left() < MIN_CHUNK_SECONDS)
            or time.monotonic() > pass_ends
        ):
            return Shipped(persisted(), pending=True)  # lease control first; the rest later
        data = read_chunk(path, offset)
        try:
            answer = await client.append_output(
                ws.AppendOutputRequest(fence=fence(record), offset=offset, data=data),
                budget_seconds=budget,
            )
        except CallFailed as failure:
            return _after_refusal(persisted(), failure, persist)
        offset = answer.end_offset
    record = persisted()
    return Shipped(record, pending=output_size(path) > record.output_offset)


def _after_refusal(
    record: InboxRecord, failure: CallFailed, persist: Callable[[InboxRecord, int], InboxRecord]
) -> Shipped:
    if failure.transient:
        log.info("offer %s: output not shipped (%s); next tick", record.offer_id, failure.label)
        return Shipped(record, pending=True, unanswered=failure.label)
    expected = failure.metadata.get(EXPECTED_OFFSET, "")
    if failure.reason == ErrorReason.ERROR_REASON_OUTPUT_OFFSET_GAP and expected.isdigit():
        # The control plane holds less than the inbox says (never by this Worker's own
        # doing): ship again from where it stands.
        log.warning("offer %s: output resumes at %s", record.offer_id, expected)
        return Shipped(persist(record, int(expected)), pending=True)
    log.warning(
        "offer %s: output refused (%s); the rest from offset %d is given up",
        record.offer_id,
        failure.label,
        record.output_offset,
    )
    return Shipped(record, pending=False, refused=failure.label)
