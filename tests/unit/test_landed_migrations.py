"""A landed migration is never edited: a deployed database would refuse to start on it.

`landed_migrations.txt` records every migration that has landed on main, with the
SHA-256 the migrator stores (`qinglong_schema_migrations.checksum`). Editing a landed
file changes its checksum and fails here, long before a deployed database refuses it.
A new schema change is a new numbered file, added to the list in the same commit.
"""

from __future__ import annotations

import re
from pathlib import Path

from qinglong_control.db.migrate import load_migrations

LANDED = Path(__file__).with_name("landed_migrations.txt")


def landed() -> dict[int, tuple[str, str]]:
    entries: dict[int, tuple[str, str]] = {}
    for line in LANDED.read_text().splitlines():
        if line.strip():
            version, name, checksum = line.split()
            entries[int(version)] = (name, checksum)
    return entries


def test_no_landed_migration_was_edited_or_removed() -> None:
    shipped = {m.version: (m.name, m.checksum) for m in load_migrations()}
    changed = {
        version: name
        for version, (name, checksum) in landed().items()
        if shipped.get(version) != (name, checksum)
    }
    assert not changed, f"landed migrations changed or removed: {changed}; add a new one"


def test_every_shipped_migration_is_recorded_as_landed() -> None:
    unrecorded = sorted(set(m.version for m in load_migrations()) - set(landed()))
    assert not unrecorded, f"record migrations {unrecorded} in {LANDED.name} when they land"


#: Migrations up to this one were written before the rule below; they stay as they landed.
CHECKED_FROM = 21

_ALTER_TABLE = re.compile(r"\bALTER\s+TABLE\b[^;]*;", re.IGNORECASE | re.DOTALL)
_CHECK = re.compile(r"\bCHECK\s*\(", re.IGNORECASE)
_NOT_VALID = re.compile(r"\bNOT\s+VALID\b", re.IGNORECASE)
_COMMENT = re.compile(r"--[^\n]*")


def scanning_checks(sql: str) -> list[str]:
    """The ALTER TABLE statements of ``sql`` that add a CHECK without NOT VALID: each reads
    every row of a live table under ACCESS EXCLUSIVE, stopping every command on it for as
    long as that takes (a migration runs while the services serve)."""
    statements = _ALTER_TABLE.findall(_COMMENT.sub("", sql))
    return [s for s in statements if _CHECK.search(s) and not _NOT_VALID.search(s)]


def test_new_migrations_add_checks_not_valid() -> None:
    offending = {
        m.name: scanning_checks(m.sql) for m in load_migrations() if m.version >= CHECKED_FROM
    }
    assert not {name: found for name, found in offending.items() if found}, offending


def test_the_rule_recognises_a_scanning_check() -> None:
    """The rule would have caught migration 0016 (it locked every Attempt while it read
    them all), and lets the NOT VALID form through."""
    [m0016] = [m for m in load_migrations() if m.version == 16]
    assert scanning_checks(m0016.sql)
    assert not scanning_checks(
        "ALTER TABLE qinglong.attempts ADD CONSTRAINT c CHECK (x >= 0) NOT VALID;"
    )
    assert not scanning_checks("-- ALTER TABLE t ADD CHECK (x);\nCREATE INDEX i ON t (x);")


_DROP = re.compile(r"DROP INDEX CONCURRENTLY IF EXISTS (?:\w+\.)?(\w+)$", re.IGNORECASE)
_BUILD = re.compile(r"CREATE (?:UNIQUE )?INDEX CONCURRENTLY (\w+)\s", re.IGNORECASE)


def test_outside_transaction_migrations_only_rebuild_indexes() -> None:
    """Their statements run one by one while the services serve, and a migrator that
    stopped half-way runs them again: only concurrent index builds, each index dropped
    (if a failed build left it) just before it is built."""
    for migration in load_migrations():
        if migration.in_transaction:
            continue
        statements = migration.statements()
        drops = [_DROP.match(s) for s in statements[::2]]
        builds = [_BUILD.match(s) for s in statements[1::2]]
        assert statements, migration.name
        assert len(drops) == len(builds), migration.name
        for dropped, built in zip(drops, builds, strict=True):
            assert dropped is not None, migration.name
            assert built is not None, migration.name
            assert dropped[1] == built[1], migration.name
