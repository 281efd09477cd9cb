"""`qinglong-control bootstrap-admin`: the first cluster admin and its token, once.

Run by `qinglong up` and by the Kubernetes migration Job after `migrate`, as the
migration (or admin) role. Idempotent: when an active cluster admin exists it issues
nothing and says so (exit 0). Otherwise it creates the user ``--name`` as a cluster
admin with one operator token, in one transaction, and shows the token exactly once:
on stdout, or written to ``--token-file`` (mode 0600) with only the path on stdout.
Nothing else goes to stdout, so a script may take it whole. The token is never logged.

With ``--token-from-file`` it enrolls a token made elsewhere instead (a Kubernetes
Secret the Job mounts, so the Job needs no API access to publish one) and prints nothing
secret: the token's holder already has it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import psycopg
from qinglong_protocol import bounds

from qinglong_control.db.admin import Issued, bootstrap_admin
from qinglong_control.domain.administration import NewSecret, given_operator_token
from qinglong_control.domain.refusals import Refused
from qinglong_control.migrate_command import ENV_MIGRATION_DATABASE_URL

DEFAULT_NAME = "admin"


def bootstrap_admin_main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="qinglong-control bootstrap-admin")
    parser.add_argument(
        "--database-url",
        default=env.get(ENV_MIGRATION_DATABASE_URL),
        help="migration (or admin) role libpq URL; prefer the environment "
        f"[{ENV_MIGRATION_DATABASE_URL}]",
    )
    parser.add_argument(
        "--name", default=DEFAULT_NAME, help=f"the admin user's name [{DEFAULT_NAME}]"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--token-file", type=Path, help="write the token here (mode 0600) instead of stdout"
    )
    source.add_argument(
        "--token-from-file",
        type=Path,
        help="enroll the token this file holds (e.g. a mounted Secret) instead of a new one",
    )
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error(f"the database URL is required ({ENV_MIGRATION_DATABASE_URL})")
    if not bounds.is_slug(args.name):
        parser.error("--name must be a slug: 1..63 characters of a-z, 0-9 and '-'")
    given = None
    if args.token_from_file is not None:
        try:
            given = given_operator_token(args.token_from_file.read_text(encoding="ascii"))
        except (OSError, UnicodeError, ValueError) as error:
            # Never the file's content: it is (or was meant to be) a secret.
            parser.error(f"--token-from-file {args.token_from_file}: {type(error).__name__}")
    # The file is opened before anything is issued: a token that cannot be written must
    # not exist, since it would never be shown and bootstrap would not run again.
    sink = _PrivateFile(args.token_file) if args.token_file is not None else None
    try:
        issued = asyncio.run(_bootstrap(args.database_url, args.name, given))
        if issued is not None and sink is not None:
            sink.keep(issued.secret)
    except Refused as refused:
        print(f"bootstrap-admin: {refused.detail}; choose another --name", file=sys.stderr)
        return 1
    except psycopg.IntegrityError as error:
        # The driver's message would show the token's digest (a key of the table); the
        # constraint name says enough: e.g. a given token that was enrolled before.
        constraint = error.diag.constraint_name or type(error).__name__
        print(f"bootstrap-admin: refused by {constraint}; nothing issued", file=sys.stderr)
        return 1
    finally:
        if sink is not None:
            sink.discard()  # nothing once kept
    if issued is None:
        print("bootstrap-admin: a cluster admin exists already; nothing issued", file=sys.stderr)
    elif given is not None:
        print(f"bootstrap-admin: cluster admin {args.name} enrolled with the given token")
    elif sink is None:
        print(issued.secret, flush=True)
    else:
        print(sink.path, flush=True)
    return 0


async def _bootstrap(url: str, name: str, given: NewSecret | None) -> Issued | None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return await bootstrap_admin(conn, name, given)


class _PrivateFile:
    """A file that appears at ``path`` only once it holds the whole secret, and is never
    readable by anyone but its owner (mkstemp creates it 0600)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        self._temporary = Path(temporary)
        self._file: IO[str] = os.fdopen(descriptor, "w", encoding="ascii")

    def keep(self, secret: str) -> None:
        with self._file:
            self._file.write(secret + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        os.replace(self._temporary, self.path)

    def discard(self) -> None:
        """Remove the file unless it was kept."""
        self._file.close()
        self._temporary.unlink(missing_ok=True)
