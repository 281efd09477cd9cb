"""`qinglong up` as a real subprocess for fault tests: start it, read what it publishes,
reach its database as the migration role, and stop it with SIGINT like a user would.

Everything a test needs comes from ``stack.json`` and the data directory the test chose;
nothing is configured behind the stack's back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from psycopg.conninfo import make_conninfo
from qinglong_cli.devstack import DATABASE_NAME
from qinglong_control.db.roles import MIGRATION_ROLE
from qinglong_protocol.tls import TlsFiles

from tests.support.postgres_control import PostgresControl, postmaster_pid

QINGLONG: Final = Path(sys.executable).with_name("qinglong")
START_TIMEOUT_SECONDS: Final = 120.0
STOP_TIMEOUT_SECONDS: Final = 60.0


@dataclass(frozen=True)
class DevStack:
    process: subprocess.Popen[str]
    data_dir: Path
    document: dict[str, Any]
    postgres: PostgresControl

    @property
    def stack_path(self) -> Path:
        return self.data_dir / "stack.json"

    @property
    def ingress_address(self) -> str:
        return str(self.document["ingress"]["address"])

    @property
    def enrollment_address(self) -> str:
        """Where a Worker joins (ingress's enrollment listener, replica 0)."""
        return str(self.document["ingress"]["enrollment"]["address"])

    @property
    def project_id(self) -> str:
        return str(self.document["project_id"])

    @property
    def worker_id(self) -> str:
        return str(self.document["worker"]["worker_id"])

    @property
    def worker_uri(self) -> str:
        return str(self.document["worker"]["identity"])

    @property
    def worker_tls(self) -> TlsFiles:
        worker = self.document["worker"]
        return TlsFiles(Path(self.document["ca_cert"]), Path(worker["cert"]), Path(worker["key"]))

    @property
    def operator_tls(self) -> TlsFiles:
        operator = self.document["operator"]
        return TlsFiles(
            Path(self.document["ca_cert"]), Path(operator["cert"]), Path(operator["key"])
        )

    @property
    def operator_token(self) -> str:
        return Path(self.document["operator"]["token_file"]).read_text().strip()

    @property
    def ingress_server_tls(self) -> TlsFiles:
        """The public server identity (it names 127.0.0.1): a loopback stand-in for ingress
        presents it so that Workers trust it exactly as they trust ingress."""
        pki = self.data_dir / "pki"
        return TlsFiles(
            Path(self.document["ca_cert"]), pki / "ingress-server.crt", pki / "ingress-server.key"
        )

    @property
    def migration_url(self) -> str:
        """The schema owner's URL: tests read runs, attempts and events with it. With a
        standby, a multi-host URL that finds whichever server is the primary now."""
        standby = self.document["postgres"].get("standby")
        if not standby:
            return self.postgres.url(MIGRATION_ROLE, DATABASE_NAME)
        return make_conninfo(
            self.postgres.url(MIGRATION_ROLE, DATABASE_NAME),
            host=f"{self.postgres.socket_dir},{standby['socket_dir']}",
            port=f"{self.postgres.port},{standby['port']}",
            target_session_attrs="read-write",
        )

    @property
    def standby_dir(self) -> Path:
        return self.data_dir / "postgres-standby"

    def reread(self) -> dict[str, Any]:
        """stack.json as `up` rewrote it last (after a replica restart, its new pid)."""
        document: dict[str, Any] = json.loads(self.stack_path.read_text())
        return document

    def replicas(self, service: str) -> list[dict[str, Any]]:
        """Every replica of `service` ("control" or "ingress"), as published now."""
        return list(self.reread()["replicas"][service])

    def running(self) -> bool:
        return self.process.poll() is None


def qinglong(*args: str) -> str:
    """`qinglong ARGS` must exit 0; its stdout (JSON lines: stdout is not a terminal)."""
    completed = subprocess.run(
        [str(QINGLONG), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout


def operator_cli(stack_path: Path, *args: str) -> str:
    """`qinglong task|run …` as the stack's operator."""
    # `--stack` before the command's own arguments: they may end in `-- CMD …`.
    return qinglong(*args[:2], "--stack", str(stack_path), *args[2:])


def admin_cli(stack_path: Path, *args: str) -> list[dict[str, Any]]:
    """`qinglong admin …` or `qinglong worker …` with the token `up` wrote; its JSON lines."""
    out = qinglong(*args, "--stack", str(stack_path))
    return [json.loads(line) for line in out.splitlines()]


def _wait_for_stack_file(process: subprocess.Popen[str], stack_path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not stack_path.exists():
        if process.poll() is not None:
            out, err = process.communicate()
            raise RuntimeError(f"qinglong up exited with {process.returncode}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise RuntimeError("qinglong up wrote no stack.json in time")
        time.sleep(0.1)
    document: dict[str, Any] = json.loads(stack_path.read_text())
    return document


@contextlib.contextmanager
def dev_stack(
    data_dir: Path,
    environment: Mapping[str, str] | None = None,
    arguments: Sequence[str] = (),
) -> Iterator[DevStack]:
    """A running stack (`arguments`: more `qinglong up` flags, e.g. ``--replicas 2``); on
    exit it is stopped with SIGINT and must exit 0."""
    process = subprocess.Popen(
        [str(QINGLONG), "up", "--data-dir", str(data_dir), *arguments],
        env={**os.environ, **(environment or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        document = _wait_for_stack_file(process, data_dir / "stack.json")
        stack = DevStack(process, data_dir, document, PostgresControl.attach(data_dir / "postgres"))
    except BaseException:
        process.kill()
        process.communicate()
        _stop_orphaned_postgres(data_dir)
        raise
    try:
        yield stack
    finally:
        try:
            out, err = _stop(process)
        finally:
            leftovers = _stop_orphaned_postgres(data_dir)
        assert process.returncode == 0, f"qinglong up exited {process.returncode}:\n{out}\n{err}"
        # `up` stops every PostgreSQL it started, even one restarted or promoted meanwhile.
        assert not leftovers, f"qinglong up left PostgreSQL running on {leftovers}"


def _stop(process: subprocess.Popen[str]) -> tuple[str, str]:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        return out, err + "\n(killed: it did not stop on SIGINT)"


def _stop_orphaned_postgres(data_dir: Path) -> list[Path]:
    """Stop any server `up` left behind (it must leave none); returns their directories."""
    leftovers = []
    for directory in (data_dir / "postgres", data_dir / "postgres-standby"):
        if postmaster_pid(directory) is not None:
            leftovers.append(directory)
            PostgresControl.attach(directory).stop()
    return leftovers
