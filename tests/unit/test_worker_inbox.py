"""The Worker's durable inbox (SPEC R-W-1) on a real SQLite file: compare-and-set on every
change, durability across reopen, a private file, and no secret in any repr or log."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import sqlite3
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from qinglong_worker.clock import BootInstant, boot_now, wall_clock_ms
from qinglong_worker.inbox import (
    SCHEMA_VERSION,
    Inbox,
    InboxConflict,
    InboxError,
    InboxLocked,
    InboxRecord,
    InboxUnreadable,
    InboxUnwritable,
    InvalidTransition,
    QuarantineReason,
    RecordState,
    SessionRecord,
    parameters_of,
)
from qinglong_worker.reconcile import new_capability
from qinglong_worker.settings import parse_worker_settings

BOOT = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
OTHER_BOOT = "11111111-2222-3333-4444-555555555555"


def _record(offer_id: str | None = None) -> InboxRecord:
    return InboxRecord(
        offer_id=offer_id or str(uuid.uuid4()),
        revision=1,
        state=RecordState.CLAIMING,
        worker_id="worker-a",
        session_id=str(uuid.uuid4()),
        worker_generation=3,
        project_id="default",
        run_id=str(uuid.uuid4()),
        capability=new_capability(),
        argv=("sh", "-c", "echo hi"),
        timeout_ms=60_000,
        created_unix_ms=1_000,
        updated_unix_ms=1_000,
    )


@pytest.fixture
def inbox_path(tmp_path: Path) -> Path:
    return tmp_path / "worker" / "inbox.db"


def test_every_change_is_a_compare_and_set_on_revision(inbox_path: Path) -> None:
    inbox = Inbox.open(inbox_path)
    try:
        admitted = _record()
        assert inbox.admit(admitted)
        assert not inbox.admit(_record(admitted.offer_id)), "one record per offer"
        claimed = inbox.compare_and_set(
            admitted,
            dataclasses.replace(
                admitted,
                state=RecordState.CLAIMED,
                attempt_id=str(uuid.uuid4()),
                lease_generation=1,
                lease_version=1,
            ),
        )
        assert claimed.revision == 2
        # A writer holding the old revision loses, and nothing changes.
        with pytest.raises(InboxConflict):
            inbox.compare_and_set(
                admitted, dataclasses.replace(admitted, state=RecordState.ABANDONED)
            )
        # So does a second writer racing on the same revision: only the first wins.
        renewed = inbox.compare_and_set(claimed, dataclasses.replace(claimed, lease_version=2))
        with pytest.raises(InboxConflict):
            inbox.compare_and_set(claimed, dataclasses.replace(claimed, lease_version=7))
        assert inbox.get(admitted.offer_id) == renewed
        assert renewed.revision == 3
        assert renewed.lease_version == 2
        # The state machine and the fixed identity are guarded too.
        with pytest.raises(InvalidTransition):
            inbox.compare_and_set(
                renewed, dataclasses.replace(renewed, state=RecordState.COMPLETION_ACKNOWLEDGED)
            )
        with pytest.raises(InvalidTransition):
            inbox.compare_and_set(
                renewed, dataclasses.replace(renewed, capability=new_capability())
            )
        with pytest.raises(InvalidTransition):
            inbox.compare_and_set(renewed, dataclasses.replace(renewed, attempt_id="other"))
        closed = inbox.compare_and_set(
            renewed,
            dataclasses.replace(
                renewed,
                state=RecordState.QUARANTINED,
                quarantine_reason=QuarantineReason.CONTROL_PLANE_TERMINAL,
            ),
        )
        with pytest.raises(InvalidTransition):
            inbox.compare_and_set(closed, dataclasses.replace(closed, detail="again"))
        assert inbox.get(admitted.offer_id) == closed
    finally:
        inbox.close()


def test_records_and_session_survive_a_restart(inbox_path: Path) -> None:
    inbox = Inbox.open(inbox_path)
    first, second = _record(), _record()
    inbox.admit(first)
    inbox.admit(second)
    running = inbox.compare_and_set(
        first,
        dataclasses.replace(
            first,
            state=RecordState.CLAIMED,
            attempt_id=str(uuid.uuid4()),
            lease_generation=1,
            lease_version=4,
            lease_observed_unix_ms=1_700_000_000_000,
            lease_observed_boot_ms=10_000,
            lease_observed_boot_id=BOOT,
            lease_remaining_ms=30_000,
        ),
    )
    session = inbox.save_session(
        None, SessionRecord(revision=0, worker_id="worker-a", open_request_id="req-1")
    )
    with pytest.raises(InboxConflict):
        inbox.save_session(None, session)
    inbox.save_session(
        session, dataclasses.replace(session, session_id=first.session_id, worker_generation=3)
    )
    # The journal is held exclusively while open.
    with pytest.raises(InboxLocked):
        Inbox.open(inbox_path)
    inbox.close()

    # A different process reads what this one committed (nothing lives only in memory).
    probe = (
        "import sys; from pathlib import Path; from qinglong_worker.inbox import Inbox;"
        "i = Inbox.open(Path(sys.argv[1])); r = i.get(sys.argv[2]);"
        "print(r.state, r.revision, r.lease_version, r.lease_observed); i.close()"
    )
    seen = subprocess.run(
        [sys.executable, "-c", probe, str(inbox_path), first.offer_id],
        capture_output=True,
        text=True,
        check=True,
    )
    assert seen.stdout.split() == [
        "claimed",
        "2",
        "4",
        f"BootInstant(boot_id='{BOOT}',",
        "ms=10000)",
    ]

    reopened = Inbox.open(inbox_path)
    try:
        assert reopened.get(first.offer_id) == running
        assert running.capability == first.capability  # the capability is durable
        assert [r.offer_id for _, r in reopened.open_records(after_seq=0, limit=10)] == [
            first.offer_id,
            second.offer_id,
        ]
        # The cursor is stable: continue after the first.
        [(_, after)] = reopened.open_records(after_seq=1, limit=10)
        assert after.offer_id == second.offer_id
        restored = reopened.session()
        assert restored is not None
        assert (restored.session_id, restored.worker_generation, restored.revision) == (
            first.session_id,
            3,
            2,
        )
        assert running.lease_lost_locally(BootInstant(BOOT, 39_999)) is False
        assert running.lease_lost_locally(BootInstant(BOOT, 40_000)) is True
        assert running.lease_left_ms(BootInstant(BOOT, 25_000)) == 15_000
        # Readings of another boot compare with nothing: that lease ended with its boot.
        assert running.lease_lost_locally(BootInstant(OTHER_BOOT, 11_000)) is True
    finally:
        reopened.close()


def test_the_inbox_file_is_private(inbox_path: Path) -> None:
    inbox = Inbox.open(inbox_path)
    try:
        inbox.admit(_record())
        for path in (inbox_path, inbox_path.with_name(inbox_path.name + "-wal")):
            assert path.exists()
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert stat.S_IMODE(inbox_path.parent.stat().st_mode) == 0o700
        mode = inbox._db.execute("PRAGMA journal_mode").fetchone()[0]
        synchronous = inbox._db.execute("PRAGMA synchronous").fetchone()[0]
        assert (mode, synchronous) == ("wal", 2)  # 2 = FULL
    finally:
        inbox.close()
    # A file that already exists with a loose mode is tightened on open.
    inbox_path.chmod(0o644)
    Inbox.open(inbox_path).close()
    assert stat.S_IMODE(inbox_path.stat().st_mode) == 0o600


def test_no_secret_in_repr_errors_or_logs(
    inbox_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token = secrets.token_urlsafe(32)
    inbox = Inbox.open(inbox_path)
    try:
        record = _record()
        inbox.admit(record)
        claimed = inbox.compare_and_set(
            record,
            dataclasses.replace(
                record,
                state=RecordState.CLAIMED,
                attempt_id=str(uuid.uuid4()),
                lease_generation=1,
                lease_version=1,
            ),
        )
        launching = inbox.compare_and_set(
            claimed,
            dataclasses.replace(
                claimed, state=RecordState.LAUNCHING, callback_token=token, callback_sequence=1
            ),
        )
        with pytest.raises(InboxConflict) as conflict:
            inbox.compare_and_set(claimed, launching)
        logging.getLogger("test").info("record %r", launching)
        rendered = "\n".join([repr(launching), str(launching), str(conflict.value), caplog.text])
        assert record.capability not in rendered
        assert token not in rendered
        assert launching.offer_id in rendered  # ids are fine to show
        # The secrets are durable all the same: they are what recovery needs.
        stored = inbox.get(record.offer_id)
        assert stored is not None
        assert (stored.capability, stored.callback_token) == (record.capability, token)
    finally:
        inbox.close()


def _garble(path: Path) -> None:
    """Overwrite a file's bytes in place (same inode), as a disk or an operator might."""
    size = max(path.stat().st_size, 4096)
    with path.open("r+b") as stream:
        stream.write(os.urandom(size))


