"""Settings of the control (runtime) service, from flags and ``QINGLONG_*`` variables.

A flag wins over its environment variable. The database URLs are best given by
environment (``QINGLONG_DATABASE_URL``, ``QINGLONG_CONTROL_ADMIN_DATABASE_URL``) so that
they do not show in the process list; they are kept out of ``repr`` so a logged settings
object cannot leak them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qinglong_protocol.identities import DEFAULT_TRUST_DOMAIN, service_uri
from qinglong_protocol.metrics import MetricsEndpoint, add_metrics_arguments, metrics_endpoint_of
from qinglong_protocol.pooling import PoolSizing, add_pool_size_argument, pool_sizing_of
from qinglong_protocol.storage import (
    StorageBounds,
    add_storage_timeout_argument,
    storage_bounds_of,
)
from qinglong_protocol.tls import TlsFiles

from qinglong_control.domain.audit_retention import (
    AUDIT_RETENTION_FLOOR_MS,
    DAY_MS,
    DEFAULT_AUDIT_RETENTION_DAYS,
    AuditRetention,
)
from qinglong_control.domain.output import OutputRetention
from qinglong_control.domain.timings import TIMING_RANGES_MS, Timings

DEFAULT_LISTEN_ADDRESS = "[::]:50052"
DEFAULT_ALLOWED_CALLER_URI = service_uri(DEFAULT_TRUST_DOMAIN, "ingress")
DEFAULT_SHUTDOWN_GRACE_SECONDS = 10.0

ENV_LISTEN_ADDRESS = "QINGLONG_CONTROL_LISTEN_ADDRESS"
ENV_TLS_CA = "QINGLONG_CONTROL_TLS_CA"
ENV_TLS_CERT = "QINGLONG_CONTROL_TLS_CERT"
ENV_TLS_KEY = "QINGLONG_CONTROL_TLS_KEY"
ENV_ALLOWED_CALLER_URIS = "QINGLONG_CONTROL_ALLOWED_CALLER_URIS"  # comma separated
ENV_DATABASE_URL = "QINGLONG_DATABASE_URL"  # the runtime role
ENV_ADMIN_DATABASE_URL = "QINGLONG_CONTROL_ADMIN_DATABASE_URL"  # the admin role
ENV_TRUST_DOMAIN = "QINGLONG_CONTROL_TRUST_DOMAIN"
ENV_ISSUING_CA_CERT = "QINGLONG_CONTROL_ISSUING_CA_CERT"
ENV_ISSUING_CA_KEY = "QINGLONG_CONTROL_ISSUING_CA_KEY"
ENV_ISSUING_CA_TRUST = "QINGLONG_CONTROL_ISSUING_CA_TRUST"
ENV_WORKER_CERTIFICATE_DAYS = "QINGLONG_CONTROL_WORKER_CERTIFICATE_DAYS"
DEFAULT_WORKER_CERTIFICATE_DAYS = 7.0
ENV_SHUTDOWN_GRACE_SECONDS = "QINGLONG_CONTROL_SHUTDOWN_GRACE_SECONDS"
ENV_RECONCILE_INTERVAL_SECONDS = "QINGLONG_CONTROL_RECONCILE_INTERVAL_SECONDS"
DEFAULT_RECONCILE_INTERVAL_SECONDS = 2.0
#: How long Run output is kept (R-OPS-1): seconds since it was last written, and the
#: newest bytes an Attempt keeps.
ENV_OUTPUT_RETENTION_SECONDS = "QINGLONG_CONTROL_OUTPUT_RETENTION_SECONDS"
ENV_AUDIT_RETENTION_DAYS = "QINGLONG_CONTROL_AUDIT_RETENTION_DAYS"
ENV_OUTPUT_MAX_BYTES_PER_ATTEMPT = "QINGLONG_CONTROL_OUTPUT_MAX_BYTES_PER_ATTEMPT"
#: How long durable promises last (Timings), in milliseconds of DB time.
ENV_TIMINGS_MS = {
    "session_ttl_ms": "QINGLONG_CONTROL_SESSION_TTL_MS",
    "lease_ttl_ms": "QINGLONG_CONTROL_LEASE_TTL_MS",
    "offer_ttl_ms": "QINGLONG_CONTROL_OFFER_TTL_MS",
    "approval_ttl_ms": "QINGLONG_CONTROL_APPROVAL_TTL_MS",
    "worker_stop_ms": "QINGLONG_CONTROL_WORKER_STOP_MS",
}


@dataclass(frozen=True)
class IssuingCaFiles:
    cert: Path
    key: Path
    worker_certificate_days: float = DEFAULT_WORKER_CERTIFICATE_DAYS
    #: The roots Workers trust, when ``cert`` is an intermediate that ends in none.
    trust: Path | None = None


@dataclass(frozen=True)
class ControlSettings:
    listen_address: str
    tls: TlsFiles
    # SAN URIs of the callers allowed to use the runtime API (ingress's client
    # identity on the internal channel). Health and reflection stay open to any
    # certificate from the CA, for probes and tooling.
    allowed_caller_uris: frozenset[str]
    # libpq URL of the runtime role; optional until the runtime repository lands.
    database_url: str | None = field(default=None, repr=False)
    # libpq URL of the admin role (docs/decisions/0002), used only by the AdminService
    # handlers through a small pool of their own; without it they answer UNAVAILABLE.
    admin_database_url: str | None = field(default=None, repr=False)
    # The trust domain of the certificates a new Worker's SAN URI is formed in (the same
    # one ingress maps certificates to workers with).
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    # The issuing CA that signs joining Workers' CSRs (R-ADM-2); without it JoinWorker
    # answers UNAVAILABLE. Only control holds this key.
    issuing_ca: IssuingCaFiles | None = None
    shutdown_grace_seconds: float = DEFAULT_SHUTDOWN_GRACE_SECONDS
    # How long a call may wait for PostgreSQL before it answers UNAVAILABLE (R-ERR-2).
    storage: StorageBounds = field(default_factory=StorageBounds)
    pool: PoolSizing = field(default_factory=PoolSizing)
    # The one cadence of lease expiry and convergence; 0 turns both off on this replica.
    reconcile_interval_seconds: float = DEFAULT_RECONCILE_INTERVAL_SECONDS
    timings: Timings = field(default_factory=Timings)
    output_retention: OutputRetention = field(default_factory=OutputRetention)
    audit_retention: AuditRetention = field(default_factory=AuditRetention)
    # The Prometheus /metrics endpoint; None (the default): none is served.
    metrics: MetricsEndpoint | None = None


def parse_control_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ControlSettings:
    """Build settings from `argv` (default: sys.argv[1:]) over `environ` (default: os.environ)."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="qinglong-control",
        description="QingLong control (runtime) service: internal gRPC over mutual TLS.",
    )
    parser.add_argument(
        "--listen-address",
        default=env.get(ENV_LISTEN_ADDRESS, DEFAULT_LISTEN_ADDRESS),
        help=f"host:port to bind (port 0 = any free port) [{ENV_LISTEN_ADDRESS}]",
    )
    parser.add_argument(
        "--tls-ca", default=env.get(ENV_TLS_CA), help=f"CA certificate (PEM) [{ENV_TLS_CA}]"
    )
    parser.add_argument(
        "--tls-cert",
        default=env.get(ENV_TLS_CERT),
        help=f"server certificate (PEM) [{ENV_TLS_CERT}]",
    )
    parser.add_argument(
        "--tls-key", default=env.get(ENV_TLS_KEY), help=f"server private key (PEM) [{ENV_TLS_KEY}]"
    )
    parser.add_argument(
        "--allowed-caller-uri",
        action="append",
        default=None,
        help="SAN URI allowed to call the runtime API; repeatable "
        f"[{ENV_ALLOWED_CALLER_URIS}, comma separated; default {DEFAULT_ALLOWED_CALLER_URI}]",
    )
    parser.add_argument(
        "--database-url",
        default=env.get(ENV_DATABASE_URL),
        help=f"runtime role libpq URL; prefer the environment [{ENV_DATABASE_URL}]",
    )
    parser.add_argument(
        "--admin-database-url",
        default=env.get(ENV_ADMIN_DATABASE_URL),
        help=f"admin role libpq URL, for AdminService only; prefer the environment "
        f"[{ENV_ADMIN_DATABASE_URL}]",
    )
    parser.add_argument(
        "--trust-domain",
        default=env.get(ENV_TRUST_DOMAIN, DEFAULT_TRUST_DOMAIN),
        help=f"SPIFFE trust domain of enrolled Workers' certificates [{ENV_TRUST_DOMAIN}]",
    )
    parser.add_argument(
        "--issuing-ca-cert",
        default=env.get(ENV_ISSUING_CA_CERT),
        help="CA certificate that signs Worker certificates at join, then any CA certificates"
        f" above it (PEM) [{ENV_ISSUING_CA_CERT}]",
    )
    parser.add_argument(
        "--issuing-ca-key",
        default=env.get(ENV_ISSUING_CA_KEY),
        help=f"its private key (PEM) [{ENV_ISSUING_CA_KEY}]",
    )
    parser.add_argument(
        "--issuing-ca-trust",
        default=env.get(ENV_ISSUING_CA_TRUST),
        help="the root CA certificates Workers trust (PEM), when --issuing-ca-cert is an"
        f" intermediate that does not end in its root [{ENV_ISSUING_CA_TRUST}]",
    )
    parser.add_argument(
        "--worker-certificate-days",
        type=float,
        default=env.get(ENV_WORKER_CERTIFICATE_DAYS, str(DEFAULT_WORKER_CERTIFICATE_DAYS)),
        help=f"lifetime of a Worker certificate issued at join [{ENV_WORKER_CERTIFICATE_DAYS}]",
    )
    parser.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        # argparse applies `type` to a string default, so a bad variable is a usage error.
        default=env.get(ENV_SHUTDOWN_GRACE_SECONDS, str(DEFAULT_SHUTDOWN_GRACE_SECONDS)),
        help=f"time in-flight calls get to finish on SIGTERM [{ENV_SHUTDOWN_GRACE_SECONDS}]",
    )
    parser.add_argument(
        "--reconcile-interval-seconds",
        type=float,
        default=env.get(ENV_RECONCILE_INTERVAL_SECONDS, str(DEFAULT_RECONCILE_INTERVAL_SECONDS)),
        help=f"cadence of lease expiry and convergence; 0 = off [{ENV_RECONCILE_INTERVAL_SECONDS}]",
    )
    parser.add_argument(
        "--output-retention-seconds",
        type=int,
        default=env.get(ENV_OUTPUT_RETENTION_SECONDS, str(OutputRetention().max_age_ms // 1000)),
        help="Run output not written to for this long is removed (by the reconcile"
        f" cadence) [{ENV_OUTPUT_RETENTION_SECONDS}]",
    )
    parser.add_argument(
        "--audit-retention-days",
        type=int,
        default=env.get(ENV_AUDIT_RETENTION_DAYS, str(DEFAULT_AUDIT_RETENTION_DAYS)),
        help="security audit rows older than this are removed (by the reconcile cadence;"
        f" at least {AUDIT_RETENTION_FLOOR_MS // DAY_MS}) [{ENV_AUDIT_RETENTION_DAYS}]",
    )
    parser.add_argument(
        "--output-max-bytes-per-attempt",
        type=int,
        default=env.get(
            ENV_OUTPUT_MAX_BYTES_PER_ATTEMPT, str(OutputRetention().max_bytes_per_attempt)
        ),
        help="an Attempt keeps its newest this many bytes of output (at least one 64 KiB"
        f" chunk) [{ENV_OUTPUT_MAX_BYTES_PER_ATTEMPT}]",
    )
    add_storage_timeout_argument(parser, env)
    add_pool_size_argument(parser, env)
    add_metrics_arguments(parser, env, "QINGLONG_CONTROL_")
    for name, variable in ENV_TIMINGS_MS.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=env.get(variable, str(getattr(Timings(), name))),
            help=f"{name.removesuffix('_ms').replace('_', ' ')} in ms, "
            f"{'..'.join(map(str, TIMING_RANGES_MS[name]))} [{variable}]",
        )
    args = parser.parse_args(argv)

    missing = [flag for flag in ("tls_ca", "tls_cert", "tls_key") if not getattr(args, flag)]
    if missing:
        parser.error("mutual TLS is required; missing " + ", ".join(_flag(m) for m in missing))
    allowed = args.allowed_caller_uri or _split_list(
        env.get(ENV_ALLOWED_CALLER_URIS, DEFAULT_ALLOWED_CALLER_URI)
    )
    if not allowed:
        parser.error("at least one --allowed-caller-uri is required")
    if args.shutdown_grace_seconds < 0:
        parser.error("--shutdown-grace-seconds must not be negative")
    if args.reconcile_interval_seconds < 0:
        parser.error("--reconcile-interval-seconds must not be negative")
    if bool(args.issuing_ca_cert) != bool(args.issuing_ca_key):
        parser.error("--issuing-ca-cert and --issuing-ca-key go together")
    if args.issuing_ca_trust and not args.issuing_ca_cert:
        parser.error("--issuing-ca-trust needs --issuing-ca-cert")
    if not 0 < args.worker_certificate_days <= 365:
        parser.error("--worker-certificate-days must be in (0, 365]")
    issuing_ca = None
    if args.issuing_ca_cert:
        issuing_ca = IssuingCaFiles(
            Path(args.issuing_ca_cert),
            Path(args.issuing_ca_key),
            args.worker_certificate_days,
            Path(args.issuing_ca_trust) if args.issuing_ca_trust else None,
        )
    return ControlSettings(
        listen_address=args.listen_address,
        tls=TlsFiles(ca_cert=Path(args.tls_ca), cert=Path(args.tls_cert), key=Path(args.tls_key)),
        allowed_caller_uris=frozenset(allowed),
        database_url=args.database_url or None,
        admin_database_url=args.admin_database_url or None,
        trust_domain=args.trust_domain,
        issuing_ca=issuing_ca,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        storage=storage_bounds_of(parser, args),
        pool=pool_sizing_of(parser, args),
        timings=_timings(parser, args),
        output_retention=_output_retention(parser, args),
        audit_retention=_audit_retention(parser, args),
        reconcile_interval_seconds=args.reconcile_interval_seconds,
        metrics=metrics_endpoint_of(parser, args),
    )


def _timings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Timings:
    try:
        return Timings(**{name: getattr(args, name) for name in ENV_TIMINGS_MS})
    except ValueError as error:
        parser.error(str(error))


def _output_retention(parser: argparse.ArgumentParser, args: argparse.Namespace) -> OutputRetention:
    try:
        return OutputRetention(
            args.output_retention_seconds * 1000, args.output_max_bytes_per_attempt
        )
    except ValueError as error:
        parser.error(str(error))


def _audit_retention(parser: argparse.ArgumentParser, args: argparse.Namespace) -> AuditRetention:
    try:
        return AuditRetention(args.audit_retention_days * DAY_MS)
    except ValueError as error:
        parser.error(str(error))


def _split_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
