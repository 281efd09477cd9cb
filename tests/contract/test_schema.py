"""The schema: migrations, the documented schema, and the states PostgreSQL itself refuses."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from psycopg import errors
from qinglong_control.db.identities import enroll_operator_token, grant_cluster_admin
from qinglong_control.db.migrate import (
    LOCK_TIMEOUT_MS,
    MIGRATION_LOCK_KEY,
    OUTSIDE_TRANSACTION,
    Migration,
    MigrationError,
    load_migrations,
    migrate,
)
from qinglong_control.db.schema_dump import dump_schema

from tests.support.polling import wait_until
from tests.support.postgres import MigratedDatabase
from tests.support.seed import NOW_MS, SeededAttempt, digest, seed_claimed_attempt, seed_identity

DOCUMENTED_SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "schema.sql"


def test_documented_schema_equals_what_the_migrations_build(database: MigratedDatabase) -> None:
    built = dump_schema(database.bin_dir / "pg_dump", database.urls.migration)
    assert built == DOCUMENTED_SCHEMA.read_text(), (
        "docs/schema.sql is stale: run `.venv/bin/python scripts/dump_schema.py`"
    )


def test_migrations_are_recorded_with_checksums_and_idempotent(database: MigratedDatabase) -> None:
    shipped = load_migrations()
    assert migrate(database.urls.migration) == []
    with psycopg.connect(database.urls.migration) as conn:
        history = conn.execute(
            "SELECT version, name, checksum FROM public.qinglong_schema_migrations ORDER BY version"
        ).fetchall()
    assert history == [(m.version, m.name, m.checksum) for m in shipped]


def test_a_changed_migration_is_refused(database: MigratedDatabase) -> None:
    first = load_migrations()[0]
    tampered = Migration(first.version, first.name, first.sql + "\n-- edited after release\n")
    with pytest.raises(MigrationError, match="changed after it was applied"):
        migrate(database.urls.migration, [tampered])


def test_a_failing_migration_leaves_no_trace(database: MigratedDatabase) -> None:
    shipped = load_migrations()
    broken = Migration(
        len(shipped) + 1,
        "broken",
        "CREATE TABLE qinglong.half_done (id int);\nSELECT 1 / 0;\n",
    )
    with pytest.raises(errors.DivisionByZero):
        migrate(database.urls.migration, [*shipped, broken])
    with psycopg.connect(database.urls.migration) as conn:
        assert conn.execute("SELECT to_regclass('qinglong.half_done')").fetchone() == (None,)
        assert conn.execute(
            "SELECT count(*) FROM public.qinglong_schema_migrations WHERE version = %s",
            (broken.version,),
        ).fetchone() == (0,)


def test_an_index_migration_that_stopped_half_way_is_run_again(
    database: MigratedDatabase,
) -> None:
    """An outside-transaction migration builds its index CONCURRENTLY (the table's writers
    go on meanwhile). A build that fails leaves an invalid index and no history row; run
    again once the cause is gone, it drops that index, builds it whole and records itself."""
    shipped = load_migrations()
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        conn.execute("CREATE TABLE qinglong.scratch (v int)")
        conn.execute("INSERT INTO qinglong.scratch VALUES (1), (1), (2)")
    index = Migration(
        len(shipped) + 1,
        "scratch_index",
        f"{OUTSIDE_TRANSACTION}\n-- a unique index the duplicate 1 refuses at first\n"
        "DROP INDEX CONCURRENTLY IF EXISTS qinglong.scratch_v;\n"
        "CREATE UNIQUE INDEX CONCURRENTLY scratch_v ON qinglong.scratch (v);\n",
    )
    assert not index.in_transaction
    with pytest.raises(errors.UniqueViolation):
        migrate(database.urls.migration, [*shipped, index])
    query = (
        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE c.relname = 'scratch_v'"
    )
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        assert conn.execute(query).fetchall() == [(False,)], "the failed build's leftover"
        conn.execute("DELETE FROM qinglong.scratch WHERE ctid = (SELECT min(ctid)"
                     " FROM qinglong.scratch WHERE v = 1)")  # fmt: skip
    assert migrate(database.urls.migration, [*shipped, index]) == [
        f"{index.version:04d}_scratch_index"
    ]
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        assert conn.execute(query).fetchall() == [(True,)]
        assert conn.execute(
            "SELECT count(*) FROM public.qinglong_schema_migrations WHERE version = %s",
            (index.version,),
        ).fetchone() == (1,)


def _tried_the_turn(observer: psycopg.Connection[tuple[object, ...]]) -> int:
    """Other sessions whose last statement asked for the migrators' turn."""
    row = observer.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
        " AND query LIKE 'SELECT pg_try_advisory_lock(%%'"
    ).fetchone()
    return 0 if row is None else int(row[0])


