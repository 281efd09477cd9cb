"""Worker settings from flags over `QINGLONG_WORKER_*` environment variables."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qinglong_protocol import bounds
from qinglong_protocol.metrics import MetricsEndpoint, add_metrics_arguments, metrics_endpoint_of
from qinglong_protocol.tls import TlsFiles

from qinglong_worker.retention import DEFAULT_RETENTION_DAYS, MIN_RETENTION_DAYS

ENV_PREFIX = "QINGLONG_WORKER_"
DEFAULT_TICK_SECONDS = 0.5
DEFAULT_MAX_CONCURRENCY = 4
DEFAULT_CERTIFICATE_CHECK_SECONDS = 60.0
DEFAULT_LEASE_CONTROL_SECONDS = 2.0
DEFAULT_STOP_GRACE_SECONDS = 5.0
#: Long enough for most short jobs to finish on a rolling restart; keep Kubernetes'
#: terminationGracePeriodSeconds above drain grace + stop grace + a few seconds.
DEFAULT_DRAIN_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class DaemonSettings:
    """What `qinglong-worker run` needs beyond the connection."""

    inbox: Path
    log_dir: Path
    tick_seconds: float = DEFAULT_TICK_SECONDS
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    lease_control_seconds: float = DEFAULT_LEASE_CONTROL_SECONDS
    stop_grace_seconds: float = DEFAULT_STOP_GRACE_SECONDS
    drain_grace_seconds: float = DEFAULT_DRAIN_GRACE_SECONDS
    certificate_check_seconds: float = DEFAULT_CERTIFICATE_CHECK_SECONDS
    #: How long a closed inbox record that owes nothing, and its files, are kept (0: for
    #: ever; see qinglong_worker.retention).
    retention_days: float = DEFAULT_RETENTION_DAYS
    #: How large one executor's local log file may grow (None: without bound).
    output_limit_bytes: int | None = bounds.OUTPUT_BYTES_PER_ATTEMPT_DEFAULT
    #: The Prometheus /metrics endpoint; None (the default): none is served.
    metrics: MetricsEndpoint | None = None
    #: What this Worker offers (os=linux, gpu=a100): declared with its session, so that
    #: it is offered the Runs whose revision's worker_selector these labels satisfy.
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def exit_dir(self) -> Path:
        """Where executor supervisors leave exit statuses: beside the inbox."""
        return self.inbox.parent / "exits"


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str
    ingress_address: str
    tls: TlsFiles
    daemon: DaemonSettings | None = None
    #: worker.json of a joined Worker: its certificate is renewed in place (R-ADM-2).
    identity: Path | None = None


def _variable(name: str) -> str:
    return ENV_PREFIX + name.upper().replace("-", "_")


_CONNECTION = ("worker_id", "ingress_address", "tls_ca", "tls_cert", "tls_key")


def _from_stack(stack: Any) -> dict[str, str]:
    """The dev stack's own Worker (``qinglong up`` writes stack.json)."""
    return {
        "worker_id": stack["worker"]["worker_id"],
        "ingress_address": stack["ingress"]["address"],
        "tls_ca": stack["ca_cert"],
        "tls_cert": stack["worker"]["cert"],
        "tls_key": stack["worker"]["key"],
    }


def _from_identity(identity: Any) -> dict[str, str]:
    """What ``qinglong-worker join`` wrote (worker.json beside the key)."""
    return {name: identity[name] for name in _CONNECTION}


