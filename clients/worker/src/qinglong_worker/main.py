"""`qinglong-worker`: the Worker's command line.

* `qinglong-worker check` opens the one mTLS channel a Worker uses and asks ingress
  whether it serves.
* `qinglong-worker run --stack .qinglong/stack.json --inbox PATH` is the daemon: one
  lifecycle loop over one channel and one durable inbox, until SIGTERM or SIGINT.

Logs carry ids, states and low-cardinality reasons only: never the lease capability,
the callback token or its digest (the inbox record's ``repr`` hides the secrets too).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from qinglong_protocol.health import health_status
from qinglong_protocol.telemetry import client_interceptors, configure_telemetry

from qinglong_worker.client import ClientSettings, WorkerClient
from qinglong_worker.inbox import Inbox, InboxLocked
from qinglong_worker.lifecycle import Lifecycle, LifecycleSettings
from qinglong_worker.process import ProcessController
from qinglong_worker.reconcile import Reconciler
from qinglong_worker.session import SessionKeeper
from qinglong_worker.settings import WorkerSettings, parse_worker_settings

_CHECK_TIMEOUT_SECONDS = 5.0
log = logging.getLogger("qinglong_worker")


def main(argv: Sequence[str] | None = None) -> None:
    command, settings = parse_worker_settings(argv)
    if command == "check":
        status = asyncio.run(
            health_status(settings.ingress_address, settings.tls, _CHECK_TIMEOUT_SECONDS)
        )
        print(f"worker {settings.worker_id} -> ingress {settings.ingress_address}: {status}")
        sys.exit(0 if status == "SERVING" else 1)
    if command == "run":
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
            stream=sys.stderr,
        )
        sys.exit(asyncio.run(run_daemon(settings)))


async def run_daemon(settings: WorkerSettings) -> int:
    """The daemon; returns the process exit status (0 after SIGTERM/SIGINT)."""
    daemon = settings.daemon
    if daemon is None:
        raise ValueError("run needs daemon settings")
    try:
        inbox = Inbox.open(daemon.inbox)
    except InboxLocked as error:
        log.error("%s", error)
        return 2
    try:
        daemon.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        configure_telemetry("qinglong-worker")
        client = WorkerClient(
            ClientSettings(settings.ingress_address, settings.tls),
            interceptors=client_interceptors(),
        )
        try:
            processes = ProcessController(base_environment=os.environ)
            reconciler = Reconciler(
                inbox=inbox,
                client=client,
                processes=processes,
                stop_grace_seconds=daemon.stop_grace_seconds,
                log_dir=daemon.log_dir,
            )
            lifecycle_settings = LifecycleSettings(
                tick_seconds=daemon.tick_seconds,
                max_concurrency=daemon.max_concurrency,
                lease_control_seconds=daemon.lease_control_seconds,
            )
            session = SessionKeeper(
                inbox=inbox,
                client=client,
                worker_id=settings.worker_id,
                max_concurrency=daemon.max_concurrency,
            )
            lifecycle = Lifecycle(
                settings=lifecycle_settings,
                inbox=inbox,
                client=client,
                reconciler=reconciler,
                processes=processes,
                session=session,
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signal_number in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signal_number, stop.set)
            log.info(
                "worker %s -> ingress %s: running (inbox %s)",
                settings.worker_id,
                settings.ingress_address,
                daemon.inbox,
            )
            try:
                # Returns only after the in-flight requests were aborted.
                await lifecycle.run(stop)
            finally:
                for signal_number in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(signal_number)
        finally:
            await client.close()
    finally:
        inbox.close()
    log.info("worker %s stopped", settings.worker_id)
    return 0


if __name__ == "__main__":
    main()
