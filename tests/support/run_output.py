"""Reading a Run's output back as a user and as the database holds it, for the fault tests
of R-OPS-1: `qinglong run logs` as a real process, the stored chunks' ranges, and what
those ranges say was duplicated or lost."""

from __future__ import annotations

import itertools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psycopg

from tests.support.devstack_process import QINGLONG


def run_logs(stack_path: Path, run_id: str, *flags: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(QINGLONG), "run", "logs", "--stack", str(stack_path), run_id, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def follow_problems(
    printed: bytes, expected: bytes, notes: str, returncode: int | None
) -> list[str]:
    """What was wrong with a `run logs --follow` that should have printed ``expected``
    and ended by itself (``notes``: its stderr)."""
    problems: list[str] = []
    if printed != expected:
        problems.append(
            f"`run logs --follow` printed {len(printed)} bytes, not the executor's"
            f" {len(expected)} in order ({notes[-400:]})"
        )
    if returncode != 0:
        problems.append(f"`run logs --follow` exited {returncode}")
    return problems


def stored_end(migration_url: str, run_id: str) -> tuple[int, int | None]:
    """Where the stored output of the Run's (one) Attempt ends, and the size its Worker
    reported with the ending (None: not reported yet, or no Attempt)."""
    with psycopg.connect(migration_url, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT coalesce(o.end_offset, 0), a.output_bytes FROM qinglong.attempts a"
            " LEFT JOIN qinglong.attempt_output o USING (attempt_id) WHERE a.run_id = %s",
            (run_id,),
        ).fetchone()
    return (0, None) if row is None else (int(row[0]), row[1])


def stored_chunks(migration_url: str, run_id: str) -> list[tuple[int, int]]:
    """(start, end) of every stored chunk of the Run's Attempts, in offset order."""
    with psycopg.connect(migration_url, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT c.start_offset, c.end_offset FROM qinglong.attempt_output_chunks c"
            " JOIN qinglong.attempts a USING (attempt_id) WHERE a.run_id = %s"
            " ORDER BY c.start_offset",
            (run_id,),
        ).fetchall()
    return [(int(start), int(end)) for start, end in rows]


def duplicated_and_missing(chunks: list[tuple[int, int]]) -> tuple[int, int]:
    """How many neighbouring chunks overlap (a byte stored twice) and how many leave a
    hole between them (a byte never stored)."""
    pairs = list(itertools.pairwise(chunks))
    overlaps = sum(1 for (_, end), (start, _) in pairs if start < end)
    holes = sum(1 for (_, end), (start, _) in pairs if start > end)
    return overlaps, holes


@dataclass(frozen=True)
class ReadBack:
    """A Run's output after a fault: what `qinglong run logs` printed, and the chunks the
    database holds."""

    read: bytes
    error: str
    returncode: int
    chunks: list[tuple[int, int]]
    duplicate_chunks: int
    holes: int

    def lost_bytes(self, printed: bytes) -> int:
        return max(0, len(printed) - len(self.read)) + self.holes

    def problems(self, printed: bytes) -> list[str]:
        """What is wrong with it, for an executor that printed ``printed``."""
        found = []
        if self.returncode != 0:
            found.append(f"`run logs` exited {self.returncode}: {self.error}")
        if self.read != printed:
            found.append("`run logs` did not print exactly what the executor printed")
        if self.duplicate_chunks or self.holes or (self.chunks and self.chunks[0][0] != 0):
            found.append(f"stored chunks are not one contiguous stream: {self.chunks}")
        return found


def read_back(stack_path: Path, migration_url: str, run_id: str) -> ReadBack:
    reader = run_logs(stack_path, run_id)
    read, error = reader.communicate(timeout=60)
    chunks = stored_chunks(migration_url, run_id)
    overlaps, holes = duplicated_and_missing(chunks)
    return ReadBack(read, error.decode(), reader.returncode, chunks, overlaps, holes)
