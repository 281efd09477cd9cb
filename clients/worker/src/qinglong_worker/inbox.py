"""The Worker's durable local inbox (SPEC R-W-1): one SQLite record per offer.

A record carries everything the fence and crash recovery need: the run/project/attempt
ids, the session that claimed it, the lease generation and capability, the newest
persisted lease version with a local expiry estimate, the plan, the activation, the
executor's identity, the callback fields, the stop reason and the exit status.

A closed record (a terminal state) changes only in how much of its output was shipped:
the rest of an executor's file is shipped after its record closed (R-OPS-1).

Every change is a compare-and-set on the record's ``revision``
(``UPDATE … WHERE offer_id = ? AND revision = ?``); zero rows raise
:class:`InboxConflict` and change nothing. The file is opened in WAL mode with
``synchronous=FULL`` (a committed change survives power loss) and created ``0600``,
because it holds two secrets in plaintext: the lease capability and the callback token.
Neither ever reaches a log line or a ``repr``.

Except the changes a caller marks not durable (``durable=False``): those are committed
with ``synchronous=NORMAL`` -- written to the WAL without waiting for the disk, so they
survive a crash or a ``kill -9`` of the Worker (the kernel holds them) but not a power
loss, and any later durable change makes them durable with it (its fsync covers the
whole WAL), as does :meth:`Inbox.sync` (one fsync for all of them, only when there are
any). The Worker marks so a lease renewal of a running executor and how much output was
shipped: the steady state -- a write per running Attempt every lease-control interval,
one per shipping pass -- whose fsyncs, on the event loop's thread, held up every other
record's lease control on a slow disk (an SD card, a network volume). It syncs before
every call that may advance or end a lease, so control is never more than the one
version ahead of what survives a power loss that a lost answer leaves too (the renewal
replay's case); a lost offset is shipped again and answered as a replay.

One process uses an inbox at a time: :meth:`Inbox.open` takes an exclusive ``flock`` on
``<file>.lock`` and refuses a second opener with :class:`InboxLocked`.

A file that is not (or no longer) a readable SQLite database raises
:class:`InboxUnreadable`, which names the file: at open, from any statement SQLite
refuses, and from :meth:`Inbox.verify`. The last one matters because SQLite in WAL mode
serves reads from its cache and the WAL index and does not notice that the database
file was overwritten underneath an open connection; the daemon verifies every tick.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Concatenate, Final, ParamSpec, Self, TypeVar

from qinglong_worker.clock import BootInstant

SCHEMA_VERSION: Final = 8
#: What each older schema version lacks, added in place when a Worker opens its inbox.
#: An older Worker refuses a newer inbox ("unsupported inbox schema version"): there is
#: no downgrade.
_UPGRADES: Final[Mapping[int, tuple[str, ...]]] = {
    1: ("ALTER TABLE offers ADD COLUMN output_offset INTEGER NOT NULL DEFAULT 0",),
    2: (
        "ALTER TABLE offers ADD COLUMN output_given_up TEXT",
        "ALTER TABLE offers ADD COLUMN output_shipped INTEGER NOT NULL DEFAULT 0",
    ),
    3: ("ALTER TABLE offers ADD COLUMN executor_boot_id TEXT",),
    # Schema 4 measured the local lease on the wall clock only. Its open records get no
    # boot-clock observation here: they count as lost (see `InboxRecord.lease_left_ms`).
    4: (
        "ALTER TABLE offers ADD COLUMN lease_observed_boot_ms INTEGER",
        "ALTER TABLE offers ADD COLUMN lease_observed_boot_id TEXT",
    ),
    # Schema 6 changes no table: its executors' supervisors watch the lease files the
    # Worker writes (`qinglong_worker.local_lease`). A Worker of schema 5 writes none, so
    # they would stop its healthy executors at the last lease written, and it would
    # report that stop as the executor's ending: it must refuse this inbox.
    5: (),
    # Schema 7 changes no table either: a record may be quarantined
    # `not_started_worker_fault`, which a Worker of schema 6 cannot read.
    6: (),
    # Schema 8: a Run's parameters (a Worker of schema 7 would start its executor
    # without them).
    7: ("ALTER TABLE offers ADD COLUMN parameters TEXT NOT NULL DEFAULT '{}'",),
}
#: A schema-1 inbox predates output shipping: its closed records promised none, so their
#: files (if any) are not shipped now. (A schema-2 record closed with output left
#: unshipped is picked up by the closed-record shipping.)
_SHIPPED_BEFORE_SCHEMA_2: Final = (
    "UPDATE offers SET output_shipped = 1 WHERE state IN (SELECT value FROM json_each(?))"
)
#: Closed records whose output may still have to be shipped, by admission order.
_OUTPUT_INDEX: Final = (
    "CREATE INDEX IF NOT EXISTS offers_output_unsettled ON offers (seq)"
    " WHERE output_shipped = 0 AND output_given_up IS NULL"
)
_FILE_MODE: Final = 0o600
_DIRECTORY_MODE: Final = 0o700
#: The first 16 bytes of every SQLite 3 database file.
_SQLITE_HEADER: Final = b"SQLite format 3\x00"
#: SQLite result codes that mean "try again", not "this file is broken".
_BUSY_CODES: Final = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED
#: The disk, not the file: SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL.
_STORAGE_CODES: Final = frozenset({8, 10, 13})
_P = ParamSpec("_P")
_T = TypeVar("_T")


class RecordState(StrEnum):
    """Where an offer stands locally. The first seven follow the three start facts."""

    CLAIMING = "claiming"
    """The capability is persisted; ClaimOffer has not answered yet."""
    CLAIMED = "claimed"
    """ClaimOffer answered: attempt id, lease generation and version are persisted."""
    LAUNCHING = "launching"
    """`starting` is acknowledged and the activation persisted; the spawn is under way
    (or, after a crash, its outcome is unknown)."""
    STARTED = "started"
    """The executor runs and its identity (PID + start time) is persisted."""
    RUNNING_ACKNOWLEDGED = "running_acknowledged"
    """`running` is a durable fact in the control plane."""
    EXITED = "exited"
    """The process ended and its outcome is persisted; completion is not yet acknowledged."""
    COMPLETION_ACKNOWLEDGED = "completion_acknowledged"
    """CompleteAttempt answered: nothing is left to do."""
    QUARANTINED = "quarantined"
    """The record is closed without completion; ``quarantine_reason`` says why."""
    ABANDONED = "abandoned"
    """The claim was refused: this Worker never owned the Run."""

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_STATES


_TERMINAL_STATES: Final = frozenset(
    {RecordState.COMPLETION_ACKNOWLEDGED, RecordState.QUARANTINED, RecordState.ABANDONED}
)

#: States that still need the Worker's attention (supervision or recovery).
OPEN_STATES: Final = tuple(state for state in RecordState if not state.is_terminal)


class QuarantineReason(StrEnum):
    CONTROL_PLANE_TERMINAL = "control_plane_terminal"
    LEASE_LOST_LOCAL_EXECUTION_STOPPED = "lease_lost_local_execution_stopped"
    LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED = "lease_lost_local_execution_unverified"
    START_FAILED = "start_failed"
    RUNNING_ELSEWHERE = "running_elsewhere"
    """The control plane says the Attempt runs already, though this inbox never launched
    it (an inbox restored from a backup, or a copy of this Worker's volume): nothing is
    started here, or the Run would run twice."""
    NOT_STARTED_WORKER_FAULT = "not_started_worker_fault"
    """Nothing was started, for a fault of this Worker's machine (a full disk, no file
    descriptors left): not reported as the task's start failure. The lease is left to
    run out, so the Attempt ends lost and the Run is retried (on another Worker)."""


#: Allowed state changes; a state may always "change" to itself (field updates such as a
#: renewed lease version). Terminal states never change again, and a closed record only
#: in its output shipping (``output_offset``, ``output_given_up``, ``output_shipped``).
_TRANSITIONS: Final[Mapping[RecordState, frozenset[RecordState]]] = {
    RecordState.CLAIMING: frozenset({RecordState.CLAIMED, RecordState.ABANDONED}),
    RecordState.CLAIMED: frozenset({RecordState.LAUNCHING, RecordState.QUARANTINED}),
    RecordState.LAUNCHING: frozenset({RecordState.STARTED, RecordState.QUARANTINED}),
    RecordState.STARTED: frozenset({RecordState.RUNNING_ACKNOWLEDGED, RecordState.QUARANTINED}),
    RecordState.RUNNING_ACKNOWLEDGED: frozenset({RecordState.EXITED, RecordState.QUARANTINED}),
    RecordState.EXITED: frozenset({RecordState.COMPLETION_ACKNOWLEDGED, RecordState.QUARANTINED}),
    RecordState.COMPLETION_ACKNOWLEDGED: frozenset(),
    RecordState.QUARANTINED: frozenset(),
    RecordState.ABANDONED: frozenset(),
}


class InboxError(Exception):
    """Base of the inbox's typed failures."""


