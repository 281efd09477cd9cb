"""Prometheus metrics of every QingLong process (SPEC R-OPS-3), and their scrape endpoint.

Each process (control, ingress, the Worker) serves ``/metrics`` over plain HTTP when it
is given ``--metrics-port`` (or its ``QINGLONG_<SERVICE>_METRICS_PORT`` variable); by
default nothing listens. Recording does not depend on the endpoint: a histogram observe
is a lock and a few additions (about a microsecond), so the hot path pays that whether
or not anyone scrapes, and nothing at all of the OpenTelemetry SDK (telemetry.py
installs that only for an OTLP exporter). What is only read at scrape time — the
connection pools' statistics — costs nothing between scrapes.

Labels are low-cardinality by construction, and only those of :data:`LABELS`: a method
name, an outcome (``ok``, an ErrorReason name, or a gRPC code name), a reason, a pool
name, a phase, a kind or an Attempt's end state — never a run, attempt, offer, session
or worker id, and never a token. Every metric is
named ``qinglong_*``; the list, with the labels and what each is for, is in
docs/observability.md.

`prometheus_client` rather than OpenTelemetry's Prometheus exporter: it needs no SDK
meter provider (so the no-SDK-by-default property of telemetry.py stays), it is stable
(the OpenTelemetry exporter still ships pre-releases only), and its parser is what the
tests read a scrape with.
"""

from __future__ import annotations

import argparse
import logging
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_log = logging.getLogger(__name__)

#: Every label a QingLong metric may carry (``le``: a histogram bucket's bound; ``step``:
#: one of the reconcile cycle's steps; ``part``: of the queue); the tests check each scrape
#: against it.
LABELS: Final = frozenset(
    {"method", "outcome", "reason", "pool", "phase", "kind", "state", "step", "part", "le"}
)

#: Seconds, for gRPC calls and commits: half a millisecond (a warm loopback call) up to
#: half a minute (a forwarded call's default deadline).
LATENCY_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: Items (rows, leases, runs) handled at once: a batch or one reconcile cycle.
COUNT_BUCKETS: Final = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

DEFAULT_METRICS_ADDRESS: Final = "0.0.0.0"  # noqa: S104 - Prometheus scrapes the pod IP


def outcome_of_code(code_name: str | None) -> str:
    """``ok`` for a call that succeeded (no code, or OK), else the code's name."""
    return "ok" if code_name in (None, "OK") else str(code_name)


# --- the endpoint ----------------------------------------------------------------------


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where ``/metrics`` is served: port 0 takes any free port (tests)."""

    port: int
    address: str = DEFAULT_METRICS_ADDRESS


def add_metrics_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str], env_prefix: str
) -> None:
    """``--metrics-port`` over ``<env_prefix>METRICS_PORT`` (unset: no endpoint) and
    ``--metrics-address`` over ``<env_prefix>METRICS_ADDRESS``."""
    port_variable = f"{env_prefix}METRICS_PORT"
    address_variable = f"{env_prefix}METRICS_ADDRESS"
    group = parser.add_argument_group("Prometheus metrics (off unless a port)")
    group.add_argument(
        "--metrics-port",
        type=int,
        default=env.get(port_variable) or None,
        help=f"serve /metrics over HTTP on this port; 0 = any free port [{port_variable}]",
    )
    group.add_argument(
        "--metrics-address",
        default=env.get(address_variable, DEFAULT_METRICS_ADDRESS),
        help=f"address the metrics endpoint binds [{address_variable}]",
    )


def metrics_endpoint_of(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> MetricsEndpoint | None:
    if args.metrics_port is None:
        return None
    if not 0 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be 0..65535")
    return MetricsEndpoint(args.metrics_port, args.metrics_address)


class MetricsServer:
    """A running ``/metrics`` endpoint (a daemon thread); `close` stops it."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(endpoint: MetricsEndpoint, service: str) -> MetricsServer:
    """Start serving this process's metrics; logs the bound address once."""
    server, thread = start_http_server(endpoint.port, endpoint.address)
    running = MetricsServer(server, thread)
    _log.info("%s metrics on http://%s:%d/metrics", service, endpoint.address, running.port)
    return running


# --- connection pools, read at scrape time ---------------------------------------------


class StatsPool(Protocol):
    """What the collector reads of a psycopg_pool pool (no import of psycopg here: the
    Worker imports this module and has no database driver)."""

    @property
    def name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def get_stats(self) -> dict[str, int]: ...


_POOL_GAUGES: Final = (
    ("qinglong_pool_connections", "pool_size", "Connections the pool holds (idle or in use)"),
    ("qinglong_pool_connections_idle", "pool_available", "Idle connections ready to hand out"),
    ("qinglong_pool_connections_max", "pool_max", "Most connections the pool may open"),
    ("qinglong_pool_requests_waiting", "requests_waiting", "Callers waiting for a connection"),
)
_POOL_COUNTERS: Final = (
    ("qinglong_pool_requests", "requests_num", "Connections asked for"),
    ("qinglong_pool_requests_queued", "requests_queued", "Requests that had to wait"),
    ("qinglong_pool_requests_errors", "requests_errors", "Requests that got no connection"),
    ("qinglong_pool_connections_lost", "connections_lost", "Connections found broken"),
)


class PoolCollector(Collector):
    """The pools of this process, by name, read when scraped. Pools that share a name
    (tests open many) are summed; a closed or collected pool drops out."""

    def __init__(self) -> None:
        self._pools: weakref.WeakSet[StatsPool] = weakref.WeakSet()

    def add(self, pool: StatsPool) -> None:
        self._pools.add(pool)

    def collect(self) -> Iterator[Metric]:
        totals: dict[str, dict[str, int]] = {}
        for pool in list(self._pools):
            if pool.closed:
                continue
            stats = pool.get_stats()
            summed = totals.setdefault(pool.name, {})
            for key, value in stats.items():
                summed[key] = summed.get(key, 0) + value
        for name, key, documentation in _POOL_GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=["pool"])
            for pool_name, stats in sorted(totals.items()):
                gauge.add_metric([pool_name], stats.get(key, 0))
            yield gauge
        for name, key, documentation in _POOL_COUNTERS:
            counter = CounterMetricFamily(name, documentation, labels=["pool"])
            for pool_name, stats in sorted(totals.items()):
                counter.add_metric([pool_name], stats.get(key, 0))
            yield counter
        wait = CounterMetricFamily(
            "qinglong_pool_requests_wait_seconds",
            "Time callers spent waiting for a connection",
            labels=["pool"],
        )
        for pool_name, stats in sorted(totals.items()):
            wait.add_metric([pool_name], stats.get("requests_wait_ms", 0) / 1000.0)
        yield wait


POOLS: Final = PoolCollector()
REGISTRY.register(POOLS)


def register_pool(pool: StatsPool) -> None:
    """Report ``pool``'s usage under its name (``qinglong_pool_*{pool=...}``)."""
    POOLS.add(pool)
