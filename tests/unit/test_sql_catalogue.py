"""The SQL catalogue: statements live in named `.sql` files, each one used, none built."""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from pathlib import Path

import pytest
import qinglong_control.db
from qinglong_control.db.sql import SQL
from qinglong_protocol.sql_catalogue import SqlCatalogue

DB_DIR = Path(qinglong_control.db.__file__).parent
#: Modules that keep inline SQL on purpose (other roles, or the transaction frame).
INLINE_ALLOWED = {"migrate", "bootstrap", "identities", "command_tx", "roles", "schema_dump"}


def test_every_statement_is_used_by_some_repository_module() -> None:
    for module in pkgutil.iter_modules(qinglong_control.db.__path__):
        importlib.import_module(f"qinglong_control.db.{module.name}")
    assert len(SQL) > 50
    assert SQL.unused() == set()


def test_repository_modules_hold_no_statement_text() -> None:
    statement = re.compile(r'"""\s*(SELECT|INSERT|UPDATE|DELETE|WITH)\b|"(SELECT|INSERT|UPDATE) ')
    for path in sorted(DB_DIR.glob("*.py")):
        if path.stem in INLINE_ALLOWED:
            continue
        assert not statement.search(path.read_text()), f"{path.name} holds SQL text"


def test_one_definition_of_db_time() -> None:
    sources = [p.read_text() for p in (DB_DIR / "sql").glob("*.sql")]
    # A statement that is the clock read; `(SELECT qinglong.db_now_ms())` inside another
    # statement is a use (the clock read once, bounding an index scan), not a definition.
    definition = re.compile(r"(?<!\()SELECT qinglong\.db_now_ms\(\)")
    definitions = sum(len(definition.findall(text)) for text in sources)
    assert definitions == 1


def test_a_missing_or_duplicate_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        SQL["runs.no_such_statement"]
    package = tmp_path / "dup_catalogue"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "area.sql").write_text("-- name: one\nSELECT 1\n-- name: one\nSELECT 2\n")

    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match="defined twice"):
            SqlCatalogue("dup_catalogue")
    finally:
        sys.path.remove(str(tmp_path))


def test_comments_explain_but_never_reach_the_server() -> None:
    text = SQL["runs.lock_trigger"]
    assert "--" not in text
    assert text.startswith("SELECT pg_advisory_xact_lock(")


def test_ingress_statements_are_catalogued_and_used() -> None:
    importlib.import_module("qinglong_ingress.directory")
    from qinglong_ingress.sql import SQL as INGRESS_SQL

    assert set(INGRESS_SQL) >= {"directory.write_audits", "directory.role_binding"}
    assert INGRESS_SQL.unused() == set()
    source = Path(importlib.import_module("qinglong_ingress.directory").__file__ or "")
    assert not re.search(r'"""\s*(SELECT|INSERT)\b', source.read_text())


def test_shared_statements_are_catalogued_and_used() -> None:
    """Statements both services run live once, in qinglong_protocol's catalogue."""
    importlib.import_module("qinglong_protocol.schema_version")
    from qinglong_protocol.sql import SQL as SHARED_SQL

    assert set(SHARED_SQL) == {"schema_version.applied"}
    assert SHARED_SQL.unused() == set()
