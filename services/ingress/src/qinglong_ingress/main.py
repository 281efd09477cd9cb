"""`qinglong-ingress`: run the public ingress service until SIGTERM or SIGINT.

Process conventions (listening line, logging, signals): qinglong_protocol.serving.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from qinglong_protocol.probe import run_probe
from qinglong_protocol.serving import announce_listening, configure_logging, wait_for_stop_signal

from qinglong_ingress.server import create_server, open_control_channel
from qinglong_ingress.settings import (
    DEFAULT_LISTEN_ADDRESS,
    IngressSettings,
    parse_ingress_settings,
)

SERVICE = "ingress"

_log = logging.getLogger(__name__)


async def serve(settings: IngressSettings) -> None:
    # HOOK(worker-ingress pool): open the worker-ingress role's AsyncConnectionPool from
    # settings.database_url here (audit rows, credential lookups) and close it after
    # `server.stop()`. HOOK(forwarding): the servicers get this channel as their only
    # port to the runtime (`as control_channel`, then PublicServicers for create_server).
    async with open_control_channel(settings.control):
        server, port = await create_server(settings)
        await server.start()
        announce_listening(SERVICE, port, settings.listen_address)
        await wait_for_stop_signal()
        _log.info("stopping; in-flight calls get %.1f s", settings.shutdown_grace_seconds)
        await server.stop(settings.shutdown_grace_seconds)


def main(argv: Sequence[str] | None = None) -> None:
    arguments = list(sys.argv[1:] if argv is None else argv)
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
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
