"""How the services reach PostgreSQL: connection options that make an outage fail fast.

SPEC R-ERR-2: when PostgreSQL is unreachable, ingress and control answer UNAVAILABLE
within a bounded time instead of holding the call until the caller's deadline. Both
services build their pools from these values (neither may import the other, and this
package stays free of psycopg, so these are plain values for psycopg's connect()).

* acquiring a pooled connection waits at most ``acquire_timeout_seconds`` — while
  PostgreSQL is down the pool cannot connect, and the caller gets UNAVAILABLE then;
* a new connection gives up after libpq's ``connect_timeout`` (whole seconds, at least 2);
* a statement runs at most ``statement_timeout`` on the server, so no command holds its
  locks (or its caller) for long behind a stuck lock;
* TCP keepalives find a dead peer on connections that sit idle in the pool, and
  ``tcp_user_timeout`` on a busy one: a statement sent to a primary whose node died (it
  closes nothing and acknowledges nothing) fails once its bytes go unacknowledged for the
  statement bound, instead of after the kernel's retransmissions (about 15 minutes) —
  with a batch of audit rows or a pool check waiting on it meanwhile.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

DEFAULT_STORAGE_TIMEOUT_SECONDS: Final = 2.0
ENV_STORAGE_TIMEOUT_SECONDS: Final = "QINGLONG_STORAGE_TIMEOUT_SECONDS"
#: The statement bound is generous next to a short command, and never below 5 s.
_STATEMENT_TIMEOUT_FACTOR: Final = 5
_MIN_STATEMENT_TIMEOUT_MS: Final = 5_000


@dataclass(frozen=True)
class StorageBounds:
    timeout_seconds: float = DEFAULT_STORAGE_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        if not 0.1 <= self.timeout_seconds <= 600:
            raise ValueError("the storage timeout must be 0.1..600 seconds")

    @property
    def acquire_timeout_seconds(self) -> float:
        # Leave part of the bound for the answer to travel back.
        return self.timeout_seconds * 0.8

    @property
    def statement_timeout_ms(self) -> int:
        """The longest a statement may run on the server, and the longest a service waits
        for one it sent (a server that stopped answering cancels nothing itself)."""
        return max(
            _MIN_STATEMENT_TIMEOUT_MS, int(self.timeout_seconds * 1000 * _STATEMENT_TIMEOUT_FACTOR)
        )

    def connection_kwargs(
        self, application_name: str, settings: Mapping[str, str] | None = None
    ) -> dict[str, object]:
        """libpq's parameters for a connection of ``application_name``; ``settings`` are
        server settings for its whole session, besides the statement bound and durability.

        ``synchronous_commit=on`` is pinned: settings a connection sends outrank those of
        ALTER ROLE and ALTER DATABASE, so no role's or database's setting (one statement
        of a service's own credentials) can turn off the wait for the synchronous standby
        that a confirmed COMMIT's survival of a promotion rests on."""
        statement_ms = self.statement_timeout_ms
        pinned = {"statement_timeout": str(statement_ms), "synchronous_commit": "on"}
        options = " ".join(
            f"-c {name}={value}" for name, value in {**pinned, **(settings or {})}.items()
        )
        return {
            "autocommit": True,
            "application_name": application_name,
            "connect_timeout": max(2, math.ceil(self.timeout_seconds)),
            "keepalives": 1,
            "keepalives_idle": 10,
            "keepalives_interval": 5,
            "keepalives_count": 3,
            "tcp_user_timeout": statement_ms,
            "options": options,
        }


def add_storage_timeout_argument(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """``--storage-timeout-seconds`` over ``QINGLONG_STORAGE_TIMEOUT_SECONDS``."""
    parser.add_argument(
        "--storage-timeout-seconds",
        type=float,
        default=env.get(ENV_STORAGE_TIMEOUT_SECONDS, str(DEFAULT_STORAGE_TIMEOUT_SECONDS)),
        help="how long a call waits for PostgreSQL before answering UNAVAILABLE "
        f"[{ENV_STORAGE_TIMEOUT_SECONDS}]",
    )


def storage_bounds_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> StorageBounds:
    try:
        return StorageBounds(args.storage_timeout_seconds)
    except ValueError as error:
        parser.error(f"--storage-timeout-seconds: {error}")
