"""A primary with a synchronous streaming standby (PostgreSQL 18), migrated, for the
failover tests that work below the stack: the services' own pools and repository."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from psycopg.conninfo import make_conninfo
from qinglong_cli.embedded_postgres import (
    EmbeddedPostgres,
    EmbeddedStandby,
    start_embedded_postgres,
    start_standby,
)
from qinglong_control.db.bootstrap import bootstrap_database
from qinglong_control.db.roles import RoleUrls


@dataclass(frozen=True)
class Pair:
    primary: EmbeddedPostgres
    standby: EmbeddedStandby
    urls: RoleUrls

    def multi_host(self, url: str, *sockets: Path, ports: tuple[int, ...] = ()) -> str:
        return make_conninfo(
            url,
            host=",".join(str(socket) for socket in sockets),
            port=",".join(str(port) for port in ports or (5432,) * len(sockets)),
            target_session_attrs="read-write",
        )

    @property
    def sockets(self) -> tuple[Path, Path]:
        return self.primary.socket_dir, self.standby.socket_dir

    @property
    def ports(self) -> tuple[int, int]:
        return self.primary.port, self.standby.port


@contextmanager
def standby_pair(directory: Path) -> Iterator[Pair]:
    """Both servers in ``directory``, stopped on exit whatever state they were left in."""
    primary = start_embedded_postgres(directory / "primary", 18)
    standby: EmbeddedStandby | None = None
    try:
        standby = start_standby(primary, directory / "standby")
        urls = bootstrap_database(primary.admin_url, database="qinglong")
        yield Pair(primary, standby, urls)
    finally:
        primary.stop()
        if standby is not None:
            standby.stop()
