"""`qinglong-control`: run the control (runtime) service until SIGTERM or SIGINT.

Process conventions (listening line, logging, signals): qinglong_protocol.serving.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from qinglong_protocol.probe import run_probe
from qinglong_protocol.serving import announce_listening, configure_logging, wait_for_stop_signal

from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.domain.timings import Timings
from qinglong_control.migrate_command import migrate_main
from qinglong_control.server import create_server
from qinglong_control.servicer import RuntimeServicer
from qinglong_control.settings import (
    DEFAULT_LISTEN_ADDRESS,
    ControlSettings,
    parse_control_settings,
)

SERVICE = "control"

_log = logging.getLogger(__name__)


async def serve(settings: ControlSettings) -> None:
    if settings.database_url is None:
        raise SystemExit("qinglong-control needs the runtime role's --database-url")
    pool = await open_runtime_pool(settings.database_url)
    try:
        # WatchRunEvents is not built yet;
        # the generated base class answers them UNIMPLEMENTED.
        servicer = RuntimeServicer(pool, Timings())  # type: ignore[abstract]
        server, port = await create_server(settings, runtime_servicer=servicer)
        await server.start()
        announce_listening(SERVICE, port, settings.listen_address)
        await wait_for_stop_signal()
        _log.info("stopping; in-flight calls get %.1f s", settings.shutdown_grace_seconds)
        await server.stop(settings.shutdown_grace_seconds)
    finally:
        await pool.close()


def main(argv: Sequence[str] | None = None) -> None:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["migrate"]:
        migrate_main(arguments[1:])
        return
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
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