def test_a_migrator_waits_for_the_one_that_holds_the_turn(database: MigratedDatabase) -> None:
    """Migrators take turns (several pods may start the Job at once): one that finds the
    lock held applies nothing until it is given back, then applies what is pending."""
    shipped = load_migrations()
    table = Migration(len(shipped) + 1, "after_the_turn", "CREATE TABLE qinglong.turn (v int);")
    with psycopg.connect(database.urls.migration, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        waiting = ThreadPoolExecutor(1)
        applied = waiting.submit(migrate, database.urls.migration, [*shipped, table])
        tried = wait_until(lambda: _tried_the_turn(holder) >= 1, 30, interval=0.02)
        assert tried, "the second migrator never asked for the turn"
        time.sleep(0.5)  # a few more tries (every 0.2 s), each finding the turn taken
        assert not applied.done(), "it went ahead while another migrator held the turn"
        assert holder.execute("SELECT to_regclass('qinglong.turn')").fetchone() == (None,)
        holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
        assert applied.result(timeout=30) == [f"{table.version:04d}_after_the_turn"]
        waiting.shutdown()


def test_a_migration_waiting_for_a_lock_gives_way_and_tries_again(
    database: MigratedDatabase,
) -> None:
    """A DDL statement queued behind a long transaction would make every write to its
    table queue behind it: the migration waits LOCK_TIMEOUT_MS at most each time, rolls
    back (the writers go on) and tries again, applying once the reader is gone."""
    shipped = load_migrations()
    alter = Migration(
        len(shipped) + 1,
        "alter_audit",
        "ALTER TABLE qinglong.security_audit ADD COLUMN scratch int;",
    )
    with psycopg.connect(database.urls.migration) as reader:
        reader.execute("SELECT count(*) FROM qinglong.security_audit")  # holds its lock
        running = ThreadPoolExecutor(1)
        applied = running.submit(migrate, database.urls.migration, [*shipped, alter])
        time.sleep(LOCK_TIMEOUT_MS / 1000 * 2.5)  # more than two tries
        assert not applied.done()
        # Between tries nothing is queued: a write to the table goes through at once.
        with psycopg.connect(database.urls.migration, autocommit=True) as writer:
            writer.execute("SET statement_timeout = 3000")
            writer.execute(
                "INSERT INTO qinglong.security_audit (audit_id, principal_kind, principal_id,"
                " operation, outcome) VALUES (gen_random_uuid(), 'anonymous', 'x', 'op',"
                " 'admitted')"
            )
        reader.rollback()
        assert applied.result(timeout=30) == [f"{alter.version:04d}_alter_audit"]
        running.shutdown()


def test_a_migration_chosen_to_break_a_deadlock_tries_again(
    database: MigratedDatabase,
) -> None:
    """A migration that alters two tables takes their locks in its own order; traffic
    holding the second and then asking for the first deadlocks with it, and PostgreSQL
    ends the one that waited first: the migration. It rolls back and tries again rather
    than failing the deployment, and applies once the traffic is gone."""
    shipped = load_migrations()
    both = Migration(
        len(shipped) + 1,
        "alter_two",
        "ALTER TABLE qinglong.security_audit ADD COLUMN scratch int;\n"
        "ALTER TABLE qinglong.projects ADD COLUMN scratch int;",
    )
    with psycopg.connect(database.urls.migration) as traffic:
        traffic.execute("SELECT count(*) FROM qinglong.projects")  # holds the second
        running = ThreadPoolExecutor(1)
        applied = running.submit(migrate, database.urls.migration, [*shipped, both])

        def migration_waits() -> bool:
            row = traffic.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted"
                " AND relation = 'qinglong.projects'::regclass"
            ).fetchone()
            return row is not None and row[0] > 0

        assert wait_until(migration_waits, 10)
        # Now the traffic asks for what the migration holds: a deadlock. The migration
        # started waiting first, so its check runs first and ends it.
        traffic.execute("SELECT count(*) FROM qinglong.security_audit")
        traffic.rollback()
        assert applied.result(timeout=30) == [f"{both.version:04d}_alter_two"]
        running.shutdown()


def test_an_outside_transaction_migration_may_only_build_indexes() -> None:
    sneaky = Migration(99, "sneaky", f"{OUTSIDE_TRANSACTION}\nDROP TABLE qinglong.runs;\n")
    with pytest.raises(MigrationError, match="only drop and build indexes concurrently"):
        sneaky.statements()


@pytest.fixture
def claimed(
    database: MigratedDatabase,
) -> Iterator[tuple[psycopg.Connection[tuple[object, ...]], SeededAttempt]]:
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        seed_identity(admin, "proj-a", "worker-a")
    with psycopg.connect(database.urls.runtime, autocommit=True) as runtime:
        yield runtime, seed_claimed_attempt(runtime, "proj-a", "worker-a")