def test_a_file_that_is_not_a_database_is_refused_naming_it(inbox_path: Path) -> None:
    inbox_path.parent.mkdir(parents=True)
    inbox_path.write_bytes(b"this is no database" * 300)
    with pytest.raises(InboxUnreadable) as refused:
        Inbox.open(inbox_path)
    assert str(refused.value) == f"inbox {inbox_path} is unreadable: file is not a database"
    assert refused.value.path == inbox_path
    # The refusal released the lock: once the file is fixed, the inbox opens.
    inbox_path.unlink()
    Inbox.open(inbox_path).close()


def test_verify_notices_a_file_overwritten_underneath_the_connection(inbox_path: Path) -> None:
    inbox = Inbox.open(inbox_path)
    try:
        inbox.admit(_record())
        inbox.verify()
        _garble(inbox_path)
        with pytest.raises(InboxUnreadable, match="file is not a database") as refused:
            inbox.verify()
        assert str(inbox_path) in str(refused.value)
    finally:
        inbox.close()


def test_verify_notices_a_replaced_or_removed_file(inbox_path: Path, tmp_path: Path) -> None:
    inbox = Inbox.open(inbox_path)
    try:
        other = Inbox.open(tmp_path / "other" / "inbox.db")
        other.close()
        os.replace(tmp_path / "other" / "inbox.db", inbox_path)  # a valid database, not ours
        with pytest.raises(InboxUnreadable, match="the file was replaced"):
            inbox.verify()
        inbox_path.unlink()
        with pytest.raises(InboxUnreadable, match="No such file"):
            inbox.verify()
    finally:
        inbox.close()