class InboxConflict(InboxError):
    """A compare-and-set found another revision (or no record): nothing was written."""

    def __init__(self, offer_id: str, expected_revision: int) -> None:
        super().__init__(f"offer {offer_id}: revision {expected_revision} is not current")
        self.offer_id = offer_id
        self.expected_revision = expected_revision


class InvalidTransition(InboxError):
    """A change the record's state machine does not allow."""


class InboxLocked(InboxError):
    """Another process holds this inbox."""


class InboxUnreadable(InboxError):
    """The inbox file cannot be used as the inbox any more (corrupt, replaced, unreadable).

    Fatal for the daemon: the durable facts are gone, so nothing may continue on them.
    The message names the file and SQLite's (or the OS's) short reason, never content.
    """

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"inbox {path} is unreadable: {reason}")
        self.path = path
        self.reason = reason


class InboxUnwritable(InboxUnreadable):
    """The inbox is sound but its disk refuses writes (full, an I/O error, read-only):
    as fatal while running — no fact can be made durable —, but the file is kept as it is.
    The operator frees space or fixes the disk and starts the Worker again on the same
    inbox; moving it aside (as for a damaged one) would lose its capabilities."""

    def __init__(self, path: Path, reason: str) -> None:
        InboxError.__init__(
            self,
            f"inbox {path} cannot be written: {reason}; free space or fix the disk, then "
            "start the Worker again on the same inbox (do not move it aside)",
        )
        self.path = path
        self.reason = reason