def _rejected(
    conn: psycopg.Connection[tuple[object, ...]],
    statement: bytes,
    params: tuple[object, ...],
    constraint: str,
) -> None:
    with pytest.raises(psycopg.errors.IntegrityError) as caught:
        conn.execute(statement, params)
    assert caught.value.diag.constraint_name == constraint


def test_illegal_run_transition_is_refused(
    claimed: tuple[psycopg.Connection[tuple[object, ...]], SeededAttempt],
) -> None:
    runtime, seeded = claimed
    # dispatching -> succeeded skips `running`: the three start facts are not optional.
    _rejected(
        runtime,
        b"UPDATE qinglong.runs SET state = 'succeeded', finished_at_ms = %s WHERE run_id = %s",
        (NOW_MS, seeded.run_id),
        "runs_legal_transition",
    )
    # claimed -> running skips `starting` (SPEC R-ACK-5).
    _rejected(
        runtime,
        b"UPDATE qinglong.attempts SET state = 'running', executor_handle = 'pid:1',"
        b" started_at_ms = %s WHERE attempt_id = %s",
        (NOW_MS, seeded.attempt_id),
        "attempts_legal_transition",
    )


def test_terminal_rows_never_change(
    claimed: tuple[psycopg.Connection[tuple[object, ...]], SeededAttempt],
) -> None:
    runtime, seeded = claimed
    runtime.execute(
        "UPDATE qinglong.attempts SET state = 'cancelled', finished_at_ms = %s"
        " WHERE attempt_id = %s",
        (NOW_MS, seeded.attempt_id),
    )
    runtime.execute(
        "UPDATE qinglong.runs SET state = 'cancelled', finished_at_ms = %s WHERE run_id = %s",
        (NOW_MS, seeded.run_id),
    )
    _rejected(
        runtime,
        b"UPDATE qinglong.runs SET error_summary = 'rewritten' WHERE run_id = %s",
        (seeded.run_id,),
        "runs_terminal_immutable",
    )
    _rejected(
        runtime,
        b"UPDATE qinglong.attempts SET exit_code = 0 WHERE attempt_id = %s",
        (seeded.attempt_id,),
        "attempts_terminal_immutable",
    )


def test_token_columns_hold_only_digests(
    claimed: tuple[psycopg.Connection[tuple[object, ...]], SeededAttempt],
) -> None:
    runtime, seeded = claimed
    plaintext = "qlc1_" + "A" * 43
    with pytest.raises(errors.CheckViolation):
        runtime.execute(
            "UPDATE qinglong.attempts SET lease_token_digest = %s WHERE attempt_id = %s",
            (plaintext, seeded.attempt_id),
        )
    with pytest.raises(errors.CheckViolation):
        runtime.execute(
            "UPDATE qinglong.attempts SET callback_token_digest = %s WHERE attempt_id = %s",
            (digest("x").upper(), seeded.attempt_id),
        )


def test_one_live_attempt_and_one_held_lease_per_run(
    claimed: tuple[psycopg.Connection[tuple[object, ...]], SeededAttempt],
) -> None:
    runtime, seeded = claimed
    second_offer = uuid.uuid4()
    runtime.execute(
        "INSERT INTO qinglong.offers (offer_id, run_id, session_id, worker_id, worker_generation,"
        " state, created_at_ms, expires_at_ms) VALUES (%s, %s, %s, 'worker-a', 1, 'open', %s, %s)",
        (second_offer, seeded.run_id, seeded.session_id, NOW_MS, NOW_MS + 1),
    )
    _rejected(
        runtime,
        b"INSERT INTO qinglong.attempts (attempt_id, run_id, attempt_number, state, executor_type,"
        b" worker_id, session_id, worker_generation, offer_id, lease_generation, lease_version,"
        b" lease_token_digest, claimed_at_ms)"
        b" VALUES (%s, %s, 2, 'claimed', 'remote_worker', 'worker-a', %s, 1, %s, 1, 1, %s, %s)",
        (uuid.uuid4(), seeded.run_id, seeded.session_id, second_offer, digest("t2"), NOW_MS),
        "attempts_one_live_per_run",
    )