#: A Worker process: opens the inbox, writes, verifies it (as every tick does), lets a
#: reader in another process open and close the database (an operator's sqlite3, a backup),
#: writes on, and is killed with SIGKILL.
_WORKER_THEN_KILLED = """
import dataclasses, os, signal, sqlite3, subprocess, sys
from pathlib import Path
from qinglong_worker.inbox import Inbox, RecordState
from tests.unit.test_worker_inbox import _record

path = Path(sys.argv[1])
inbox = Inbox.open(path)
first = _record("first")
inbox.admit(first)
inbox.verify()
reader = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
          "c.execute('SELECT count(*) FROM offers').fetchone(); c.close()")
subprocess.run([sys.executable, "-c", reader, str(path)], check=True)
inbox.admit(_record("second"))
stored = inbox.get("first")
inbox.compare_and_set(stored, dataclasses.replace(stored, state=RecordState.CLAIMED,
                      attempt_id="attempt-1", lease_generation=1, lease_version=1))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_what_the_worker_wrote_survives_kill_9_after_a_reader_came_and_went(
    inbox_path: Path,
) -> None:
    """The inbox holds no descriptor it closes again while SQLite's connection is open: a
    close would drop SQLite's locks, and a reader closing its own connection would then
    delete the WAL the Worker still writes to, losing every later write at a crash."""
    repository = Path(__file__).resolve().parents[2]
    killed = subprocess.run(
        [sys.executable, "-c", _WORKER_THEN_KILLED, str(inbox_path)],
        cwd=repository,
        env={**os.environ, "PYTHONPATH": str(repository)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert killed.returncode == -9, killed.stderr
    inbox = Inbox.open(inbox_path)
    try:
        kept = {record.offer_id: record.state for record in inbox.records()}
    finally:
        inbox.close()
    lost = {"first": RecordState.CLAIMED, "second": RecordState.CLAIMING}.items() - kept.items()
    print(f"kill -9 after a reader came and went: writes lost {len(lost)}")
    assert kept == {"first": RecordState.CLAIMED, "second": RecordState.CLAIMING}


def test_a_statement_sqlite_refuses_is_an_unreadable_inbox(inbox_path: Path) -> None:
    inbox = Inbox.open(inbox_path)
    try:
        record = _record()
        inbox.admit(record)
        for path in (inbox_path, Path(f"{inbox_path}-wal"), Path(f"{inbox_path}-shm")):
            _garble(path)
        with pytest.raises(InboxUnreadable) as refused:
            inbox.get(record.offer_id)
        assert str(inbox_path) in str(refused.value)
        assert refused.value.__cause__ is None, "SQLite's own exception is not chained"
    finally:
        inbox.close()


def _admit_many(inbox: Inbox, count: int) -> None:
    for _ in range(count):
        inbox.admit(_record())


def test_a_full_disk_is_an_unwritable_inbox_not_a_damaged_one(inbox_path: Path) -> None:
    """SQLite's own SQLITE_FULL (its page limit set to what the file holds): the error
    says the disk refuses writes and not to move the inbox aside; the file stays sound,
    and once there is room again the same inbox takes the write."""
    inbox = Inbox.open(inbox_path)
    try:
        inbox.admit(_record())
        db = inbox._db
        (pages,) = db.execute("PRAGMA page_count").fetchone()
        db.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(InboxUnwritable) as refused:
            _admit_many(inbox, 1000)
        assert isinstance(refused.value, InboxUnreadable), "fatal while running, as before"
        message = str(refused.value)
        assert message.startswith(f"inbox {inbox_path} cannot be written: database or disk")
        assert "do not move it aside" in message
        db.execute("PRAGMA max_page_count = 1073741823")
        assert inbox.admit(_record())
        inbox.verify()
    finally:
        inbox.close()


def _closed(
    inbox: Inbox,
    record: InboxRecord,
    reason: QuarantineReason = QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED,
) -> InboxRecord:
    """Admit ``record``, then claim and close it (a lease lost locally)."""
    assert inbox.admit(record)
    claimed = inbox.compare_and_set(
        record,
        dataclasses.replace(
            record,
            state=RecordState.CLAIMED,
            attempt_id=str(uuid.uuid4()),
            lease_generation=1,
            lease_version=1,
        ),
    )
    return inbox.compare_and_set(
        claimed,
        dataclasses.replace(
            claimed,
            state=RecordState.QUARANTINED,
            quarantine_reason=reason,
        ),
    )


def _reopened_at_schema(inbox: Inbox, version: int) -> Inbox:
    """Close ``inbox``, turn its file into what a Worker of schema ``version`` left behind,
    and open it again (upgrading it, as a Worker does)."""
    inbox.close()
    path = inbox.path
    with sqlite3.connect(path) as old:
        if version <= 7:
            old.execute("ALTER TABLE offers DROP COLUMN parameters")
        if version <= 4:
            old.execute("ALTER TABLE offers DROP COLUMN lease_observed_boot_id")
            old.execute("ALTER TABLE offers DROP COLUMN lease_observed_boot_ms")
        if version <= 3:
            old.execute("ALTER TABLE offers DROP COLUMN executor_boot_id")
        if version <= 2:
            old.execute("DROP INDEX offers_output_unsettled")
            old.execute("ALTER TABLE offers DROP COLUMN output_shipped")
            old.execute("ALTER TABLE offers DROP COLUMN output_given_up")
        if version == 1:
            old.execute("ALTER TABLE offers DROP COLUMN output_offset")
        old.execute(f"PRAGMA user_version={version:d}")
    return Inbox.open(path)


def test_an_inbox_of_schema_1_is_upgraded_in_place(inbox_path: Path) -> None:
    """A Worker from before output shipping left a version-1 inbox: its records stay,
    with nothing of their output shipped yet, and its closed records owe no output (they
    never promised any)."""
    inbox = Inbox.open(inbox_path)
    record = _record()
    inbox.admit(record)
    closed = _closed(inbox, _record())
    inbox = _reopened_at_schema(inbox, 1)
    try:
        upgraded = inbox.get(record.offer_id)
        assert upgraded is not None
        assert upgraded.output_offset == 0
        assert dataclasses.replace(upgraded, output_offset=0) == record
        shipped = inbox.compare_and_set(upgraded, dataclasses.replace(upgraded, output_offset=42))
        assert shipped.output_offset == 42
        old_closed = inbox.get(closed.offer_id)
        assert old_closed is not None
        assert old_closed.output_shipped
        assert inbox.closed_with_output(limit=10) == []
    finally:
        inbox.close()
    with sqlite3.connect(inbox_path) as reopened:
        assert reopened.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)


def _closed_records(inbox: Inbox, *, after_seq: int = 0, limit: int = 10) -> list[InboxRecord]:
    return [record for _, record in inbox.closed_with_output(after_seq=after_seq, limit=limit)]


def test_an_inbox_of_schema_2_keeps_closed_records_output_to_ship(inbox_path: Path) -> None:
    """A record a schema-2 Worker closed before all its output was shipped is shipped by
    the upgraded Worker (its offset is kept); an older Worker refuses the upgraded file."""
    inbox = Inbox.open(inbox_path)
    closed = _closed(inbox, _record())
    closed = inbox.compare_and_set(closed, dataclasses.replace(closed, output_offset=7))
    inbox = _reopened_at_schema(inbox, 2)
    try:
        upgraded = inbox.get(closed.offer_id)
        assert upgraded == closed
        assert _closed_records(inbox) == [closed]
    finally:
        inbox.close()
    with sqlite3.connect(inbox_path) as reopened:
        assert reopened.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)


def test_an_inbox_of_schema_3_gains_the_executors_boot(inbox_path: Path) -> None:
    """A schema-3 record names its executor by PID and start time only: upgraded, its boot
    is unknown (the identity is probed as before), and is set once for a new executor."""
    inbox = Inbox.open(inbox_path)
    record = _record()
    inbox.admit(record)
    inbox = _reopened_at_schema(inbox, 3)
    try:
        upgraded = inbox.get(record.offer_id)
        assert upgraded == record
        assert upgraded is not None
        assert upgraded.executor_boot_id is None
        boot = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
        started = inbox.compare_and_set(
            upgraded, dataclasses.replace(upgraded, executor_pid=7, executor_boot_id=boot)
        )
        assert started.executor_boot_id == boot
        with pytest.raises(InboxError):
            inbox.compare_and_set(started, dataclasses.replace(started, executor_boot_id=None))
    finally:
        inbox.close()


@pytest.mark.parametrize("older", [5, 6, 7])
def test_an_inbox_of_schema_5_to_7_is_read_unchanged_and_marked_8(
    inbox_path: Path, older: int
) -> None:
    """Schemas 6 (supervisors watch lease files) and 7 (a record may be given back for a
    fault of the machine) change no table, and 8 adds the Run's parameters: an older
    record is read unchanged (with no parameters), and the file then says 8, which an
    older Worker refuses."""
    inbox = Inbox.open(inbox_path)
    record = _record()
    inbox.admit(record)
    inbox = _reopened_at_schema(inbox, older)
    try:
        assert inbox.get(record.offer_id) == record
    finally:
        inbox.close()
    with sqlite3.connect(inbox_path) as reopened:
        assert reopened.execute("PRAGMA user_version").fetchone() == (8,) == (SCHEMA_VERSION,)


def test_an_inbox_of_schema_4_counts_its_wall_clock_leases_as_lost(inbox_path: Path) -> None:
    """A schema-4 Worker measured the local lease on the wall clock alone. Upgraded, its
    records keep every fact but get no boot-clock observation: however fresh the
    wall-clock estimate, the lease counts as run out, never as still held (a claim not
    yet answered has none to lose); a new answer is observed on the boot clock."""
    inbox = Inbox.open(inbox_path)
    claiming = _record()
    inbox.admit(claiming)
    admitted = _record()
    inbox.admit(admitted)
    running = inbox.compare_and_set(
        admitted,
        dataclasses.replace(
            admitted,
            state=RecordState.CLAIMED,
            attempt_id=str(uuid.uuid4()),
            lease_generation=1,
            lease_version=1,
            lease_observed_unix_ms=wall_clock_ms(),  # observed just now, 30 s left
            lease_remaining_ms=30_000,
        ),
    )
    inbox = _reopened_at_schema(inbox, 4)
    try:
        upgraded = inbox.get(running.offer_id)
        assert upgraded == running
        assert upgraded is not None
        assert (upgraded.lease_observed_boot_ms, upgraded.lease_observed_boot_id) == (None, None)
        now = boot_now()
        assert upgraded.lease_left_ms(now) is None
        assert upgraded.lease_lost_locally(now)
        unanswered = inbox.get(claiming.offer_id)
        assert unanswered is not None
        assert not unanswered.lease_lost_locally(now)
        renewed = inbox.compare_and_set(
            upgraded,
            dataclasses.replace(
                upgraded,
                lease_version=2,
                lease_observed_boot_ms=now.ms,
                lease_observed_boot_id=now.boot_id,
                lease_remaining_ms=30_000,
            ),
        )
        assert inbox.get(running.offer_id) == renewed
        assert not renewed.lease_lost_locally(now)
    finally:
        inbox.close()
    with sqlite3.connect(inbox_path) as reopened:
        assert reopened.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)


def test_a_closed_record_changes_only_its_output_shipping(inbox_path: Path) -> None:
    inbox = Inbox.open(inbox_path)
    try:
        closed = _closed(inbox, _record())
        other = _closed(inbox, _record())
        assert _closed_records(inbox) == [closed, other]
        [(seq, first)] = inbox.closed_with_output(limit=1)
        assert first == closed
        assert _closed_records(inbox, after_seq=seq) == [other]
        moved = inbox.compare_and_set(closed, dataclasses.replace(closed, output_offset=100))
        assert moved.output_offset == 100
        for change in ({"detail": "again"}, {"lease_version": 9}, {"exit_code": 0}):
            with pytest.raises(InvalidTransition):
                inbox.compare_and_set(moved, dataclasses.replace(moved, **change))
        given_up = inbox.compare_and_set(
            moved, dataclasses.replace(moved, output_given_up="REPLAY_MISMATCH")
        )
        done = inbox.compare_and_set(other, dataclasses.replace(other, output_shipped=True))
        assert inbox.closed_with_output(limit=10) == []
        assert inbox.get(closed.offer_id) == given_up
        assert inbox.get(other.offer_id) == done
        # An open record is never listed, whatever its output.
        assert inbox.admit(_record())
        assert inbox.closed_with_output(limit=10) == []
    finally:
        inbox.close()


def test_an_inbox_newer_than_the_worker_is_refused(inbox_path: Path) -> None:
    """No downgrade: a Worker refuses an inbox a newer Worker upgraded, changing nothing
    (docs/worker-operations.md, "Upgrades are one-way")."""
    newer_version = SCHEMA_VERSION + 1
    Inbox.open(inbox_path).close()
    with sqlite3.connect(inbox_path) as newer:
        newer.execute(f"PRAGMA user_version={newer_version:d}")
    with pytest.raises(InboxError, match=f"unsupported inbox schema version {newer_version}"):
        Inbox.open(inbox_path)
    with sqlite3.connect(inbox_path) as reopened:
        assert reopened.execute("PRAGMA user_version").fetchone() == (newer_version,)


def test_closed_records_that_owe_nothing_are_removed_once_old_enough(inbox_path: Path) -> None:
    """Retention removes a closed record only when nothing is owed: all its output
    shipped or given up, no executor that may still run, and older than the cutoff."""
    inbox = Inbox.open(inbox_path)
    try:

        def closed(**changes: Any) -> InboxRecord:
            record = _closed(inbox, _record())
            return inbox.compare_and_set(record, dataclasses.replace(record, **changes))

        shipped = closed(output_shipped=True)
        given_up = closed(output_given_up="REPLAY_MISMATCH")
        owing = closed(output_offset=7)
        unverified = _closed(
            inbox, _record(), QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED
        )
        unverified = inbox.compare_and_set(
            unverified, dataclasses.replace(unverified, output_shipped=True)
        )
        recent = closed(output_shipped=True, updated_unix_ms=5_000)
        still_open = _record()
        assert inbox.admit(still_open)
        removed = inbox.remove_closed(updated_before_unix_ms=2_000, limit=10)
        assert {r.offer_id for r in removed} == {shipped.offer_id, given_up.offer_id}
        for gone in removed:
            assert inbox.get(gone.offer_id) is None
        for kept in (owing, unverified, recent, still_open):
            assert inbox.get(kept.offer_id) is not None
        assert inbox.remove_closed(updated_before_unix_ms=2_000, limit=10) == []
        assert [r.offer_id for r in inbox.remove_closed(updated_before_unix_ms=9_000, limit=1)] == [
            recent.offer_id
        ]
    finally:
        inbox.close()


@pytest.mark.parametrize(
    ("flag", "kept_for_seconds"),
    [(None, 7 * 86_400), ("0", 0.0), ("1", 86_400), ("30", 30 * 86_400)],
)
def test_retention_days_are_a_day_or_more_or_for_ever(
    flag: str | None, kept_for_seconds: float
) -> None:
    argv = ["run", "--worker-id", "w", "--ingress-address", "i:1", "--inbox", "/tmp/i.db"]
    argv += ["--tls-ca", "a", "--tls-cert", "b", "--tls-key", "c"]
    daemon = parse_worker_settings([*argv, *(() if flag is None else ("--retention-days", flag))])[
        1
    ].daemon
    assert daemon is not None
    assert daemon.retention_days * 86_400 == kept_for_seconds


@pytest.mark.parametrize("days", ["0.5", "-1"])
def test_a_retention_shorter_than_a_day_is_refused(
    days: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--worker-id", "w", "--ingress-address", "i:1", "--inbox", "/tmp/i.db"]
    argv += ["--tls-ca", "a", "--tls-cert", "b", "--tls-key", "c", "--retention-days", days]
    with pytest.raises(SystemExit) as refused:
        parse_worker_settings(argv)
    assert refused.value.code == 2
    assert "--retention-days must be 0 (for ever) or at least 1" in capsys.readouterr().err


#: A Worker process that renews one record's lease ``count`` times, durably or not, then
#: is killed with SIGKILL (by itself, the instant after the last write returned).
_RENEWER = """
import dataclasses, os, signal, sys
from pathlib import Path
from qinglong_worker.inbox import Inbox
path, offer_id, count, durable = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
inbox = Inbox.open(path)
record = inbox.get(offer_id)
os.write(2, b"renewals\\n")  # what opening the file syncs comes before this line
for _ in range(count):
    renewed = dataclasses.replace(record, lease_version=(record.lease_version or 0) + 1)
    record = inbox.compare_and_set(record, renewed, durable=durable == "durable")
