"""The Worker daemon (`qinglong-worker run`): one inbox, one channel, one lifecycle loop.

Exit statuses: 0 after a shutdown; 2 when it cannot start: the inbox cannot be opened
(in use, corrupt, unreadable), the TLS files cannot be read, or the ``--metrics-port``
cannot be bound — one line on stderr names the file or the port; 3 when the inbox became
unreadable while running (the executors this process knew were stopped first).

Logs carry ids, states and low-cardinality reasons only: never the lease capability,
the callback token or its digest (the inbox record's ``repr`` hides the secrets too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterable

from qinglong_protocol.metrics import MetricsServer, serve_metrics
from qinglong_protocol.telemetry import client_interceptors, configure_telemetry

from qinglong_worker.client import ClientSettings, WorkerClient
from qinglong_worker.heartbeat import Heartbeat, heartbeat_path
from qinglong_worker.inbox import Inbox, InboxError
from qinglong_worker.lifecycle import InboxFailed, Lifecycle, LifecycleSettings, ShutdownSignals
from qinglong_worker.process import ProcessController
from qinglong_worker.reconcile import Reconciler
from qinglong_worker.renewal import CertificateRenewer
from qinglong_worker.session import SessionKeeper
from qinglong_worker.settings import WorkerSettings

EXIT_CANNOT_START = 2
EXIT_INBOX_UNUSABLE = EXIT_CANNOT_START
EXIT_INBOX_FAILED = 3
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
log = logging.getLogger("qinglong_worker")


async def run_daemon(
    settings: WorkerSettings,
    *,
    early_signals: Iterable[int] = (),
    after_loop: Callable[[], None] | None = None,
) -> int:
    """The daemon; returns the process exit status (0 after SIGTERM/SIGINT).

    ``early_signals``: shutdown signals that arrived before the loop could take them
    (they count as if they came now). ``after_loop`` re-installs the process's own
    handlers once the loop's are removed, so a late signal never kills the shutdown."""
    daemon = settings.daemon
    if daemon is None:
        raise ValueError("run needs daemon settings")
    try:
        inbox = Inbox.open(daemon.inbox)
    except InboxError as error:
        # One line naming the file; no traceback (nothing here is a bug of ours).
        log.error("%s", error)
        return EXIT_INBOX_UNUSABLE
    metrics: MetricsServer | None = None
    # Beaten once now, so that a file left by an earlier run is not read as this one's.
    heartbeat = Heartbeat(heartbeat_path(daemon.inbox))
    heartbeat.beat()
    try:
        daemon.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        configure_telemetry("qinglong-worker")
        if daemon.metrics is not None:
            try:
                metrics = serve_metrics(daemon.metrics, "worker")
            except OSError as error:
                log.error("cannot serve metrics on port %d: %s", daemon.metrics.port, error)
                return EXIT_CANNOT_START
        try:
            client = WorkerClient(
                ClientSettings(settings.ingress_address, settings.tls),
                interceptors=client_interceptors(),
            )
        except OSError as error:
            log.error("cannot read TLS material %s: %s", error.filename, error.strerror)
            return EXIT_CANNOT_START
        try:
            processes = ProcessController(
                base_environment=os.environ,
                status_dir=daemon.exit_dir,
                output_limit_bytes=daemon.output_limit_bytes,
            )
            reconciler = Reconciler(
                inbox=inbox,
                client=client,
                processes=processes,
                stop_grace_seconds=daemon.stop_grace_seconds,
                log_dir=daemon.log_dir,
                lease_control_seconds=daemon.lease_control_seconds,
            )
            lifecycle_settings = LifecycleSettings(
                tick_seconds=daemon.tick_seconds,
                max_concurrency=daemon.max_concurrency,
                drain_grace_seconds=daemon.drain_grace_seconds,
                retention_seconds=daemon.retention_days * 86_400,
            )
            session = SessionKeeper(
                inbox=inbox,
                client=client,
                worker_id=settings.worker_id,
                max_concurrency=daemon.max_concurrency,
                labels=daemon.labels,
            )
            lifecycle = Lifecycle(
                settings=lifecycle_settings,
                inbox=inbox,
                client=client,
                reconciler=reconciler,
                processes=processes,
                session=session,
                heartbeat=heartbeat,
            )
            signals = ShutdownSignals()
            loop = asyncio.get_running_loop()

            def on_signal(name: str) -> None:
                meaning = "stop now" if signals.drain.is_set() else "drain"
                log.info("%s received: %s", name, meaning)
                signals.signal()

            for signal_number in SHUTDOWN_SIGNALS:
                loop.add_signal_handler(signal_number, on_signal, signal_number.name)
            for early in early_signals:
                on_signal(signal.Signals(early).name)
            log.info(
                "worker %s -> ingress %s: running (inbox %s; up to %d at once; labels %s)",
                settings.worker_id,
                settings.ingress_address,
                daemon.inbox,
                daemon.max_concurrency,
                # What placement matches revisions' selectors with: an operator checks it here.
                ",".join(f"{k}={v}" for k, v in sorted(daemon.labels.items())) or "none",
            )
            renewing = _start_renewal(settings, daemon.certificate_check_seconds, client)
            try:
                # Returns only after the in-flight requests were aborted.
                await lifecycle.run(signals)
            except InboxFailed as failure:
                log.error("%s; exiting", failure)
                return EXIT_INBOX_FAILED
            finally:
                await _stop_renewal(renewing)
                for signal_number in SHUTDOWN_SIGNALS:
                    loop.remove_signal_handler(signal_number)
                if after_loop is not None:
                    after_loop()
        finally:
            await client.close()
    finally:
        inbox.close()
        heartbeat.close()
        if metrics is not None:
            metrics.close()
    log.info("worker %s stopped", settings.worker_id)
    return 0


_Renewal = tuple[asyncio.Event, "asyncio.Task[None]"] | None


def _start_renewal(
    settings: WorkerSettings, check_seconds: float, client: WorkerClient
) -> _Renewal:
    """A joined Worker (``--identity``) renews its short-lived certificate in time."""
    if settings.identity is None:
        return None
    stop = asyncio.Event()
    renewer = CertificateRenewer(client, settings.identity, settings.worker_id)
    return stop, asyncio.create_task(renewer.run(stop, check_seconds), name="certificate-renewal")


async def _stop_renewal(renewing: _Renewal) -> None:
    if renewing is None:
        return
    stop, task = renewing
    stop.set()
    # A renewal in progress must not hold up shutdown: the next start renews if still due.
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