def _unreadable(path: Path, error: sqlite3.DatabaseError) -> InboxError | None:
    """The typed error for a SQLite failure; None for a transient busy/locked one."""
    code = getattr(error, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    if primary in _BUSY_CODES:
        return None
    reason = str(error) or type(error).__name__
    if primary in _STORAGE_CODES:
        return InboxUnwritable(path, reason)
    return InboxUnreadable(path, reason)


def _guarded(method: Callable[Concatenate[Inbox, _P], _T]) -> Callable[Concatenate[Inbox, _P], _T]:
    """Turn SQLite's "this file is broken" errors into :class:`InboxUnreadable`."""

    def guarded(self: Inbox, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as error:
            typed = _unreadable(self.path, error)
            if typed is None:
                raise
            raise typed from None

    guarded.__name__, guarded.__doc__ = method.__name__, method.__doc__
    return guarded


@dataclass(frozen=True)
class InboxRecord:
    """One offer, as durable facts. ``repr`` never shows the two secrets."""

    offer_id: str
    revision: int
    state: RecordState
    worker_id: str
    session_id: str
    worker_generation: int
    project_id: str
    run_id: str
    capability: str = field(repr=False)
    argv: tuple[str, ...]
    timeout_ms: int | None
    created_unix_ms: int
    updated_unix_ms: int
    attempt_id: str | None = None
    lease_generation: int | None = None
    lease_version: int | None = None
    # The wall clock when the request that earned the newest lease answer was sent: for
    # humans reading the inbox only; no decision uses it (the clock may step).
    lease_observed_unix_ms: int | None = None
    # The remaining time that answer gave the lease. With `lease_observed_boot_*` below
    # it is the local lease estimate, used only to decide "lease lost locally" and the
    # budgets derived from it; never sent anywhere.
    lease_remaining_ms: int | None = None
    # The activation fixed by `starting` (DB time, as the server sent it).
    deadline_unix_ms: int | None = None
    deadline_remaining_ms: int | None = None
    executor_pid: int | None = None
    executor_start_ticks: int | None = None
    callback_sequence: int | None = None
    callback_token: str | None = field(default=None, repr=False)
    stop_reason: str | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    completion_outcome: str | None = None
    start_failure: str | None = None
    quarantine_reason: QuarantineReason | None = None
    detail: str | None = None
    # How many bytes of the executor's output file the control plane holds (R-OPS-1):
    # moved forward only after AppendOutput answered, so a restart resumes from here and
    # at worst re-sends a chunk the control plane answers as a replay. It keeps moving
    # after the record is closed, while the rest of the file is shipped.
    output_offset: int = 0
    # Why shipping was given up for good (the label of a refusal no retry changes, e.g.
    # REPLAY_MISMATCH); None while output may still be shipped.
    output_given_up: str | None = None
    # A closed record's whole file is held by the control plane: nothing is left to ship.
    output_shipped: bool = False
    # The boot the executor's identity belongs to (its pid and start time name a process
    # only within one boot); None in a record written before the Worker recorded it.
    executor_boot_id: str | None = None
    # When that request was sent, on the boot clock (CLOCK_BOOTTIME ms, which never
    # steps, see `qinglong_worker.clock`), and in which boot. None in a record written
    # before the Worker measured leases so (schema 4 and earlier).
    lease_observed_boot_ms: int | None = None
    lease_observed_boot_id: str | None = None
    # The Run's parameters (name, value), sorted by name, as the offer and then the claim
    # gave them: the executor receives each as QINGLONG_PARAM_<name>. Schema 8.
    parameters: tuple[tuple[str, str], ...] = ()

    @property
    def lease_observed(self) -> BootInstant | None:
        """The local lease estimate's observation; None without one."""
        if self.lease_observed_boot_ms is None or self.lease_remaining_ms is None:
            return None
        return BootInstant(self.lease_observed_boot_id, self.lease_observed_boot_ms)

    def lease_left_ms(self, now: BootInstant) -> int | None:
        """What the local estimate leaves of the lease at ``now`` (0 once it ran out);
        None without an estimate.

        An observation made in another boot leaves nothing: its readings do not compare
        with this boot's, and the executor ended with that boot anyway. A record of a
        schema-4 inbox has no boot-clock observation and so no estimate (then the lease
        counts as lost, below). It was measured on the wall clock alone, the one clock
        that is not trusted: treating it as observed *now* would add the Worker's
        downtime to the lease, which the control plane did count (the Run could run
        twice), and converting it through the wall clock would trust that clock once
        more, over a restart, when a step is likeliest. A drained Worker leaves nothing
        running, so this costs only after a crash: the old records' executors are
        stopped, and an ending already persisted is still reported (a last word)."""
        observed = self.lease_observed
        if observed is None or self.lease_remaining_ms is None:
            return None
        if observed.boot_id != now.boot_id:
            return 0
        return max(0, observed.ms + self.lease_remaining_ms - now.ms)

    def lease_lost_locally(self, now: BootInstant) -> bool:
        """True once the local estimate says the lease has run out (or there is none
        although the claim answered)."""
        left = self.lease_left_ms(now)
        if left is None:
            return self.state is not RecordState.CLAIMING
        return left <= 0

    @property
    def has_executor(self) -> bool:
        return self.executor_pid is not None and self.executor_start_ticks is not None


@dataclass(frozen=True)
class SessionRecord:
    """The Worker's present session, kept so a restarted daemon can resume it.

    ``open_request_id`` is persisted before OpenSession is sent, so a retry after a lost
    answer returns the same session (AIP-155) instead of opening another one.
    """

    revision: int
    worker_id: str
    open_request_id: str
    session_id: str | None = None
    worker_generation: int | None = None


# The `offers` columns, one per InboxRecord field, written out so that every statement
# is constant text with bound parameters. `_check_columns` keeps them in step.
_COLUMN_LIST: Final = """
    offer_id, revision, state, worker_id, session_id, worker_generation, project_id, run_id,
    capability, argv, timeout_ms, created_unix_ms, updated_unix_ms, attempt_id,
    lease_generation, lease_version, lease_observed_unix_ms, lease_remaining_ms,
    deadline_unix_ms, deadline_remaining_ms, executor_pid, executor_start_ticks,
    callback_sequence, callback_token, stop_reason, exit_code, exit_signal, completion_outcome,
    start_failure, quarantine_reason, detail, output_offset, output_given_up, output_shipped,
    executor_boot_id, lease_observed_boot_ms, lease_observed_boot_id, parameters
"""
# Rows are read with `SELECT *` and mapped by column name (the extra `seq` is the cursor).

_INSERT: Final = """
INSERT INTO offers (seq,
    offer_id, revision, state, worker_id, session_id, worker_generation, project_id, run_id,
    capability, argv, timeout_ms, created_unix_ms, updated_unix_ms, attempt_id,
    lease_generation, lease_version, lease_observed_unix_ms, lease_remaining_ms,
    deadline_unix_ms, deadline_remaining_ms, executor_pid, executor_start_ticks,
    callback_sequence, callback_token, stop_reason, exit_code, exit_signal, completion_outcome,
    start_failure, quarantine_reason, detail, output_offset, output_given_up, output_shipped,
    executor_boot_id, lease_observed_boot_ms, lease_observed_boot_id, parameters
) SELECT (SELECT coalesce(max(seq), 0) + 1 FROM offers),
    :offer_id, :revision, :state, :worker_id, :session_id, :worker_generation, :project_id,
    :run_id, :capability, :argv, :timeout_ms, :created_unix_ms, :updated_unix_ms, :attempt_id,
    :lease_generation, :lease_version, :lease_observed_unix_ms, :lease_remaining_ms,
    :deadline_unix_ms, :deadline_remaining_ms, :executor_pid, :executor_start_ticks,
    :callback_sequence, :callback_token, :stop_reason, :exit_code, :exit_signal,
    :completion_outcome, :start_failure, :quarantine_reason, :detail, :output_offset,
    :output_given_up, :output_shipped, :executor_boot_id, :lease_observed_boot_ms,
    :lease_observed_boot_id, :parameters
    WHERE NOT EXISTS (SELECT 1 FROM offers WHERE offer_id = :offer_id)
"""
_UPDATE: Final = """
UPDATE offers SET revision = :revision,
    state = :state, worker_id = :worker_id, session_id = :session_id,
    worker_generation = :worker_generation, project_id = :project_id, run_id = :run_id,
    capability = :capability, argv = :argv, timeout_ms = :timeout_ms,
    created_unix_ms = :created_unix_ms, updated_unix_ms = :updated_unix_ms,
    attempt_id = :attempt_id, lease_generation = :lease_generation,
    lease_version = :lease_version, lease_observed_unix_ms = :lease_observed_unix_ms,
    lease_remaining_ms = :lease_remaining_ms, deadline_unix_ms = :deadline_unix_ms,
    deadline_remaining_ms = :deadline_remaining_ms, executor_pid = :executor_pid,
    executor_start_ticks = :executor_start_ticks, callback_sequence = :callback_sequence,
    callback_token = :callback_token, stop_reason = :stop_reason, exit_code = :exit_code,
    exit_signal = :exit_signal, completion_outcome = :completion_outcome,
    start_failure = :start_failure, quarantine_reason = :quarantine_reason, detail = :detail,
    output_offset = :output_offset, output_given_up = :output_given_up,
    output_shipped = :output_shipped, executor_boot_id = :executor_boot_id,
    lease_observed_boot_ms = :lease_observed_boot_ms,
    lease_observed_boot_id = :lease_observed_boot_id, parameters = :parameters
 WHERE offer_id = :offer_id AND revision = :expected_revision
"""
_COLUMNS: Final = tuple(f.name for f in dataclasses.fields(InboxRecord))
#: Fixed at admission, never changed by a compare-and-set.
_IMMUTABLE: Final = (
    "offer_id",
    "worker_id",
    "session_id",
    "worker_generation",
    "project_id",
    "run_id",
    "capability",
    "created_unix_ms",
)
#: Fixed once the claim answered.
_SET_ONCE: Final = (
    "attempt_id",
    "lease_generation",
    "callback_token",
    "executor_pid",
    "executor_boot_id",
)
#: What may still change once a record is closed: shipping the rest of its output.
_AFTER_CLOSE: Final = frozenset(
    {"revision", "updated_unix_ms", "output_offset", "output_given_up", "output_shipped"}
)


def _check_columns() -> None:
    listed = tuple(name.strip() for name in _COLUMN_LIST.split(","))
    if listed != _COLUMNS:
        raise RuntimeError("inbox columns drifted from InboxRecord")


_check_columns()

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS offers (
    offer_id               TEXT PRIMARY KEY,
    seq                    INTEGER NOT NULL UNIQUE,
    revision               INTEGER NOT NULL CHECK (revision >= 1),
    state                  TEXT NOT NULL,
    worker_id              TEXT NOT NULL,
    session_id             TEXT NOT NULL,
    worker_generation      INTEGER NOT NULL,
    project_id             TEXT NOT NULL,
    run_id                 TEXT NOT NULL,
    capability             TEXT NOT NULL,
    argv                   TEXT NOT NULL,
    timeout_ms             INTEGER,
    created_unix_ms        INTEGER NOT NULL,
    updated_unix_ms        INTEGER NOT NULL,
    attempt_id             TEXT,
    lease_generation       INTEGER,
    lease_version          INTEGER,
    lease_observed_unix_ms INTEGER,
    lease_remaining_ms     INTEGER,
    deadline_unix_ms       INTEGER,
    deadline_remaining_ms  INTEGER,
    executor_pid           INTEGER,
    executor_start_ticks   INTEGER,
    callback_sequence      INTEGER,
    callback_token         TEXT,
    stop_reason            TEXT,
    exit_code              INTEGER,
    exit_signal            INTEGER,
    completion_outcome     TEXT,
    start_failure          TEXT,
    quarantine_reason      TEXT,
    detail                 TEXT,
    output_offset          INTEGER NOT NULL DEFAULT 0,
    output_given_up        TEXT,
    output_shipped         INTEGER NOT NULL DEFAULT 0,
    executor_boot_id       TEXT,
    lease_observed_boot_ms INTEGER,
    lease_observed_boot_id TEXT,
    parameters             TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS offers_by_state ON offers (state, seq);
CREATE INDEX IF NOT EXISTS offers_by_quarantine ON offers (quarantine_reason, seq)
    WHERE quarantine_reason IS NOT NULL;
CREATE TABLE IF NOT EXISTS syncs (
    slot  INTEGER PRIMARY KEY CHECK (slot = 1),
    count INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS session (
    slot              INTEGER PRIMARY KEY CHECK (slot = 1),
    revision          INTEGER NOT NULL CHECK (revision >= 1),
    worker_id         TEXT NOT NULL,
    open_request_id   TEXT NOT NULL,
    session_id        TEXT,
    worker_generation INTEGER
);
"""


#: A durable commit of its own, whose fsync covers every change committed before it.
_SYNC: Final = (
    "INSERT INTO syncs (slot, count) VALUES (1, 1)"
    " ON CONFLICT (slot) DO UPDATE SET count = syncs.count + 1"
)


def _create_private_file(path: Path) -> None:
    """Create ``path`` as 0600 (or tighten it); never follow a symlink."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, _FILE_MODE)
    try:
        os.fchmod(descriptor, _FILE_MODE)
    finally:
        os.close(descriptor)


class Inbox:
    """The durable inbox. Not thread-safe: one event loop owns it."""

    def __init__(self, path: Path, connection: sqlite3.Connection, lock_descriptor: int) -> None:
        self.path = path
        self._db = connection
        self._lock_descriptor = lock_descriptor
        #: A change may have been committed without waiting for the disk since the last
        #: sync. True at first: a Worker killed before may have left such changes, and
        #: nothing here should rest on opening the file happening to sync them.
        self._unsynced = True
        # The file this connection uses, held open as long as the inbox is: verify() reads
        # it through this descriptor and never opens the file again. Closing any other
        # descriptor of the database file would drop every POSIX lock this process holds
        # on it — SQLite's own among them — and then a reader elsewhere (an operator's
        # sqlite3, a backup) closing its connection would take itself for the last one
        # and delete the WAL this connection still writes: what it wrote next would be
        # lost at a crash.
        self._file = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        status = os.fstat(self._file)
        self._file_id = (status.st_dev, status.st_ino)

    @classmethod
    def open(cls, path: Path) -> Self:
        lock_path = path.with_name(path.name + ".lock")
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=_DIRECTORY_MODE)
            _create_private_file(lock_path)
            lock_descriptor = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as error:
            raise InboxUnreadable(path, error.strerror or type(error).__name__) from None
        try:
            fcntl.flock(lock_descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_descriptor)
            raise InboxLocked(f"{path} is in use by another process") from None
        connection: sqlite3.Connection | None = None
        try:
            _create_private_file(path)
            # SQLite creates the -wal and -shm files with the database file's mode.
            connection = sqlite3.connect(path, isolation_level=None, check_same_thread=True)
            connection.row_factory = sqlite3.Row
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise InboxError(f"{path}: WAL journal mode is not available")
            connection.execute("PRAGMA synchronous=FULL")
            connection.execute("PRAGMA busy_timeout=5000")
            version = connection.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION, *_UPGRADES):
                raise InboxError(f"{path}: unsupported inbox schema version {version}")
            connection.executescript(_SCHEMA)
            # One transaction: an upgrade a crash interrupts is not half applied.
            connection.execute("BEGIN IMMEDIATE")
            for step in range(version or SCHEMA_VERSION, SCHEMA_VERSION):
                for statement in _UPGRADES[step]:
                    connection.execute(statement)
            if version == 1:
                connection.execute(_SHIPPED_BEFORE_SCHEMA_2, (_state_list(_TERMINAL_STATES),))
            connection.execute(_OUTPUT_INDEX)
            connection.execute(f"PRAGMA user_version={SCHEMA_VERSION:d}")
            connection.execute("COMMIT")
            return cls(path, connection, lock_descriptor)
        except BaseException as error:
            if connection is not None:
                connection.close()
            os.close(lock_descriptor)
            if isinstance(error, sqlite3.DatabaseError):
                raise (_unreadable(path, error) or InboxUnreadable(path, str(error))) from None
            if isinstance(error, OSError) and not isinstance(error, InboxError):
                reason = error.strerror or type(error).__name__
                raise InboxUnreadable(path, reason) from None
            raise

    def verify(self) -> None:
        """Raise :class:`InboxUnreadable` unless the path still names the SQLite database
        this inbox opened (not removed, replaced, truncated or overwritten)."""
        try:
            status = os.stat(self.path)
            header = os.pread(self._file, len(_SQLITE_HEADER), 0)
        except OSError as error:
            raise InboxUnreadable(self.path, error.strerror or type(error).__name__) from None
        if (status.st_dev, status.st_ino) != self._file_id:
            raise InboxUnreadable(self.path, "the file was replaced")
        if header != _SQLITE_HEADER:
            raise InboxUnreadable(self.path, "file is not a database")

    def close(self) -> None:
        try:
            self._db.close()
        finally:
            os.close(self._file)  # after the connection: its locks are let go with it
            os.close(self._lock_descriptor)

    # --- records --------------------------------------------------------------------

    @_guarded
    def get(self, offer_id: str) -> InboxRecord | None:
        row = self._db.execute("SELECT * FROM offers WHERE offer_id = ?", (offer_id,)).fetchone()
        return None if row is None else _record(row)

    @_guarded
    def admit(self, record: InboxRecord) -> bool:
        """Insert a new record (revision 1, state ``claiming``); False if the offer is known."""
        if record.revision != 1 or record.state is not RecordState.CLAIMING:
            raise InvalidTransition("a new record starts in claiming at revision 1")
        cursor = self._db.execute(_INSERT, _row_values(record))
        return cursor.rowcount == 1

    @_guarded
    def compare_and_set(
        self, current: InboxRecord, updated: InboxRecord, *, durable: bool = True
    ) -> InboxRecord:
        """Write ``updated`` if the stored revision is still ``current.revision``.

        ``updated`` is usually ``dataclasses.replace(current, …)``; its revision is set
        here to ``current.revision + 1``. Raises :class:`InboxConflict` when the stored
        record moved on, :class:`InvalidTransition` for a change the states forbid.
        ``durable`` False: committed without waiting for the disk (the module's
        docstring says which changes may be).
        """
        for name in _IMMUTABLE:
            if getattr(updated, name) != getattr(current, name):
                raise InvalidTransition(f"{name} is fixed at admission")
        for name in _SET_ONCE:
            before = getattr(current, name)
            if before is not None and getattr(updated, name) != before:
                raise InvalidTransition(f"{name} is fixed once set")
        if updated.state is not current.state and (
            updated.state not in _TRANSITIONS[current.state]
        ):
            raise InvalidTransition(f"{current.state} -> {updated.state} is not allowed")
        if current.state.is_terminal and any(
            getattr(updated, name) != getattr(current, name)
            for name in _COLUMNS
            if name not in _AFTER_CLOSE
        ):
            raise InvalidTransition(f"{current.state} is terminal")
        written = dataclasses.replace(updated, revision=current.revision + 1)
        values = _row_values(written)
        values["expected_revision"] = current.revision
        if durable:
            cursor = self._db.execute(_UPDATE, values)
        else:
            self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                cursor = self._db.execute(_UPDATE, values)
            finally:
                self._db.execute("PRAGMA synchronous=FULL")
        if cursor.rowcount != 1:
            raise InboxConflict(current.offer_id, current.revision)
        self._unsynced = not durable  # a durable commit synced every change before it
        return written

    @_guarded
    def sync(self) -> bool:
        """Make every change committed so far durable: one fsync (a durable commit of the
        one-row ``syncs`` table), and none when nothing waits for one; whether it synced."""
        if not self._unsynced:
            return False
        self._db.execute(_SYNC)
        self._unsynced = False
        return True

    @_guarded
    def open_records(self, *, after_seq: int, limit: int) -> list[tuple[int, InboxRecord]]:
        """Up to ``limit`` records in :data:`OPEN_STATES` after the cursor ``after_seq``,
        oldest first, with their sequence numbers (the stable cursor of R-W-4)."""
        return self._in_states(OPEN_STATES, after_seq=after_seq, limit=limit)

    @_guarded
    def records(self, states: Iterable[RecordState] = tuple(RecordState)) -> list[InboxRecord]:
        return [record for _, record in self._in_states(tuple(states), after_seq=0, limit=-1)]

    @_guarded
    def closed_with_output(
        self, *, after_seq: int = 0, limit: int
    ) -> list[tuple[int, InboxRecord]]:
        """Up to ``limit`` closed records after the cursor ``after_seq``, oldest first,
        with their sequence numbers, whose output may still have to be shipped (neither
        all shipped nor given up)."""
        # By the partial index of unsettled output (open records and these): left to
        # itself SQLite reads every closed record by state, each tick, however many
        # thousands the inbox has kept.
        rows = self._db.execute(
            "SELECT * FROM offers INDEXED BY offers_output_unsettled"
            " WHERE output_shipped = 0 AND output_given_up IS NULL"
            " AND state IN (SELECT value FROM json_each(?)) AND seq > ? ORDER BY seq LIMIT ?",
            (_state_list(_TERMINAL_STATES), after_seq, limit),
        ).fetchall()
        return [(int(row["seq"]), _record(row)) for row in rows]

    @_guarded
    def remove_closed(self, *, updated_before_unix_ms: int, limit: int) -> list[InboxRecord]:
        """Delete up to ``limit`` closed records, oldest first, last changed before
        ``updated_before_unix_ms``, that owe nothing any more: their output all shipped
        or given up, and no executor that may still run (an unverified stop is kept, so
        that it is stopped again). Returns them, for their files to go too."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            rows = self._db.execute(
                "SELECT * FROM offers WHERE state IN (SELECT value FROM json_each(?))"
                " AND updated_unix_ms < ? AND (output_shipped = 1 OR output_given_up IS NOT NULL)"
                " AND quarantine_reason IS NOT ? ORDER BY seq LIMIT ?",
                (
                    _state_list(_TERMINAL_STATES),
                    updated_before_unix_ms,
                    str(QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED),
                    limit,
                ),
            ).fetchall()
            self._db.execute(
                "DELETE FROM offers WHERE offer_id IN (SELECT value FROM json_each(?))",
                (json.dumps([row["offer_id"] for row in rows]),),
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return [_record(row) for row in rows]

    @_guarded
    def quarantined(self, reason: QuarantineReason) -> list[InboxRecord]:
        # Only a quarantined record has a reason: by its index, not by reading every one.
        rows = self._db.execute(
            "SELECT * FROM offers INDEXED BY offers_by_quarantine"
            " WHERE quarantine_reason = ? AND state = ? ORDER BY seq",
            (str(reason), str(RecordState.QUARANTINED)),
        ).fetchall()
        return [_record(row) for row in rows]

    @_guarded
    def count(self, states: Iterable[RecordState]) -> int:
        row = self._db.execute(
            "SELECT count(*) FROM offers WHERE state IN (SELECT value FROM json_each(?))",
            (_state_list(states),),
        ).fetchone()
        return int(row[0])

    def _in_states(
        self, states: Sequence[RecordState], *, after_seq: int, limit: int
    ) -> list[tuple[int, InboxRecord]]:
        rows = self._db.execute(
            "SELECT * FROM offers WHERE state IN (SELECT value FROM json_each(?))"
            " AND seq > ? ORDER BY seq LIMIT ?",
            (_state_list(states), after_seq, limit),
        ).fetchall()
        return [(int(row["seq"]), _record(row)) for row in rows]

    # --- the session ----------------------------------------------------------------

    @_guarded
    def session(self) -> SessionRecord | None:
        row = self._db.execute(
            "SELECT revision, worker_id, open_request_id, session_id, worker_generation"
            " FROM session WHERE slot = 1"
        ).fetchone()
        if row is None:
            return None
        return SessionRecord(
            revision=int(row["revision"]),
            worker_id=str(row["worker_id"]),
            open_request_id=str(row["open_request_id"]),
            session_id=row["session_id"],
            worker_generation=row["worker_generation"],
        )

    @_guarded
    def save_session(self, current: SessionRecord | None, updated: SessionRecord) -> SessionRecord:
        """Compare-and-set of the one session row (``current`` None: it must not exist)."""
        if current is None:
            written = dataclasses.replace(updated, revision=1)
            cursor = self._db.execute(
                "INSERT INTO session (slot, revision, worker_id, open_request_id, session_id,"
                " worker_generation) SELECT 1, 1, ?, ?, ?, ?"
                " WHERE NOT EXISTS (SELECT 1 FROM session)",
                (
                    written.worker_id,
                    written.open_request_id,
                    written.session_id,
                    written.worker_generation,
                ),
            )
            if cursor.rowcount != 1:
                raise InboxConflict("session", 0)
            return written
        written = dataclasses.replace(updated, revision=current.revision + 1)
        cursor = self._db.execute(
            "UPDATE session SET revision = ?, worker_id = ?, open_request_id = ?,"
            " session_id = ?, worker_generation = ? WHERE slot = 1 AND revision = ?",
            (
                written.revision,
                written.worker_id,
                written.open_request_id,
                written.session_id,
                written.worker_generation,
                current.revision,
            ),
        )
        if cursor.rowcount != 1:
            raise InboxConflict("session", current.revision)
        return written


def parameters_of(given: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """A Run's parameters as a record keeps them: (name, value) pairs, sorted by name."""
    return tuple(sorted((str(name), str(value)) for name, value in given.items()))


def _state_list(states: Iterable[RecordState]) -> str:
    return json.dumps([str(state) for state in states])


def _row_values(record: InboxRecord) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in _COLUMNS:
        value = getattr(record, name)
        if name == "argv":
            value = json.dumps(list(value))
        elif name == "parameters":
            value = json.dumps(dict(value), sort_keys=True)
        elif isinstance(value, StrEnum):
            value = str(value)
        values[name] = value
    return values


def _record(row: sqlite3.Row) -> InboxRecord:
    values = {name: row[name] for name in _COLUMNS}
    values["state"] = RecordState(values["state"])
    values["argv"] = tuple(str(item) for item in json.loads(values["argv"]))
    values["parameters"] = parameters_of(json.loads(values["parameters"]))
    if values["quarantine_reason"] is not None:
        values["quarantine_reason"] = QuarantineReason(values["quarantine_reason"])
    values["output_shipped"] = bool(values["output_shipped"])
    return InboxRecord(**values)
