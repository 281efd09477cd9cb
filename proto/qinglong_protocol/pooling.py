"""The services' PostgreSQL connection pools: no round trip spent on checks (R-PERF-1).

A pool that checks each connection before handing it out pays a round trip on every
call to find the rare connection a failover or a restart broke. These pools check
nothing on the happy path and find a broken connection where it fails instead:

* a connection that comes back broken is discarded (psycopg_pool does that), and the
  caller that found it checks every idle one before it answers — a failover or a
  restart breaks them all at once, and the next calls should not find them one by one;
* :func:`read_retrying` runs a read again, once, on another connection when its first
  connection turned out broken; a write is never retried here (its caller answers
  UNAVAILABLE, and the Worker retries: its commands replay idempotently);
* ``max_idle`` and ``max_lifetime`` replace connections that sat unused (a NAT or a
  proxy may have dropped them silently) or lived long (memory, server-side caches).

Both services open their pools here (neither may import the other); Workers never
import this module, which is why psycopg is an extra of this distribution.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from qinglong_protocol.metrics import register_pool
from qinglong_protocol.storage import StorageBounds

_log = logging.getLogger(__name__)

T = TypeVar("T")
Pool = AsyncConnectionPool[AsyncConnection[Any]]

ENV_POOL_MAX_SIZE: Final = "QINGLONG_POOL_MAX_SIZE"
#: A connection unused this long is closed (the pool keeps at least its minimum).
DEFAULT_MAX_IDLE_SECONDS: Final = 120.0
#: Every connection is replaced after about this long (psycopg_pool adds ±5 % jitter).
DEFAULT_MAX_LIFETIME_SECONDS: Final = 30 * 60.0


def default_max_size(cores: int | None = None) -> int:
    """Four connections per core, 4..32. A command holds its connection for about two
    round trips, so a few per core keep the cores busy while others wait on the
    network; more only queue inside PostgreSQL."""
    available = cores if cores is not None else available_cores()
    return max(4, min(32, 4 * available))


def available_cores(
    cgroup_root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int:
    """The cores this process may use: the CPUs it may run on, capped by the CPU quota of
    its cgroup and every cgroup above it (a container's limit, or its pod's), rounded up.
    ``os.cpu_count()`` alone counts the node's cores: a pod limited to one CPU on a 32-core
    node would open 32 connections per pool, and a few replicas would exhaust PostgreSQL's
    connection limit."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quotas = [q for q in map(_cpu_quota, _own_cgroups(cgroup_root, membership)) if q is not None]
    if quotas:
        cores = min(cores or min(quotas), *quotas)
    return max(1, cores or 1)


def _own_cgroups(root: Path, membership: Path) -> list[Path]:
    """This process's cgroup directories and each one above them, up to the hierarchy's
    root: the unified (v2) hierarchy's and v1's ``cpu`` controller's (a hybrid host has
    both; whichever sets no quota counts for nothing). With a private cgroup namespace
    the process's own cgroup is the root itself."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    found: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, relative = parts
        if hierarchy == "0" and not controllers:
            base = root
        elif "cpu" in controllers.split(","):
            base = root / "cpu"
        else:
            continue
        own = base / relative.lstrip("/")
        found += [own, *(parent for parent in own.parents if parent.is_relative_to(base))]
    return found or [root, root / "cpu"]


def _cpu_quota(cgroup: Path) -> int | None:
    """One cgroup's CPU quota in whole cores, rounded up: v2 ``cpu.max`` ("150000
    100000": 1.5 CPUs; "max ...": none), or v1's ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` (-1: none); None when it sets none or cannot be read."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in {"max", "-1"}:
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


