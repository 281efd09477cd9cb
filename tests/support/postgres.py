"""Embedded PostgreSQL clusters for the test session, and one isolated database per test.

Each supported version starts once per session (lazily, only if a test asks for it). A
template database is bootstrapped and migrated once per cluster; each test gets its own
clone, so tests never see each other's rows and never pay for migrations again.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from qinglong_cli.embedded_postgres import EmbeddedPostgres, start_embedded_postgres
from qinglong_control.db.bootstrap import bootstrap_database, create_database
from qinglong_control.db.roles import RoleUrls, role_urls

TEMPLATE_DATABASE = "qinglong_template"


@dataclass(frozen=True)
class MigratedDatabase:
    """A migrated database of its own, reachable as each of its four roles."""

    name: str
    version: int
    urls: RoleUrls
    admin_url: str
    bin_dir: Path


class Cluster:
    def __init__(self, server: EmbeddedPostgres) -> None:
        self.server = server
        self._names = itertools.count(1)
        bootstrap_database(server.admin_url, TEMPLATE_DATABASE)

    @property
    def version(self) -> int:
        return self.server.version

    def admin_url_for(self, database: str) -> str:
        return psycopg.conninfo.make_conninfo(self.server.admin_url, dbname=database)

    @contextmanager
    def database(self) -> Iterator[MigratedDatabase]:
        name = f"qinglong_test_{next(self._names)}"
        create_database(self.server.admin_url, name, template=TEMPLATE_DATABASE)
        try:
            yield MigratedDatabase(
                name=name,
                version=self.version,
                urls=role_urls(self.server.admin_url, name),
                admin_url=self.admin_url_for(name),
                bin_dir=self.server.bin_dir,
            )
        finally:
            with psycopg.connect(self.server.admin_url, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )


class Clusters:
    """Starts each version on first use and stops every started one at the end."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._started: dict[int, Cluster] = {}

    def get(self, version: int) -> Cluster:
        if version not in self._started:
            server = start_embedded_postgres(
                self._root / f"pg{version}", version, delete_on_exit=True
            )
            self._started[version] = Cluster(server)
        return self._started[version]

    def stop_all(self) -> None:
        for cluster in self._started.values():
            cluster.server.stop()
        self._started.clear()
