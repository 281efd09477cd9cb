"""Settings of the public ingress service, from flags and ``QINGLONG_*`` variables.

A flag wins over its environment variable. Ingress reads only its own database
URL (``QINGLONG_INGRESS_DATABASE_URL``, the worker-ingress role) and never the
runtime role's ``QINGLONG_DATABASE_URL`` (SPEC R-ROLE-2): its only way to the
runtime is the internal gRPC channel to control described by `ControlChannelSettings`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qinglong_protocol import identities
from qinglong_protocol.metrics import MetricsEndpoint, add_metrics_arguments, metrics_endpoint_of
from qinglong_protocol.pooling import PoolSizing, add_pool_size_argument, pool_sizing_of
from qinglong_protocol.storage import (
    StorageBounds,
    add_storage_timeout_argument,
    storage_bounds_of,
)
from qinglong_protocol.tls import TlsFiles

DEFAULT_LISTEN_ADDRESS = "[::]:50051"
DEFAULT_SHUTDOWN_GRACE_SECONDS = 10.0

ENV_LISTEN_ADDRESS = "QINGLONG_INGRESS_LISTEN_ADDRESS"
ENV_ENROLLMENT_LISTEN_ADDRESS = "QINGLONG_INGRESS_ENROLLMENT_LISTEN_ADDRESS"
#: A machine joins once; ten tries a minute is plenty for a person retyping a token and
#: hopeless for anyone guessing 256-bit ones.
DEFAULT_ENROLLMENT_PER_PEER_PER_MINUTE = 10.0
DEFAULT_ENROLLMENT_PER_MINUTE = 120.0
ENV_TLS_CA = "QINGLONG_INGRESS_TLS_CA"
ENV_TLS_CERT = "QINGLONG_INGRESS_TLS_CERT"
ENV_TLS_KEY = "QINGLONG_INGRESS_TLS_KEY"
ENV_CONTROL_ADDRESS = "QINGLONG_INGRESS_CONTROL_ADDRESS"
ENV_CONTROL_TLS_CA = "QINGLONG_INGRESS_CONTROL_TLS_CA"
ENV_CONTROL_TLS_CERT = "QINGLONG_INGRESS_CONTROL_TLS_CERT"
ENV_CONTROL_TLS_KEY = "QINGLONG_INGRESS_CONTROL_TLS_KEY"
ENV_DATABASE_URL = "QINGLONG_INGRESS_DATABASE_URL"  # the worker-ingress role
ENV_SHUTDOWN_GRACE_SECONDS = "QINGLONG_INGRESS_SHUTDOWN_GRACE_SECONDS"
ENV_TRUST_DOMAIN = "QINGLONG_INGRESS_TRUST_DOMAIN"
DEFAULT_TRUST_DOMAIN = identities.DEFAULT_TRUST_DOMAIN


@dataclass(frozen=True)
class ControlChannelSettings:
    """The internal channel to control: where it is, the CA its certificate is checked
    against, and ingress's own client identity on it."""

    address: str
    tls: TlsFiles


@dataclass(frozen=True)
class EnrollmentSettings:
    """The Worker enrollment listener (R-ADM-2): server-authenticated TLS with the public
    server certificate, no client certificate, JoinWorker only, rate-limited per peer
    host and in total (per replica)."""

    listen_address: str
    attempts_per_peer_per_minute: float = DEFAULT_ENROLLMENT_PER_PEER_PER_MINUTE
    attempts_per_minute: float = DEFAULT_ENROLLMENT_PER_MINUTE


@dataclass(frozen=True)
class IngressSettings:
    listen_address: str
    tls: TlsFiles
    control: ControlChannelSettings
    # libpq URL of the worker-ingress role (audit rows, credential lookups).
    database_url: str | None = field(default=None, repr=False)
    shutdown_grace_seconds: float = DEFAULT_SHUTDOWN_GRACE_SECONDS
    # How long a call may wait for PostgreSQL before it answers UNAVAILABLE (R-ERR-2).
    storage: StorageBounds = field(default_factory=StorageBounds)
    pool: PoolSizing = field(default_factory=PoolSizing)
    # Certificates name workers and operators as spiffe://<trust domain>/worker/<id> etc.
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    # None: no enrollment listener (Workers get certificates another way).
    enrollment: EnrollmentSettings | None = None
    # The Prometheus /metrics endpoint; None (the default): none is served.
    metrics: MetricsEndpoint | None = None


