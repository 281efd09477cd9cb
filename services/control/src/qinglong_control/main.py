"""`qinglong-control`: run the control (runtime) service until SIGTERM or SIGINT.

Subcommands: `migrate` (the schema), `bootstrap-admin` (the first cluster admin), `probe`.
Process conventions (listening line, logging, signals): qinglong_protocol.serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import sys
from collections.abc import Sequence
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from qinglong_protocol.metrics import serve_metrics
from qinglong_protocol.probe import run_probe
from qinglong_protocol.schema_version import schema_or_exit
from qinglong_protocol.serving import announce_listening, configure_logging, wait_for_stop_signal
from qinglong_protocol.telemetry import configure_telemetry

from qinglong_control.bootstrap_admin_command import bootstrap_admin_main
from qinglong_control.db.pool import (
    open_admin_pool,
    open_reconciler_pool,
    open_runtime_pool,
)
from qinglong_control.db.schema_version import require_control_schema
from qinglong_control.issuing import IssuingAuthority
from qinglong_control.metrics import RECONCILE_KINDS
from qinglong_control.migrate_command import migrate_main
from qinglong_control.queue_metrics import QUEUE_SAMPLE_SECONDS, sample_queue
from qinglong_control.reconciler import PAGE_TIMEOUT_STATEMENTS, Reconciler, ReconcilerLimits
from qinglong_control.server import create_server
from qinglong_control.servicer import RuntimeServicer
from qinglong_control.settings import (
    DEFAULT_LISTEN_ADDRESS,
    ControlSettings,
    parse_control_settings,
)

SERVICE = "control"

_log = logging.getLogger(__name__)

#: A cycle that did any of these is logged. `blocked` and `pages` alone are no news, and
#: neither are audit rows removed: once the audit is older than its retention, nearly
#: every cycle removes some (their count is in the reconcile-work metric).
_LOGGED_WORK = frozenset(RECONCILE_KINDS) - {"blocked", "pages", "audit_rows_removed"}


async def serve(settings: ControlSettings) -> None:
    if settings.database_url is None:
        raise SystemExit("qinglong-control needs the runtime role's --database-url")
    async with contextlib.AsyncExitStack() as pools:
        if settings.metrics is not None:
            pools.callback(serve_metrics(settings.metrics, SERVICE).close)
        pool = await open_runtime_pool(
            settings.database_url, sizing=settings.pool, bounds=settings.storage
        )
        pools.push_async_callback(pool.close)
        await schema_or_exit(pool, require_control_schema, "qinglong-control")
        admin_pool = None
        if settings.admin_database_url is None:
            _log.warning("no --admin-database-url: AdminService calls are answered UNAVAILABLE")
        else:
            admin_pool = await open_admin_pool(
                settings.admin_database_url, sizing=settings.pool, bounds=settings.storage
            )
            pools.push_async_callback(admin_pool.close)
        reconcile_pool = None
        if settings.reconcile_interval_seconds > 0:
            reconcile_pool = await open_reconciler_pool(
                settings.database_url, sizing=settings.pool, bounds=settings.storage
            )
            pools.push_async_callback(reconcile_pool.close)
        await _serve(settings, pool, admin_pool, reconcile_pool)


async def _serve(
    settings: ControlSettings,
    pool: AsyncConnectionPool[AsyncConnection[Any]],
    admin_pool: AsyncConnectionPool[AsyncConnection[Any]] | None,
    reconcile_pool: AsyncConnectionPool[AsyncConnection[Any]] | None,
) -> None:
    """Serve until a stop signal; ``reconcile_pool`` (None: no reconcile cadence) is
    the reconciler's own connection."""
    timings = settings.timings
    issuing = None
    if settings.issuing_ca is not None:
        issuing = IssuingAuthority.load(
            settings.issuing_ca.cert,
            settings.issuing_ca.key,
            dt.timedelta(days=settings.issuing_ca.worker_certificate_days),
            settings.issuing_ca.trust,
        )
    else:
        _log.warning("no issuing CA: EnrollmentService.JoinWorker is answered UNAVAILABLE")
    servicer = RuntimeServicer(
        pool,
        timings,
        admin_pool=admin_pool,
        trust_domain=settings.trust_domain,
        issuing=issuing,
        output_retention=settings.output_retention,
    )
    server, port = await create_server(settings, runtime_servicer=servicer)
    await server.start()
    announce_listening(SERVICE, port, settings.listen_address)
    cadence = None
    reconciler = None
    sampling = None
    if reconcile_pool is not None:
        reconciler = Reconciler(
            reconcile_pool,
            ReconcilerLimits(),
            timings,
            settings.output_retention,
            audit_retention=settings.audit_retention,
            page_timeout_seconds=PAGE_TIMEOUT_STATEMENTS
            * settings.storage.statement_timeout_ms
            / 1000,
        )
        cadence = asyncio.create_task(
            drive(reconciler, settings.reconcile_interval_seconds), name="reconcile"
        )
        sampling = asyncio.create_task(
            sample_queue(reconcile_pool, QUEUE_SAMPLE_SECONDS), name="queue"
        )
    await wait_for_stop_signal()
    _log.info("stopping; in-flight calls get %.1f s", settings.shutdown_grace_seconds)
    if sampling is not None:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
    grace = settings.shutdown_grace_seconds
    stopping = [server.stop(grace)]
    if cadence is not None and reconciler is not None:
        cadence.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cadence
        # The cycle in flight ends before its pool closes (a shielded cycle outlives the
        # cadence's cancellation), within the same grace as the calls in flight.
        stopping.append(_stop_reconciler(reconciler, grace))
    await asyncio.gather(*stopping)


async def _stop_reconciler(reconciler: Reconciler, grace: float) -> None:
    if not await reconciler.stop(grace):
        _log.warning("the reconcile cycle in flight was cancelled at shutdown")


async def drive(reconciler: Reconciler, interval_seconds: float) -> None:
    """The service's single cadence: one bounded reconcile cycle per interval."""
    while True:
        await asyncio.sleep(interval_seconds)
        try:
            report = await reconciler.cycle()
        except Exception:  # a failed cycle is retried at the next tick
            _log.exception("reconcile cycle failed")
            continue
        if any(getattr(report, kind) for kind in _LOGGED_WORK):
            # tests/failover parse this line (a replica's share of the work): keep its form.
            _log.info(
                "reconciled: %d leases expired, %d runs converged, %d blocked, "
                "%d retries scheduled, %d exhausted, %d requeued, %d outputs expired, "
                "%d approvals expired, %d audit rows removed, "
                "%d runs of disabled projects stopped, %d queued runs timed out, "
                "%d runs admitted to their task's slots",
                report.expired,
                report.converged,
                report.blocked,
                report.retries_scheduled,
                report.retries_exhausted,
                report.requeued,
                report.outputs_expired,
                report.approvals_expired,
                report.audit_rows_removed,
                report.disabled_projects_runs_stopped,
                report.queue_timeouts,
                report.runs_admitted,
            )


def main(argv: Sequence[str] | None = None) -> None:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["migrate"]:
        migrate_main(arguments[1:])
        return
    if arguments[:1] == ["bootstrap-admin"]:
        sys.exit(bootstrap_admin_main(arguments[1:]))
    if arguments[:1] == ["probe"]:
        sys.exit(
            run_probe(
                arguments[1:],
                program="qinglong-control",
                env_prefix="QINGLONG_CONTROL_",
                default_listen_address=DEFAULT_LISTEN_ADDRESS,
            )
        )
    settings = parse_control_settings(arguments)
    configure_logging()
    configure_telemetry("qinglong-control")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
