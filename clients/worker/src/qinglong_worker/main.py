"""`qinglong-worker`: the Worker daemon's command line.

Today it proves the Worker's identity and path: `qinglong-worker check` opens the one
mTLS channel a Worker uses and asks ingress whether it serves. The pull/claim/ACK loop
builds on the same settings.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from qinglong_protocol.health import health_status

from qinglong_worker.settings import parse_worker_settings

_CHECK_TIMEOUT_SECONDS = 5.0


def main(argv: Sequence[str] | None = None) -> None:
    command, settings = parse_worker_settings(argv)
    if command == "check":
        status = asyncio.run(
            health_status(settings.ingress_address, settings.tls, _CHECK_TIMEOUT_SECONDS)
        )
        print(f"worker {settings.worker_id} -> ingress {settings.ingress_address}: {status}")
        sys.exit(0 if status == "SERVING" else 1)


if __name__ == "__main__":
    main()