@dataclass(frozen=True)
class PoolSizing:
    min_size: int = 2
    max_size: int = 0
    """0: :func:`default_max_size` for this machine."""
    max_idle_seconds: float = DEFAULT_MAX_IDLE_SECONDS
    max_lifetime_seconds: float = DEFAULT_MAX_LIFETIME_SECONDS

    def __post_init__(self) -> None:
        if self.max_size == 0:
            object.__setattr__(self, "max_size", default_max_size())
        if not 1 <= self.max_size <= 1000:
            raise ValueError("the pool's max size must be 1..1000")
        object.__setattr__(self, "min_size", min(self.min_size, self.max_size))
        if self.min_size < 0 or self.max_idle_seconds <= 0 or self.max_lifetime_seconds <= 0:
            raise ValueError("pool sizes and lifetimes must be positive")

    def smaller(self, max_size: int) -> PoolSizing:
        """The same lifetimes for a side pool capped at ``max_size`` connections."""
        return PoolSizing(
            min(self.min_size, 1), max_size, self.max_idle_seconds, self.max_lifetime_seconds
        )


def add_pool_size_argument(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """``--pool-max-size`` over ``QINGLONG_POOL_MAX_SIZE``; 0 sizes from the cores."""
    parser.add_argument(
        "--pool-max-size",
        type=int,
        # A string default goes through `type` too: a bad variable is a usage error.
        default=env.get(ENV_POOL_MAX_SIZE, "0"),
        help="most PostgreSQL connections of the main pool, 1..1000; 0 = 4 per core this "
        "process may use (its CPU limit counts; 4..32) "
        f"[{ENV_POOL_MAX_SIZE}]",
    )


def pool_sizing_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> PoolSizing:
    try:
        return PoolSizing(max_size=args.pool_max_size)
    except ValueError as error:
        parser.error(f"--pool-max-size: {error}")


class RecoveringPool(AsyncConnectionPool[AsyncConnection[Any]]):
    """A pool that answers one broken connection by checking all the idle ones."""

    _recheck: asyncio.Task[None] | None = None

    async def putconn(self, conn: AsyncConnection[Any]) -> None:
        broken = conn.broken
        await super().putconn(conn)
        if broken and not self.closed:
            await self.recheck_idle()

    async def recheck_idle(self) -> None:
        """Check every idle connection; concurrent callers share one check."""
        if self._recheck is None or self._recheck.done():
            _log.warning("pool %s: a connection broke; checking the idle ones", self.name)
            self._recheck = asyncio.get_running_loop().create_task(self._check_quietly())
        await asyncio.shield(self._recheck)

    async def _check_quietly(self) -> None:
        try:
            await self.check()
        except Exception as error:  # the next broken connection starts another check
            _log.warning("pool %s: checking idle connections failed: %s", self.name, error)


async def open_pool(
    url: str,
    *,
    name: str,
    application_name: str,
    sizing: PoolSizing | None = None,
    bounds: StorageBounds | None = None,
    settings: Mapping[str, str] | None = None,
) -> RecoveringPool:
    """Open a pool of autocommit connections (each command opens its own transaction);
    ``settings`` are server settings for every connection's session."""
    bounds = bounds or StorageBounds()
    sizing = sizing or PoolSizing()
    timeout_s = bounds.acquire_timeout_seconds
    pool = RecoveringPool(
        url,
        min_size=sizing.min_size,
        max_size=sizing.max_size,
        max_idle=sizing.max_idle_seconds,
        max_lifetime=sizing.max_lifetime_seconds,
        timeout=timeout_s,
        kwargs=bounds.connection_kwargs(application_name, settings),
        open=False,
        name=name,
    )
    # Opening waits longer than one call would: a service starting next to its database
    # may see it come up a moment later.
    await pool.open(wait=True, timeout=max(timeout_s, 10.0))
    register_pool(pool)  # its usage is read when /metrics is scraped (qinglong_pool_*)
    return pool


async def read_retrying(pool: Pool, read: Callable[[AsyncConnection[Any]], Awaitable[T]]) -> T:
    """Run ``read`` (statements that change nothing) on a pooled connection; if that
    connection turns out broken, run it once more on another. Any other error, and a
    second failure, reaches the caller."""
    async with pool.connection() as conn:
        try:
            return await read(conn)
        except psycopg.OperationalError:
            if not conn.broken:
                raise
            _log.info("pool %s: a read met a broken connection; reading once more", pool.name)
    # Returning the broken connection checked the idle ones (RecoveringPool).
    async with pool.connection() as conn:
        return await read(conn)