def test_lease_version_only_moves_forward(
    claimed: tuple[psycopg.Connection[tuple[object, ...]], SeededAttempt],
) -> None:
    runtime, seeded = claimed
    runtime.execute(
        "UPDATE qinglong.run_leases SET version = 2 WHERE attempt_id = %s", (seeded.attempt_id,)
    )
    _rejected(
        runtime,
        b"UPDATE qinglong.run_leases SET version = 1 WHERE attempt_id = %s",
        (seeded.attempt_id,),
        "run_leases_forward_only",
    )
    _rejected(
        runtime,
        b"UPDATE qinglong.run_leases SET token_digest = %s WHERE attempt_id = %s",
        (digest("stolen"), seeded.attempt_id),
        "run_leases_forward_only",
    )
    runtime.execute(
        "UPDATE qinglong.run_leases SET status = 'completed', version = 3, ended_at_ms = %s"
        " WHERE attempt_id = %s",
        (NOW_MS, seeded.attempt_id),
    )
    _rejected(
        runtime,
        b"UPDATE qinglong.run_leases SET version = 4 WHERE attempt_id = %s",
        (seeded.attempt_id,),
        "run_leases_final",
    )


def test_event_sequence_is_gapless(
    claimed: tuple[psycopg.Connection[tuple[object, ...]], SeededAttempt],
) -> None:
    runtime, seeded = claimed
    insert = (
        b"INSERT INTO qinglong.run_events (event_id, run_id, sequence, event_type, actor_kind,"
        b" actor_id, occurred_at_ms) VALUES (%s, %s, %s, 'run.queued', 'system', 'test', %s)"
    )
    # The Run's counter has not been advanced: no event may be appended yet.
    _rejected(runtime, insert, (uuid.uuid4(), seeded.run_id, 1, NOW_MS), "run_events_gapless")
    runtime.execute(
        "UPDATE qinglong.runs SET event_sequence = event_sequence + 2 WHERE run_id = %s",
        (seeded.run_id,),
    )
    _rejected(runtime, insert, (uuid.uuid4(), seeded.run_id, 2, NOW_MS), "run_events_gapless")
    runtime.execute(insert, (uuid.uuid4(), seeded.run_id, 1, NOW_MS))
    runtime.execute(insert, (uuid.uuid4(), seeded.run_id, 2, NOW_MS))
    # A second writer of the same sequence number is refused too.
    _rejected(runtime, insert, (uuid.uuid4(), seeded.run_id, 2, NOW_MS), "run_events_gapless")


def test_migrate_command_is_idempotent(database: MigratedDatabase) -> None:
    completed = subprocess.run(
        [str(Path(sys.executable).with_name("qinglong-control")), "migrate"],
        env={"QINGLONG_MIGRATION_DATABASE_URL": database.urls.migration, "PATH": "/usr/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(completed.stdout) == {"event": "migrated", "applied": []}


def test_contract_suite_runs_on_every_supported_version(database: MigratedDatabase) -> None:
    """SPEC §7.8: this suite is parametrized over PostgreSQL 16 and 18, and really is."""
    with psycopg.connect(database.urls.runtime) as conn:
        version = conn.execute("SHOW server_version_num").fetchone()
    assert version is not None
    assert int(version[0]) // 10_000 == database.version
    assert database.version in (16, 18)


def test_cancel_intent_and_attempt_authority_are_final(
    claimed: tuple[psycopg.Connection[tuple[object, ...]], SeededAttempt],
) -> None:
    runtime, seeded = claimed
    runtime.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = %s, cancel_reason = 'user'"
        " WHERE run_id = %s",
        (NOW_MS, seeded.run_id),
    )
    _rejected(
        runtime,
        b"UPDATE qinglong.runs SET cancel_reason = 'timeout' WHERE run_id = %s",
        (seeded.run_id,),
        "runs_cancel_intent_final",
    )
    _rejected(
        runtime,
        b"UPDATE qinglong.runs SET cancel_requested_at_ms = NULL, cancel_reason = NULL"
        b" WHERE run_id = %s",
        (seeded.run_id,),
        "runs_cancel_intent_final",
    )
    _rejected(
        runtime,
        b"UPDATE qinglong.attempts SET lease_token_digest = %s WHERE attempt_id = %s",
        (digest("another"), seeded.attempt_id),
        "attempts_authority_fixed",
    )
    _rejected(
        runtime,
        b"UPDATE qinglong.attempts SET worker_generation = 2 WHERE attempt_id = %s",
        (seeded.attempt_id,),
        "attempts_authority_fixed",
    )


def test_migration_0019_removes_every_agents_cluster_admin_grant(
    database: MigratedDatabase,
) -> None:
    # A grant an earlier version could write for an agent; a user's stays.
    (removal,) = [m for m in load_migrations() if m.name == "no_agent_cluster_admins"]
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        robot = enroll_operator_token(conn, "robot", "agent", digest("qlo1_robot"))
        chief = enroll_operator_token(conn, "chief", "user", digest("qlo1_chief"))
        for principal in (robot, chief):
            grant_cluster_admin(conn, principal)
        conn.execute(removal.sql)
        left = conn.execute("SELECT principal_id FROM qinglong.cluster_admins").fetchall()
    assert left == [(chief,)]
