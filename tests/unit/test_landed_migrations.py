"""A landed migration is never edited: a deployed database would refuse to start on it.

`landed_migrations.txt` records every migration that has landed on main, with the
SHA-256 the migrator stores (`qinglong_schema_migrations.checksum`). Editing a landed
file changes its checksum and fails here, long before a deployed database refuses it.
A new schema change is a new numbered file, added to the list in the same commit.
"""

from __future__ import annotations

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