def parse_ingress_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> IngressSettings:
    """Build settings from `argv` (default: sys.argv[1:]) over `environ` (default: os.environ)."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="qinglong-ingress",
        description="QingLong ingress: the public gRPC front door, mutual TLS.",
    )
    public = parser.add_argument_group("public endpoint")
    public.add_argument(
        "--listen-address",
        default=env.get(ENV_LISTEN_ADDRESS, DEFAULT_LISTEN_ADDRESS),
        help=f"host:port to bind (port 0 = any free port) [{ENV_LISTEN_ADDRESS}]",
    )
    public.add_argument(
        "--tls-ca",
        default=env.get(ENV_TLS_CA),
        help=f"CA that signs client certificates (PEM) [{ENV_TLS_CA}]",
    )
    public.add_argument(
        "--tls-cert", default=env.get(ENV_TLS_CERT), help=f"server certificate [{ENV_TLS_CERT}]"
    )
    public.add_argument(
        "--tls-key", default=env.get(ENV_TLS_KEY), help=f"server private key [{ENV_TLS_KEY}]"
    )
    joining = parser.add_argument_group("Worker enrollment listener (off unless an address)")
    joining.add_argument(
        "--enrollment-listen-address",
        default=env.get(ENV_ENROLLMENT_LISTEN_ADDRESS),
        help="host:port where machines join with a one-time token (server-authenticated "
        f"TLS, no client certificate) [{ENV_ENROLLMENT_LISTEN_ADDRESS}]",
    )
    joining.add_argument(
        "--enrollment-attempts-per-peer-per-minute",
        type=float,
        default=DEFAULT_ENROLLMENT_PER_PEER_PER_MINUTE,
        help="join attempts one peer host may make per minute",
    )
    joining.add_argument(
        "--enrollment-attempts-per-minute",
        type=float,
        default=DEFAULT_ENROLLMENT_PER_MINUTE,
        help="join attempts all peers together may make per minute (per replica)",
    )
    internal = parser.add_argument_group("internal channel to control")
    internal.add_argument(
        "--control-address",
        default=env.get(ENV_CONTROL_ADDRESS),
        help="host:port of control, or a comma-separated list of ip:port replicas "
        f"(round robin) [{ENV_CONTROL_ADDRESS}]",
    )
    internal.add_argument(
        "--control-tls-ca",
        default=env.get(ENV_CONTROL_TLS_CA),
        help=f"CA of control's certificate; default --tls-ca [{ENV_CONTROL_TLS_CA}]",
    )
    internal.add_argument(
        "--control-tls-cert",
        default=env.get(ENV_CONTROL_TLS_CERT),
        help=f"ingress's client certificate towards control [{ENV_CONTROL_TLS_CERT}]",
    )
    internal.add_argument(
        "--control-tls-key",
        default=env.get(ENV_CONTROL_TLS_KEY),
        help=f"ingress's client private key towards control [{ENV_CONTROL_TLS_KEY}]",
    )
    parser.add_argument(
        "--database-url",
        default=env.get(ENV_DATABASE_URL),
        help=f"worker-ingress role libpq URL; prefer the environment [{ENV_DATABASE_URL}]",
    )
    parser.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        # argparse applies `type` to a string default, so a bad variable is a usage error.
        default=env.get(ENV_SHUTDOWN_GRACE_SECONDS, str(DEFAULT_SHUTDOWN_GRACE_SECONDS)),
        help=f"time in-flight calls get to finish on SIGTERM [{ENV_SHUTDOWN_GRACE_SECONDS}]",
    )
    parser.add_argument(
        "--trust-domain",
        default=env.get(ENV_TRUST_DOMAIN, DEFAULT_TRUST_DOMAIN),
        help=f"SPIFFE trust domain of worker and operator identities [{ENV_TRUST_DOMAIN}]",
    )
    add_storage_timeout_argument(parser, env)
    add_pool_size_argument(parser, env)
    add_metrics_arguments(parser, env, "QINGLONG_INGRESS_")
    args = parser.parse_args(argv)

    required = (
        "tls_ca",
        "tls_cert",
        "tls_key",
        "control_address",
        "control_tls_cert",
        "control_tls_key",
    )
    missing = [dest for dest in required if not getattr(args, dest)]
    if missing:
        parser.error("missing " + ", ".join("--" + dest.replace("_", "-") for dest in missing))
    if args.shutdown_grace_seconds < 0:
        parser.error("--shutdown-grace-seconds must not be negative")
    limits = (args.enrollment_attempts_per_peer_per_minute, args.enrollment_attempts_per_minute)
    if min(limits) < 1:
        parser.error("enrollment rate limits must allow at least one attempt a minute")
    enrollment = None
    if args.enrollment_listen_address:
        enrollment = EnrollmentSettings(
            args.enrollment_listen_address,
            args.enrollment_attempts_per_peer_per_minute,
            args.enrollment_attempts_per_minute,
        )
    return IngressSettings(
        listen_address=args.listen_address,
        tls=TlsFiles(ca_cert=Path(args.tls_ca), cert=Path(args.tls_cert), key=Path(args.tls_key)),
        control=ControlChannelSettings(
            address=args.control_address,
            tls=TlsFiles(
                ca_cert=Path(args.control_tls_ca or args.tls_ca),
                cert=Path(args.control_tls_cert),
                key=Path(args.control_tls_key),
            ),
        ),
        database_url=args.database_url or None,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        storage=storage_bounds_of(parser, args),
        pool=pool_sizing_of(parser, args),
        trust_domain=args.trust_domain,
        enrollment=enrollment,
        metrics=metrics_endpoint_of(parser, args),
    )
