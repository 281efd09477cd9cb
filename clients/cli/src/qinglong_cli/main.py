"""`qinglong`: the operator CLI. Subcommands: `up` (the embedded dev stack), `health`,
`task`, `run` and `approval` (operator commands through ingress), `admin` and `worker` (a cluster
admin's commands through ingress)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from qinglong_cli.admin import ADMIN_COMMANDS, add_admin_commands, run_admin_command
from qinglong_cli.approval import COMMAND as APPROVAL_COMMAND
from qinglong_cli.approval import add_approval_commands, run_approval_command
from qinglong_cli.devstack import (
    DEFAULT_DATA_DIR,
    DEFAULT_OPERATOR_NAME,
    DEFAULT_WORKER_ID,
    LOOPBACK_HOST,
    STACK_FILE_NAME,
    UpOptions,
    advertised_host,
    run_health,
    run_up,
)
from qinglong_cli.embedded_postgres import SUPPORTED_VERSIONS
from qinglong_cli.operator import add_operator_commands, run_operator_command
from qinglong_cli.pki import DEFAULT_TRUST_DOMAIN, check_identity_name, check_trust_domain


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qinglong", description="QingLong Remote Run")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser(
        "up",
        help="start PostgreSQL, control and ingress on this machine",
        description="Start the whole stack with an embedded PostgreSQL and development "
        "certificates; stop it with Ctrl-C. Reuses the data directory's PKI and database.",
    )
    up.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    up.add_argument(
        "--postgres-version", type=int, choices=SUPPORTED_VERSIONS, default=SUPPORTED_VERSIONS[-1]
    )
    up.add_argument("--ingress-port", type=_port, default=0, help="0 = any free port")
    up.add_argument("--control-port", type=_port, default=0, help="0 = any free port")
    up.add_argument(
        "--enrollment-port",
        type=_port,
        default=0,
        help="ingress's Worker join listener; 0 = any free port",
    )
    up.add_argument(
        "--listen-host",
        default=LOOPBACK_HOST,
        help="address ingress's public and enrollment listeners bind (control stays on "
        "loopback); another machine's Workers need one they can reach",
    )
    up.add_argument(
        "--advertise-host",
        help="name or IP address other machines dial ingress at, put in its certificate "
        "and stack.json (default: --listen-host; required with 0.0.0.0 or ::)",
    )
    up.add_argument("--trust-domain", type=_trust_domain, default=DEFAULT_TRUST_DOMAIN)
    up.add_argument(
        "--worker-id",
        type=_identity_name("worker_id"),
        default=DEFAULT_WORKER_ID,
        help="identity issued for a Worker",
    )
    up.add_argument(
        "--operator-name",
        type=_identity_name("operator name"),
        default=DEFAULT_OPERATOR_NAME,
        help="identity issued for an operator",
    )
    up.add_argument(
        "--replicas",
        type=_replicas,
        default=1,
        help="control and ingress processes each (each ingress replica on its own port, "
        "forwarding to every control replica, round robin; all listed in stack.json)",
    )
    up.add_argument(
        "--standby",
        action="store_true",
        help="also run a synchronous streaming standby; the services get multi-host "
        "database URLs (primary, standby; target_session_attrs=read-write)",
    )
    up.add_argument("--ready-timeout", type=float, default=60.0, help="seconds per start-up step")
    up.add_argument(
        "--stop-timeout", type=float, default=10.0, help="seconds before a service is killed"
    )

    health = commands.add_parser(
        "health", help="check the health of a running stack's endpoints over mutual TLS"
    )
    health.add_argument("--stack", type=Path, default=DEFAULT_DATA_DIR / STACK_FILE_NAME)
    health.add_argument("--timeout", type=float, default=5.0, help="seconds per endpoint")
    add_operator_commands(commands, DEFAULT_DATA_DIR / STACK_FILE_NAME)
    add_approval_commands(commands, DEFAULT_DATA_DIR / STACK_FILE_NAME)
    add_admin_commands(commands, DEFAULT_DATA_DIR / STACK_FILE_NAME)
    return parser


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {port}")
    return port


def _replicas(text: str) -> int:
    count = int(text)
    if not 1 <= count <= 16:
        raise argparse.ArgumentTypeError(f"replicas must be 1..16: {count}")
    return count


def _trust_domain(text: str) -> str:
    try:
        check_trust_domain(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _identity_name(kind: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            check_identity_name(kind, text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    return parse


#: The exit status of a command whose reader went away (`| head`), as a shell reports a
#: process that SIGPIPE ended.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # Not the command's failure: no traceback, and none again when Python flushes
        # stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "up":
        try:
            advertised_host(args.listen_host, args.advertise_host)
        except ValueError as error:
            parser.error(str(error))
        options = UpOptions(
            data_dir=args.data_dir,
            postgres_version=args.postgres_version,
            ingress_port=args.ingress_port,
            control_port=args.control_port,
            trust_domain=args.trust_domain,
            worker_id=args.worker_id,
            operator_name=args.operator_name,
            ready_timeout_seconds=args.ready_timeout,
            stop_timeout_seconds=args.stop_timeout,
            replicas=args.replicas,
            standby=args.standby,
            enrollment_port=args.enrollment_port,
            listen_host=args.listen_host,
            advertise_host=args.advertise_host,
        )
        return asyncio.run(run_up(options, sys.stdout))
    if args.command == "health":
        return asyncio.run(run_health(args.stack, args.timeout, sys.stdout))
    if args.command in ADMIN_COMMANDS:
        return asyncio.run(run_admin_command(args, sys.stdout))
    if args.command == APPROVAL_COMMAND:
        return asyncio.run(run_approval_command(args, sys.stdout))
    return asyncio.run(run_operator_command(args, sys.stdout))


if __name__ == "__main__":
    sys.exit(main())