if durable == "synced":
    assert inbox.sync()
    assert not inbox.sync()  # nothing new since: no second sync
os.kill(os.getpid(), signal.SIGKILL)
"""
RENEWALS = 20


def _renew_then_die(inbox_path: Path, offer_id: str, durability: str) -> int:
    """Run :data:`_RENEWER` under strace; how many fsync/fdatasync it made from its
    first renewal on."""
    trace = inbox_path.with_name(f"strace-{durability}")
    traced = subprocess.run(
        [
            "strace",
            *("-f", "-e", "trace=fsync,fdatasync,write", "-o", str(trace)),
            *(sys.executable, "-c", _RENEWER, str(inbox_path), offer_id),
            *(str(RENEWALS), durability),
        ],
        check=False,
        capture_output=True,
        timeout=60,
    )
    # strace ends as its tracee did: killed by SIGKILL (not a failed script).
    assert traced.returncode == -signal.SIGKILL, traced.stderr.decode()[-2000:]
    lines = trace.read_text().splitlines()
    (start,) = [n for n, line in enumerate(lines) if '"renewals\\n"' in line]
    return sum(1 for line in lines[start:] if "fsync(" in line or "fdatasync(" in line)


def test_renewals_not_marked_durable_wait_for_no_disk_yet_survive_kill_9(
    inbox_path: Path,
) -> None:
    """The steady state of a running Attempt (a renewal every lease-control interval)
    costs no fsync on the event loop's thread, and a kill -9 right after it loses
    nothing: the kernel holds what SQLite wrote to its WAL. A durable write still syncs
    (and with it, every write before it)."""
    inbox = Inbox.open(inbox_path)
    admitted = _record()
    inbox.admit(admitted)
    inbox.close()
    synced = {
        durability: _renew_then_die(inbox_path, admitted.offer_id, durability)
        for durability in ("relaxed", "synced", "durable")
    }
    print(f"fsyncs for {RENEWALS} renewals: {synced}")
    assert synced == {"relaxed": 0, "synced": 1, "durable": RENEWALS}
    reopened = Inbox.open(inbox_path)
    try:
        stored = reopened.get(admitted.offer_id)
        assert stored is not None
        assert stored.lease_version == 3 * RENEWALS
        assert stored.revision == admitted.revision + 3 * RENEWALS
        # The connection is back to FULL after a relaxed write: the next is durable.
        reopened.compare_and_set(
            stored, dataclasses.replace(stored, lease_version=0), durable=False
        )
        assert reopened._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    finally:
        reopened.close()


def test_a_runs_parameters_are_kept_exactly(inbox_path: Path) -> None:
    """Names sorted, values byte for byte (newlines, `=`, quotes, non-ASCII), across a
    reopen; a record without any has none."""
    inbox = Inbox.open(inbox_path)
    given = {"TARGET": "prod=eu\n'west' \u00e9\u6625", "A_1": "", "LEVEL": '"3"'}
    record = dataclasses.replace(_record(), parameters=parameters_of(given))
    plain = _record()
    try:
        inbox.admit(record)
        inbox.admit(plain)
    finally:
        inbox.close()
    reopened = Inbox.open(inbox_path)
    try:
        kept = reopened.get(record.offer_id)
        assert kept is not None
        assert kept.parameters == (("A_1", ""), ("LEVEL", '"3"'), ("TARGET", given["TARGET"]))
        assert dict(kept.parameters) == given
        none = reopened.get(plain.offer_id)
        assert none is not None
        assert none.parameters == ()
    finally:
        reopened.close()
