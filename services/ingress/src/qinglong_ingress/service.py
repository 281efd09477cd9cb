"""The ingress process once grpc may be imported: serve, or probe.

Process conventions (listening line, logging, signals): qinglong_protocol.serving.
Entered only through `qinglong_ingress.main`, which restricts TLS first.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from qinglong_protocol.metrics import serve_metrics
from qinglong_protocol.probe import run_probe
from qinglong_protocol.schema_version import schema_or_exit
from qinglong_protocol.serving import announce_listening, configure_logging, wait_for_stop_signal
from qinglong_protocol.telemetry import configure_telemetry

from qinglong_ingress.control_channel import RenewingControlChannel
from qinglong_ingress.directory import Directory
from qinglong_ingress.gateway import Gateway
from qinglong_ingress.handlers import public_handlers
from qinglong_ingress.pool import open_ingress_pool
from qinglong_ingress.routes import ENROLLMENT_ROUTES
from qinglong_ingress.schema import require_ingress_schema
from qinglong_ingress.server import create_enrollment_server, create_server
from qinglong_ingress.settings import (
    DEFAULT_LISTEN_ADDRESS,
    IngressSettings,
    parse_ingress_settings,
)
from qinglong_ingress.stages import enrollment_stages

SERVICE = "ingress"

_log = logging.getLogger(__name__)


async def serve(settings: IngressSettings) -> None:
    if settings.database_url is None:
        raise SystemExit("qinglong-ingress needs the worker-ingress role's --database-url")
    metrics = None if settings.metrics is None else serve_metrics(settings.metrics, SERVICE)
    try:
        await _serve(settings, settings.database_url)
    finally:
        if metrics is not None:
            metrics.close()


async def _serve(settings: IngressSettings, database_url: str) -> None:
    pool = await open_ingress_pool(database_url, sizing=settings.pool, bounds=settings.storage)
    try:
        await schema_or_exit(pool, require_ingress_schema, "qinglong-ingress")
        control = RenewingControlChannel(settings.control)
        renewing = asyncio.create_task(control.run(), name="control channel renewal")
        try:
            # One directory for both listeners: their audit rows share group commits.
            directory = Directory(pool, settings.storage.statement_timeout_ms / 1000)
            gateway = Gateway(directory, control.current, settings.trust_domain, settings.storage)
            control.serve(gateway)
            server, port = await create_server(settings, public_handlers(gateway))
            servers = [server]
            enrollment = settings.enrollment
            if enrollment is not None:
                joining = Gateway(
                    directory,
                    control.current,
                    settings.trust_domain,
                    settings.storage,
                    stages=enrollment_stages(
                        enrollment.attempts_per_peer_per_minute, enrollment.attempts_per_minute
                    ),
                )
                control.serve(joining)
                enrollment_server, enrollment_port = await create_enrollment_server(
                    enrollment.listen_address,
                    settings.tls,
                    public_handlers(joining, ENROLLMENT_ROUTES),
                )
                servers.append(enrollment_server)
            for each in servers:
                await each.start()
            announce_listening(SERVICE, port, settings.listen_address)
            if enrollment is not None:
                announce_listening(
                    SERVICE + "-enrollment", enrollment_port, enrollment.listen_address
                )
            await wait_for_stop_signal()
            _log.info("stopping; in-flight calls get %.1f s", settings.shutdown_grace_seconds)
            for each in servers:
                await each.stop(settings.shutdown_grace_seconds)
        finally:
            renewing.cancel()
            # Its cancellation is not this shutdown's error: the serving one, if any, is.
            await asyncio.gather(renewing, return_exceptions=True)
            await control.close()
    finally:
        await pool.close()


def run(arguments: Sequence[str]) -> None:
    if arguments[:1] == ["probe"]:
        sys.exit(
            run_probe(
                arguments[1:],
                program="qinglong-ingress",
                env_prefix="QINGLONG_INGRESS_",
                default_listen_address=DEFAULT_LISTEN_ADDRESS,
            )
        )
    settings = parse_ingress_settings(arguments)
    configure_logging()
    configure_telemetry("qinglong-ingress")
    asyncio.run(serve(settings))
