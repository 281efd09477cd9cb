"""Run output (R-OPS-1): whose output a chunk is, what appending it means, what a read
returns, and how long output is kept. Pure decisions: no grpc, no psycopg.

An Attempt's output is one byte stream. A chunk names its byte offset, which is its
sequence number (chunk n starts where chunk n-1 ended), so a chunk sent twice — the
Worker crashed between the control plane's commit and its own note of it — is
recognised by its offset and answered as a replay. The stream is stored as contiguous
chunks; retention removes whole chunks from its start and never moves its end.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from qinglong_protocol import bounds
from qinglong_protocol.errors import EXPECTED_OFFSET

from qinglong_control.domain.fence import Fence
from qinglong_control.domain.refusals import Reason, Refused

_WEEK_MS: Final = 7 * 24 * 3600 * 1000


@dataclass(frozen=True)
class OutputRetention:
    """How much output is kept. ``max_age_ms``: output not written to for this long is
    removed (by the reconcile cadence); ``max_bytes_per_attempt``: an Attempt keeps at
    most its newest this many bytes, plus part of one chunk (enforced when a chunk is
    appended, so it holds at every moment)."""

    max_age_ms: int = _WEEK_MS
    max_bytes_per_attempt: int = bounds.OUTPUT_BYTES_PER_ATTEMPT_DEFAULT

    def __post_init__(self) -> None:
        if self.max_age_ms < 1000:
            raise ValueError("the output retention age must be at least 1 second")
        if self.max_bytes_per_attempt < bounds.OUTPUT_CHUNK_MAX_BYTES:
            # A smaller bound would trim the very chunk being appended.
            raise ValueError(
                f"output kept per attempt must be at least one chunk"
                f" ({bounds.OUTPUT_CHUNK_MAX_BYTES} bytes)"
            )


@dataclass(frozen=True)
class OutputOwner:
    """The Attempt's authority as stored: who claimed it, with which capability."""

    attempt_id: uuid.UUID
    run_id: uuid.UUID
    project_id: str
    worker_id: str
    session_id: uuid.UUID
    worker_generation: int
    offer_id: uuid.UUID
    lease_generation: int
    lease_token_digest: str


def check_output_owner(fence: Fence, owner: OutputOwner | None) -> None:
    """The caller is the Worker that claimed this Attempt: every identity field of the
    fence matches, and the capability's digest. Unlike a lease command, neither the
    session's liveness nor the lease's version or status matters: output belongs to the
    Attempt, and a Worker ships it until it is all delivered."""
    if owner is None:
        raise Refused(Reason.FENCE_MISMATCH, "attempt does not exist")
    if (owner.run_id, owner.project_id) != (fence.run_id, fence.project_id):
        raise Refused(Reason.FENCE_MISMATCH, "attempt is not of this project's run")
    holder = (
        fence.worker_id,
        fence.session_id,
        fence.worker_generation,
        fence.offer_id,
        fence.lease_generation,
    )
    if (
        owner.worker_id,
        owner.session_id,
        owner.worker_generation,
        owner.offer_id,
        owner.lease_generation,
    ) != holder:
        raise Refused(Reason.FENCE_MISMATCH, "attempt is held by another authority")
    if not fence.token_digest.matches(owner.lease_token_digest):
        raise Refused(Reason.LEASE_TOKEN_MISMATCH, "lease capability does not match")


@dataclass(frozen=True)
class Stream:
    """Where an Attempt's stored output stands; (0, 0) before its first chunk."""

    end_offset: int = 0
    first_offset: int = 0


@dataclass(frozen=True)
class StoredChunk:
    start_offset: int
    data: bytes

    @property
    def end_offset(self) -> int:
        return self.start_offset + len(self.data)


@dataclass(frozen=True)
class AppendDecision:
    end_offset: int
    """The stored end after the append (the next chunk's offset)."""
    replayed: bool
    """Every byte was already stored: nothing is written."""
    write_offset: int = 0
    write_data: bytes = b""
    """The chunk's new tail, stored at ``write_offset`` (the old end)."""
    keep_from: int = 0
    """Chunks that end at or before this offset are removed (the size bound)."""


def decide_append(
    offset: int,
    data: bytes,
    stream: Stream,
    stored: Sequence[StoredChunk],
    retention: OutputRetention,
) -> AppendDecision:
    """What appending ``data`` at ``offset`` means. ``stored`` are the kept chunks that
    overlap the new one, in order. A gap is refused with the offset the stream expects;
    bytes that differ from kept ones are refused; bytes already removed by retention
    cannot be compared and are taken as the same."""
    end = offset + len(data)
    if offset > stream.end_offset:
        raise Refused(
            Reason.OUTPUT_OFFSET_GAP,
            "the chunk starts after the end of the stored output",
            metadata=((EXPECTED_OFFSET, str(stream.end_offset)),),
        )
    if end > bounds.MAX_SAFE_INTEGER:
        # Offsets stay JavaScript-safe like every other number: the stream is full.
        raise Refused(Reason.STATE_CONFLICT, "the output may not grow beyond 2^53-1 bytes")
    for chunk in stored:
        low, high = max(offset, chunk.start_offset), min(end, chunk.end_offset)
        if low < high and (
            data[low - offset : high - offset]
            != chunk.data[low - chunk.start_offset : high - chunk.start_offset]
        ):
            raise Refused(
                Reason.REPLAY_MISMATCH, "the chunk differs from the output stored at its offsets"
            )
    if end <= stream.end_offset:
        return AppendDecision(stream.end_offset, replayed=True)
    return AppendDecision(
        end,
        replayed=False,
        write_offset=stream.end_offset,
        write_data=data[stream.end_offset - offset :],
        keep_from=end - retention.max_bytes_per_attempt,
    )


def page_of(chunks: Sequence[StoredChunk], offset: int, max_bytes: int) -> tuple[int, bytes]:
    """The bytes from ``offset`` (or from the first kept chunk, if retention removed the
    ones before it), at most ``max_bytes``, out of contiguous ``chunks`` that end after
    ``offset``: ``(where the bytes start, the bytes)``."""
    if not chunks:
        return offset, b""
    start = position = max(offset, chunks[0].start_offset)
    parts: list[bytes] = []
    for chunk in chunks:
        if not chunk.start_offset <= position < chunk.end_offset:
            break  # never happens to contiguous chunks; a gap must not be papered over
        part = chunk.data[position - chunk.start_offset :][: max_bytes - (position - start)]
        parts.append(part)
        position += len(part)
        if position - start >= max_bytes:
            break
    return start, b"".join(parts)