def parse_worker_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str, WorkerSettings]:
    """(command, settings). A dev stack file may stand in for every connection flag."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="qinglong-worker",
        description="QingLong Worker: pulls, starts and reports Runs.",
        epilog="Also: `qinglong-worker join --help` (enroll this machine with a join token)"
        " and `qinglong-worker probe --help` (liveness of the daemon of an inbox).",
    )
    parser.add_argument(
        "command",
        choices=["check", "run"],
        help="check: is ingress serving us? run: the Worker daemon (until SIGTERM/SIGINT)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--stack", type=Path, help="read everything below from a stack.json")
    source.add_argument(
        "--identity",
        type=Path,
        help="read everything below from the worker.json `qinglong-worker join` wrote",
    )
    for name in ("worker-id", "ingress-address", "tls-ca", "tls-cert", "tls-key"):
        variable = _variable(name)
        parser.add_argument(f"--{name}", default=env.get(variable), help=f"or ${variable}")
    daemon = parser.add_argument_group("run")
    daemon.add_argument(
        "--inbox",
        type=Path,
        default=env.get(_variable("inbox")),
        help=f"the durable inbox (SQLite, created 0600) [${_variable('inbox')}]",
    )
    daemon.add_argument(
        "--log-dir",
        type=Path,
        default=env.get(_variable("log-dir")),
        help="where executor output goes, one file per offer [default: <inbox dir>/logs]",
    )
    daemon.add_argument(
        "--tick-seconds",
        type=float,
        default=env.get(_variable("tick-seconds"), str(DEFAULT_TICK_SECONDS)),
        help="interval of the one lifecycle loop",
    )
    daemon.add_argument(
        "--max-concurrency",
        type=int,
        default=env.get(_variable("max-concurrency"), str(DEFAULT_MAX_CONCURRENCY)),
        help="Attempts this Worker runs at once (1..64)",
    )
    daemon.add_argument(
        "--lease-control-seconds",
        type=float,
        default=env.get(_variable("lease-control-seconds"), str(DEFAULT_LEASE_CONTROL_SECONDS)),
        help="how often a running Attempt's lease is renewed (cancel/timeout reach it then)",
    )
    daemon.add_argument(
        "--stop-grace-seconds",
        type=float,
        default=env.get(_variable("stop-grace-seconds"), str(DEFAULT_STOP_GRACE_SECONDS)),
        help="time between SIGTERM and SIGKILL when a Run must stop",
    )
    daemon.add_argument(
        "--drain-grace-seconds",
        type=float,
        default=env.get(_variable("drain-grace-seconds"), str(DEFAULT_DRAIN_GRACE_SECONDS)),
        help="on SIGTERM/SIGINT: how long running Attempts may still finish before they"
        " are stopped and reported cancelled (a second signal stops at once)",
    )
    daemon.add_argument(
        "--certificate-check-seconds",
        type=float,
        default=env.get(
            _variable("certificate-check-seconds"), str(DEFAULT_CERTIFICATE_CHECK_SECONDS)
        ),
        help="with --identity: how often the certificate's age is checked (renewed at 2/3)",
    )
    daemon.add_argument(
        "--retention-days",
        type=float,
        default=env.get(_variable("retention-days"), str(DEFAULT_RETENTION_DAYS)),
        help="how long a finished Attempt's inbox record, local log file and exit files are"
        " kept once everything is reported and shipped (0: for ever)",
    )
    daemon.add_argument(
        "--output-limit-bytes",
        type=int,
        default=env.get(
            _variable("output-limit-bytes"), str(bounds.OUTPUT_BYTES_PER_ATTEMPT_DEFAULT)
        ),
        help="how large one executor's output file may grow; past it the executor runs on"
        " and its further output is discarded, after a notice (0: without bound)",
    )
    daemon.add_argument(
        "--label",
        action="append",
        metavar="KEY=VALUE",
        help="a label of this Worker (repeatable): it is offered the Runs whose revision's"
        " worker selector its labels satisfy, and those without one"
        f" [${_variable('labels')}: KEY=VALUE,KEY=VALUE]",
    )
    add_metrics_arguments(parser, env, ENV_PREFIX)
    args = parser.parse_args(argv)
    for flag, path, read in (
        ("--stack", args.stack, _from_stack),
        ("--identity", args.identity, _from_identity),
    ):
        if path is None:
            continue
        try:
            found = read(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as error:
            # One line naming the file, not a traceback.
            reason = getattr(error, "strerror", None) or type(error).__name__
            parser.error(f"{flag} {path}: {reason}")
        for name, value in found.items():  # a flag given explicitly wins
            setattr(args, name, getattr(args, name) or value)
    missing = [name for name in _CONNECTION if not getattr(args, name)]
    if missing:
        parser.error("missing " + ", ".join("--" + m.replace("_", "-") for m in missing))
    tls = TlsFiles(ca_cert=Path(args.tls_ca), cert=Path(args.tls_cert), key=Path(args.tls_key))
    daemon_settings = None
    if args.command == "run":
        if args.inbox is None:
            parser.error("run needs --inbox")
        if not args.tick_seconds > 0:
            parser.error("--tick-seconds must be positive")
        if not (
            bounds.MAX_CONCURRENT_ATTEMPTS_MIN
            <= args.max_concurrency
            <= bounds.MAX_CONCURRENT_ATTEMPTS_MAX
        ):
            parser.error("--max-concurrency must be 1..64")
        if not args.lease_control_seconds > 0:
            parser.error("--lease-control-seconds must be positive")
        if args.stop_grace_seconds < 0:
            parser.error("--stop-grace-seconds must not be negative")
        if not args.drain_grace_seconds >= 0:
            parser.error("--drain-grace-seconds must not be negative")
        if not args.certificate_check_seconds > 0:
            parser.error("--certificate-check-seconds must be positive")
        if args.retention_days != 0 and not args.retention_days >= MIN_RETENTION_DAYS:
            parser.error(
                f"--retention-days must be 0 (for ever) or at least {MIN_RETENTION_DAYS}"
                " (a day: longer than an offer lives, or a refused one comes back)"
            )
        if args.output_limit_bytes != 0 and not (
            args.output_limit_bytes >= bounds.OUTPUT_CHUNK_MAX_BYTES
        ):
            parser.error(
                f"--output-limit-bytes must be 0 (without bound) or at least"
                f" {bounds.OUTPUT_CHUNK_MAX_BYTES} (one chunk)"
            )
        labels = _labels(parser, args.label, env.get(_variable("labels")))
        daemon_settings = DaemonSettings(
            inbox=args.inbox,
            log_dir=args.log_dir or args.inbox.parent / "logs",
            tick_seconds=args.tick_seconds,
            max_concurrency=args.max_concurrency,
            lease_control_seconds=args.lease_control_seconds,
            stop_grace_seconds=args.stop_grace_seconds,
            drain_grace_seconds=args.drain_grace_seconds,
            certificate_check_seconds=args.certificate_check_seconds,
            retention_days=args.retention_days,
            output_limit_bytes=args.output_limit_bytes or None,
            metrics=metrics_endpoint_of(parser, args),
            labels=labels,
        )
    return args.command, WorkerSettings(
        args.worker_id, args.ingress_address, tls, daemon_settings, args.identity
    )


def _labels(
    parser: argparse.ArgumentParser, flags: list[str] | None, variable: str | None
) -> dict[str, str]:
    """``--label KEY=VALUE`` flags (or, without any, the environment's comma-separated
    list), checked against the contract here: a label the contract refuses would make
    every OpenSession fail, so the daemon does not start with one."""
    given = flags if flags is not None else [item for item in (variable or "").split(",") if item]
    labels: dict[str, str] = {}
    for item in given:
        key, equals, value = item.partition("=")
        if not equals:
            parser.error(f"--label {item!r}: needs KEY=VALUE")
        if key in labels:
            parser.error(f"--label {key}: given twice")
        problem = bounds.worker_label_problem(key, value)
        if problem is not None:
            parser.error(f"--label: {problem}")
        labels[key] = value
    if len(labels) > bounds.WORKER_LABELS_MAX:
        parser.error(f"--label: at most {bounds.WORKER_LABELS_MAX} labels")
    return labels
