"""`qinglong-worker`: the Worker's command line.

* `qinglong-worker join --ingress HOST:PORT --enrollment HOST:PORT --ca CA.pem
  --token-file T --dir DIR` enrolls
  this machine with a one-time join token (:mod:`qinglong_worker.join`).
* `qinglong-worker check` opens the one mTLS channel a Worker uses and asks ingress
  whether it serves.
* `qinglong-worker probe --inbox PATH` is a liveness probe: it fails once the daemon of
  that inbox has not begun a tick for `--stale-seconds` (:mod:`qinglong_worker.heartbeat`).
* `qinglong-worker run --stack .qinglong/stack.json --inbox PATH` is the daemon
  (:mod:`qinglong_worker.daemon`): one lifecycle loop over one channel and one durable
  inbox. The first SIGTERM or SIGINT drains (no new work; running Attempts may finish
  within `--drain-grace-seconds`, then they are stopped and reported cancelled); a second
  one stops at once. Exit status 0 (2 or 3 when the inbox is unusable).

Only the standard library is imported before :func:`main` has taken SIGTERM and SIGINT
over: importing grpc takes a noticeable fraction of a second, and a signal in that
window must start an orderly shutdown, not kill the process with a traceback.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from types import FrameType

_CHECK_TIMEOUT_SECONDS = 5.0
_SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Shutdown signals received before the daemon's loop handles them.
_early_signals: list[int] = []


def _remember(signal_number: int, _frame: FrameType | None) -> None:
    _early_signals.append(signal_number)


def _take_shutdown_signals() -> None:
    for signal_number in _SHUTDOWN_SIGNALS:
        signal.signal(signal_number, _remember)


def main(argv: Sequence[str] | None = None) -> None:
    _take_shutdown_signals()
    import asyncio
    import logging

    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["join"]:
        from qinglong_worker.join import join_main

        sys.exit(join_main(arguments[1:]))
    if arguments[:1] == ["probe"]:
        from qinglong_worker.heartbeat import probe_main

        sys.exit(probe_main(arguments[1:]))

    from qinglong_worker.settings import parse_worker_settings

    command, settings = parse_worker_settings(argv)
    if command == "check":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if _early_signals:
            sys.exit(1)
        from qinglong_protocol.health import health_status

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
        from qinglong_worker.daemon import run_daemon

        sys.exit(
            asyncio.run(
                run_daemon(
                    settings,
                    early_signals=_early_signals,
                    after_loop=_take_shutdown_signals,
                )
            )
        )


if __name__ == "__main__":
    main()
