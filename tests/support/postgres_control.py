"""Stop and start the embedded PostgreSQL of a running `qinglong up`, from outside.

`qinglong up` starts PostgreSQL with `pg_ctl` on a data directory, listening only on a
Unix socket inside it. Everything needed to do the same again is on disk and in /proc:
the socket directory and port are lines 5 and 4 of ``postmaster.pid`` (documented by
PostgreSQL), the binaries are next to the running postmaster's executable, and the
server runs as the owner of the data directory (pgserver drops root to its own user).
"""

from __future__ import annotations

import os
import pwd
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from psycopg.conninfo import make_conninfo

_PG_CTL_TIMEOUT_SECONDS: Final = 60


def postmaster_pid(data_dir: Path) -> int | None:
    """The live postmaster of `data_dir`, if any (a stale pid file counts as none)."""
    try:
        pid = int((data_dir / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else pid


@dataclass(frozen=True)
class PostgresControl:
    data_dir: Path
    bin_dir: Path
    socket_dir: Path
    port: int
    owner: str

    @classmethod
    def attach(cls, data_dir: Path) -> PostgresControl:
        """Read how the running server was started; it must be running now."""
        pid = postmaster_pid(data_dir)
        if pid is None:
            raise RuntimeError(f"no PostgreSQL is running on {data_dir}")
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
        return cls(
            data_dir=data_dir,
            bin_dir=Path(os.readlink(f"/proc/{pid}/exe")).parent,
            socket_dir=Path(lines[4]),
            port=int(lines[3]),
            owner=pwd.getpwuid(data_dir.stat().st_uid).pw_name,
        )

    def url(self, user: str, database: str) -> str:
        return make_conninfo(
            "", host=str(self.socket_dir), port=self.port, user=user, dbname=database
        )

    @property
    def running(self) -> bool:
        return postmaster_pid(self.data_dir) is not None

    def stop(self) -> None:
        """A fast shutdown: every session is disconnected, nothing new is accepted."""
        self._pg_ctl("-w", "-m", "fast", "-D", str(self.data_dir), "stop")

    def start(self) -> None:
        """Start it again exactly as `qinglong up` did: socket only, same directory."""
        self._pg_ctl(
            "-w",
            "-o",
            f'-h "" -k {self.socket_dir}',
            "-l",
            str(self.data_dir / "log"),
            "-D",
            str(self.data_dir),
            "start",
        )

    def promote(self) -> None:
        """`pg_ctl promote` a standby and wait until it accepts writes."""
        self._pg_ctl("-w", "-D", str(self.data_dir), "promote")

    def _pg_ctl(self, *arguments: str) -> None:
        command = [str(self.bin_dir / "pg_ctl"), *arguments]
        if self.owner != pwd.getpwuid(os.geteuid()).pw_name:
            # Switch user in a helper process, not with subprocess's `user=`: that forks
            # this multi-threaded test process (gRPC threads) without exec and the child
            # can crash before pg_ctl ever runs.
            command = ["runuser", "-u", self.owner, "--", *command]
        # Files, not pipes: the postmaster pg_ctl leaves behind could hold a pipe open.
        with tempfile.TemporaryFile() as output:
            completed = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                timeout=_PG_CTL_TIMEOUT_SECONDS,
                check=False,
            )
            if completed.returncode != 0:
                output.seek(0)
                text = output.read().decode(errors="replace")
                raise RuntimeError(
                    f"pg_ctl {arguments[-1]} failed ({completed.returncode}): {text}"
                )
