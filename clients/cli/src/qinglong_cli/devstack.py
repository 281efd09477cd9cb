"""`qinglong up` and `qinglong health`: the whole stack on one machine.

`up` starts, in order: the embedded PostgreSQL (and, with ``--standby``, a
synchronous streaming standby of it), its roles/database/migrations, the
development PKI and identities, the first cluster admin (``qinglong-control
bootstrap-admin``, its token in a 0600 file that stack.json names), N control
replicas, then N ingress replicas (each service a subprocess of its own;
``--replicas N``, default 1), waits until all answer SERVING over mutual TLS,
writes ``stack.json`` and supervises them until SIGINT/SIGTERM: a service that
exits is started again on the same address, with backoff, instead of taking the
stack down (SPEC R-HA-1). On a stop it stops ingress, control and PostgreSQL in
that order -- PostgreSQL by its data directory, so also a server someone
restarted from outside. A second `up` on the same data directory reuses the PKI,
the database and the admin token file (bootstrap issues nothing the second time).

Workers of other machines join (R-ADM-2): every ingress replica also runs the enrollment
listener, and control signs joining Workers' CSRs with the dev CA. ``--listen-host`` binds
ingress's two listeners where other machines reach them (control stays on loopback), and
the advertised host (``--advertise-host``, default the listen host) is what ingress's
certificate names besides loopback and what stack.json and the summary show.

Each service gets exactly its own database URLs in its environment (never on
the command line, where `ps` would show them): control the runtime role's and
the admin role's (docs/decisions/0002), ingress the worker-ingress role's (SPEC
R-ROLE-2). With a standby, all are libpq multi-host URLs (primary, standby;
``target_session_attrs=read-write``), so after the standby's promotion the
services' pools reconnect to it (SPEC R-HA-2).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import fcntl
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

from psycopg.conninfo import make_conninfo
from qinglong_control.db.bootstrap import bootstrap_database
from qinglong_control.db.roles import RoleUrls
from qinglong_control.migrate_command import ENV_MIGRATION_DATABASE_URL
from qinglong_control.settings import ENV_ADMIN_DATABASE_URL as CONTROL_ADMIN_DATABASE_URL_VARIABLE
from qinglong_control.settings import ENV_DATABASE_URL as CONTROL_DATABASE_URL_VARIABLE
from qinglong_ingress.settings import ENV_DATABASE_URL as INGRESS_DATABASE_URL_VARIABLE
from qinglong_protocol.files import atomic_write
from qinglong_protocol.health import NOT_SERVING, health_status
from qinglong_protocol.tls import TlsFiles

from qinglong_cli.dev_enrollment import (
    DEV_PROJECT_ID,
    DevIdentities,
    enroll_development_identities,
)
from qinglong_cli.embedded_postgres import (
    EmbeddedPostgres,
    EmbeddedStandby,
    configure_synchronous_standby,
    start_embedded_postgres,
    start_standby,
)
from qinglong_cli.pki import (
    DevPki,
    ensure_dev_pki,
    ensure_operator_identity,
    ensure_worker_identity,
    operator_uri,
    service_uri,
    worker_uri,
)

DEFAULT_DATA_DIR = Path(".qinglong")
STACK_FILE_NAME = "stack.json"
STACK_FORMAT = 1
DATABASE_NAME = "qinglong"
DEFAULT_WORKER_ID = "local-worker"
DEFAULT_OPERATOR_NAME = "local-operator"
DEFAULT_ADMIN_NAME = "admin"
# Control always binds loopback, and so does ingress unless `--listen-host` says otherwise;
# every server certificate names 127.0.0.1.
LOOPBACK_HOST = "127.0.0.1"
# Listening on every interface: reachable from this machine on loopback, but no name for
# others to dial, so `up` asks for `--advertise-host` then.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})  # noqa: S104 -- recognised, not bound
SERVING = "SERVING"

# Services get little grace in the dev stack; the supervisor kills after `stop_timeout`.
_SERVICE_SHUTDOWN_GRACE_SECONDS = 3.0
_HEALTH_POLL_INTERVAL_SECONDS = 0.1
# A crashed service is started again after 0.5 s, 1 s, 2 s, ... at most 10 s; a run of
# at least 30 s counts as healthy and resets the backoff. After 10 starts in a row that
# never reach `listening`, the configuration is broken, not the process: `up` gives up.
_RESTART_FIRST_DELAY_SECONDS = 0.5
_RESTART_MAX_DELAY_SECONDS = 10.0
_RESTART_HEALTHY_AFTER_SECONDS = 30.0
_RESTART_MAX_FAILED_STARTS = 10


_T = TypeVar("_T")


class StartupError(RuntimeError):
    """The stack could not be brought up; the message says which step failed."""


@dataclass(frozen=True)
class UpOptions:
    data_dir: Path
    postgres_version: int
    ingress_port: int
    control_port: int
    trust_domain: str
    worker_id: str
    operator_name: str
    ready_timeout_seconds: float
    stop_timeout_seconds: float
    replicas: int = 1
    standby: bool = False
    # Ingress's Worker enrollment listener: replica i on enrollment_port + i (0 = any).
    enrollment_port: int = 0
    # Where ingress's public and enrollment listeners bind, and the name other machines
    # dial (None: the listen host). Control stays on loopback whatever these say.
    listen_host: str = LOOPBACK_HOST
    advertise_host: str | None = None

    @property
    def advertised_host(self) -> str:
        return advertised_host(self.listen_host, self.advertise_host)


def advertised_host(listen_host: str, advertise_host: str | None) -> str:
    """The host other machines dial ingress at; ValueError for a wildcard listen host
    without an advertised name (0.0.0.0 is no address a client can be given)."""
    if advertise_host:
        return advertise_host
    if listen_host in WILDCARD_HOSTS:
        raise ValueError(f"--listen-host {listen_host} needs --advertise-host NAME")
    return listen_host


def local_host(listen_host: str) -> str:
    """An address on this machine that reaches a listener bound to `listen_host`."""
    if listen_host in WILDCARD_HOSTS:
        return "::1" if ":" in listen_host else LOOPBACK_HOST
    return listen_host


def host_port(host: str, port: int) -> str:
    # An IPv6 literal needs brackets in HOST:PORT, as gRPC targets and `--listen-address`.
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- the stack file -------------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceEntry:
    address: str
    pid: int
    identity: str
    log: Path
    restarts: int = 0
    # Ingress only: its Worker enrollment listener (server-authenticated TLS).
    enrollment: str | None = None


@dataclass(frozen=True)
class DatabaseServer:
    """Where one PostgreSQL server of the stack listens (a Unix socket directory + port)."""

    data_dir: Path
    socket_dir: Path
    port: int
    pid: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "data_dir": str(self.data_dir),
            "socket_dir": str(self.socket_dir),
            "port": self.port,
        }


@dataclass(frozen=True)
class ClientIdentity:
    identity: str
    cert: Path
    key: Path


@dataclass(frozen=True)
class StackFile:
    """What `up` publishes for other tools. Readers ignore keys they do not know, so
    later additions (operator tokens, ...) do not break them."""

    trust_domain: str
    ca_cert: Path
    ingress_replicas: tuple[ServiceEntry, ...]  # public
    control_replicas: tuple[ServiceEntry, ...]  # internal: only ingress may call its runtime API
    worker_id: str
    worker: ClientIdentity
    project_id: str
    operator_token_file: Path
    operator_name: str
    operator: ClientIdentity
    admin_name: str
    admin_token_file: Path
    postgres_version: int
    postgres: DatabaseServer
    standby: DatabaseServer | None
    supervisor_pid: int
    started_at: str = field(
        default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    )

    @property
    def ingress(self) -> ServiceEntry:
        return self.ingress_replicas[0]

    @property
    def control(self) -> ServiceEntry:
        return self.control_replicas[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STACK_FORMAT,
            "started_at": self.started_at,
            "trust_domain": self.trust_domain,
            "ca_cert": str(self.ca_cert),
            # `ingress`/`control` are replica 0, so single-endpoint tools keep working;
            # `replicas` lists every one (a Worker may use any ingress address).
            "ingress": _service_json(self.ingress),
            "control": _service_json(self.control),
            "replicas": {
                "count": len(self.ingress_replicas),
                "ingress": [_service_json(entry) for entry in self.ingress_replicas],
                "control": [_service_json(entry) for entry in self.control_replicas],
            },
            "worker": {"worker_id": self.worker_id, **_identity_json(self.worker)},
            "project_id": self.project_id,
            "operator": {
                "name": self.operator_name,
                **_identity_json(self.operator),
                # A path, not the token: the stack file may be shown or copied freely.
                "token_file": str(self.operator_token_file),
            },
            # The first cluster admin's token (`qinglong admin …` reads it), also by path.
            "admin": {"name": self.admin_name, "token_file": str(self.admin_token_file)},
            "postgres": {
                "version": self.postgres_version,
                **self.postgres.to_json(),
                "standby": None if self.standby is None else self.standby.to_json(),
                # What the services' multi-host URLs name, in order (no credentials).
                "hosts": [
                    f"{server.socket_dir}:{server.port}"
                    for server in (self.postgres, self.standby)
                    if server is not None
                ],
            },
            "supervisor": {"pid": self.supervisor_pid},
        }


@dataclass(frozen=True)
class StackEndpoints:
    """The part of a stack file `qinglong health` needs."""

    ingress_address: str
    control_address: str
    operator_tls: TlsFiles


def read_stack_endpoints(path: Path) -> StackEndpoints:
    document = json.loads(path.read_text())
    if document.get("format") != STACK_FORMAT:
        raise ValueError(f"{path}: unsupported stack file format {document.get('format')!r}")
    return StackEndpoints(
        ingress_address=str(document["ingress"]["address"]),
        control_address=str(document["control"]["address"]),
        operator_tls=TlsFiles(
            ca_cert=Path(document["ca_cert"]),
            cert=Path(document["operator"]["cert"]),
            key=Path(document["operator"]["key"]),
        ),
    )


def _service_json(entry: ServiceEntry) -> dict[str, Any]:
    document: dict[str, Any] = {
        "address": entry.address,
        "pid": entry.pid,
        "identity": entry.identity,
        "log": str(entry.log),
        "restarts": entry.restarts,
    }
    if entry.enrollment is not None:
        document["enrollment"] = {"address": entry.enrollment}
    return document


def _identity_json(identity: ClientIdentity) -> dict[str, Any]:
    return {"identity": identity.identity, "cert": str(identity.cert), "key": str(identity.key)}


# --- health ---------------------------------------------------------------------------------


async def wait_until_serving(address: str, tls: TlsFiles, timeout_seconds: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_seconds
    status = NOT_SERVING
    while asyncio.get_running_loop().time() < deadline:
        status = await health_status(address, tls, timeout_seconds=1.0)
        if status == SERVING:
            return
        await asyncio.sleep(_HEALTH_POLL_INTERVAL_SECONDS)
    raise StartupError(f"{address} did not become SERVING within {timeout_seconds:.0f} s: {status}")


async def run_health(stack_path: Path, timeout_seconds: float, out: TextIO) -> int:
    """`qinglong health`: print each endpoint's status; nonzero unless both are SERVING."""
    try:
        endpoints = read_stack_endpoints(stack_path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"cannot read stack file {stack_path}: {error}", file=out)
        return 2
    statuses = {
        "ingress": (endpoints.ingress_address, endpoints.operator_tls),
        "control": (endpoints.control_address, endpoints.operator_tls),
    }
    all_serving = True
    for name, (address, tls) in statuses.items():
        status = await health_status(address, tls, timeout_seconds)
        all_serving = all_serving and status == SERVING
        print(f"{name:<8} {address:<22} {status}", file=out)
    return 0 if all_serving else 1


# --- service subprocesses -------------------------------------------------------------------


@dataclass
class ServiceProcess:
    name: str
    process: asyncio.subprocess.Process
    log: Path
    # The bound port of each listener, in the order the service announced them.
    ports: tuple[int, ...] = ()
    _drain: asyncio.Task[None] | None = field(default=None, repr=False)

    async def wait_listening(self, timeout_seconds: float, listeners: int = 1) -> None:
        """Read the service's `listeners` JSON lines announcing its bound ports (control
        has one listener; ingress with enrollment two, the public one first)."""
        assert self.process.stdout is not None
        deadline = asyncio.get_running_loop().time() + timeout_seconds
        ports = []
        for _ in range(listeners):
            remaining = deadline - asyncio.get_running_loop().time()
            ports.append(await self._read_announcement(max(remaining, 0.0), timeout_seconds))
        self.ports = tuple(ports)
        # Keep the pipe drained so a chatty service can never block on a full pipe.
        self._drain = asyncio.create_task(_discard(self.process.stdout))

    async def _read_announcement(self, remaining_seconds: float, timeout_seconds: float) -> int:
        assert self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), remaining_seconds)
        except TimeoutError:
            raise StartupError(
                f"{self.name} did not report listening within {timeout_seconds:.0f} s; "
                f"see {self.log}"
            ) from None
        if not line:
            await self.process.wait()
            raise StartupError(
                f"{self.name} exited with {self.process.returncode} before listening:\n"
                f"{_tail(self.log)}"
            )
        announcement = json.loads(line)
        if announcement.get("event") != "listening":
            raise StartupError(f"{self.name}: unexpected line {line!r}")
        return int(announcement["port"])

    async def stop(self, timeout_seconds: float) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_seconds`."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), timeout_seconds)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain


async def start_service(
    name: str, module: str, arguments: Sequence[str], environment: Mapping[str, str], log: Path
) -> ServiceProcess:
    with _open_log(log) as log_stream:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            *arguments,
            env=dict(environment),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=log_stream,
            # Own session: a terminal's Ctrl-C reaches only `up`, which then stops
            # the services in order (ingress before control before PostgreSQL).
            start_new_session=True,
        )
    return ServiceProcess(name=name, process=process, log=log)


def service_environment(
    inherited: Mapping[str, str], database_urls: Mapping[str, str]
) -> dict[str, str]:
    """`inherited` without any database credential, plus exactly `database_urls` (by
    variable name)."""
    environment = {
        name: value for name, value in inherited.items() if not _is_database_credential(name)
    }
    environment.update(database_urls)
    return environment


def _is_database_credential(name: str) -> bool:
    # libpq reads PG* variables (PGPASSWORD, PGUSER, PGSERVICE, ...) as defaults.
    return name.startswith("PG") or (name.startswith("QINGLONG_") and "DATABASE_URL" in name)


def refuse_credentials(environment: Mapping[str, str], urls: Mapping[str, str]) -> None:
    """Ingress must never receive a control role's URL (`urls`, by role), under any
    variable name."""
    for role, url in urls.items():
        leaking = sorted(name for name, value in environment.items() if url in value)
        if leaking:
            raise StartupError(f"refusing to start ingress: {leaking} carry the {role} credential")


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


@contextlib.contextmanager
def _open_log(path: Path) -> Iterator[TextIO]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as stream:
        yield stream


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


# --- up -------------------------------------------------------------------------------------


async def _completed(starting: Coroutine[Any, Any, _T], record: Callable[[_T], None]) -> _T:
    """Run `starting` to completion even if `up` is stopped meanwhile, and `record` what it
    started, so that the stop in `run_up` undoes it instead of leaving an orphan behind."""
    task = asyncio.ensure_future(starting)
    try:
        result = await asyncio.shield(task)
    except asyncio.CancelledError:
        record(await task)
        raise
    record(result)
    return result


@dataclass
class SupervisedService:
    """One replica as the supervisor sees it: how to start it, and its current process.

    The ports are pinned once the first process has bound them, so a restarted replica
    comes back on the addresses that stack.json, the ingress replicas and Workers already
    know. `ports` has one entry per listener (0 = any free port): the main one first, then
    ingress's enrollment listener.
    """

    name: str
    module: str
    arguments: Callable[[tuple[int, ...]], list[str]]
    environment: dict[str, str]
    log: Path
    identity: str
    ports: tuple[int, ...]
    # Where the listeners bind, and the host clients are told to dial.
    listen_host: str = LOOPBACK_HOST
    advertised_host: str = LOOPBACK_HOST
    current: ServiceProcess | None = None
    restarts: int = 0
    listening_since: float = 0.0

    @property
    def address(self) -> str:
        """The main listener as clients are told to dial it."""
        return host_port(self.advertised_host, self.ports[0])

    @property
    def local_address(self) -> str:
        """The main listener as this machine reaches it (the advertised name may resolve
        elsewhere, e.g. to a NAT's public address)."""
        return host_port(local_host(self.listen_host), self.ports[0])

    def entry(self) -> ServiceEntry:
        assert self.current is not None
        enrollment = None
        if len(self.ports) > 1:
            enrollment = host_port(self.advertised_host, self.ports[1])
        return ServiceEntry(
            self.address,
            self.current.process.pid,
            self.identity,
            self.log,
            self.restarts,
            enrollment,
        )


class _RunningStack:
    """Everything `up` started, so that it can be stopped in reverse order whatever happened."""

    def __init__(self, stop_timeout_seconds: float, ready_timeout_seconds: float) -> None:
        self.postgres: EmbeddedPostgres | None = None
        self.standby: EmbeddedStandby | None = None
        self.services: list[SupervisedService] = []
        self._stop_timeout_seconds = stop_timeout_seconds
        self._ready_timeout_seconds = ready_timeout_seconds

    async def start_postgres(self, data_dir: Path, version: int) -> EmbeddedPostgres:
        starting = asyncio.to_thread(start_embedded_postgres, data_dir, version)
        return await _completed(starting, self._record_postgres)

    async def start_standby(self, primary: EmbeddedPostgres, data_dir: Path) -> EmbeddedStandby:
        starting = asyncio.to_thread(start_standby, primary, data_dir)
        return await _completed(starting, self._record_standby)

    async def start_service(self, service: SupervisedService) -> None:
        """Start `service` and wait until it listens; recorded at once for `stop`."""
        self.services.append(service)
        await self._launch(service)

    async def _launch(self, service: SupervisedService) -> None:
        def record(process: ServiceProcess) -> None:
            service.current = process

        starting = start_service(
            service.name,
            service.module,
            service.arguments(service.ports),
            service.environment,
            service.log,
        )
        process = await _completed(starting, record)
        try:
            await process.wait_listening(self._ready_timeout_seconds, len(service.ports))
        except StartupError:
            await process.stop(self._stop_timeout_seconds)
            raise
        service.ports = process.ports
        service.listening_since = time.monotonic()

    def _record_postgres(self, postgres: EmbeddedPostgres) -> None:
        self.postgres = postgres

    def _record_standby(self, standby: EmbeddedStandby) -> None:
        self.standby = standby

    async def supervise(self, publish: Callable[[], None], out: TextIO) -> str:
        """Keep every service running until cancelled; returns why it gave up otherwise."""
        tasks = [
            asyncio.create_task(self._supervise(service, publish, out), name=service.name)
            for service in self.services
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            # Before `stop` terminates the services: a supervisor left running would
            # take their exits for crashes and start them again.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _supervise(
        self, service: SupervisedService, publish: Callable[[], None], out: TextIO
    ) -> str:
        delay = _RESTART_FIRST_DELAY_SECONDS
        while True:
            current = service.current
            assert current is not None
            status = await current.process.wait()
            await current.stop(self._stop_timeout_seconds)  # ends its output drain
            if time.monotonic() - service.listening_since >= _RESTART_HEALTHY_AFTER_SECONDS:
                delay = _RESTART_FIRST_DELAY_SECONDS
            print(
                f"{service.name} (pid {current.process.pid}) exited ({status}); "
                f"restarting in {delay:.1f} s",
                file=out,
                flush=True,
            )
            failed_starts = 0
            while True:
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RESTART_MAX_DELAY_SECONDS)
                try:
                    await self._launch(service)
                    break
                except StartupError as error:
                    failed_starts += 1
                    if failed_starts >= _RESTART_MAX_FAILED_STARTS:
                        return f"{service.name} could not be restarted: {error}"
                    print(f"{service.name} did not restart: {error}", file=out, flush=True)
            service.restarts += 1
            publish()
            assert service.current is not None
            print(
                f"{service.name} restarted (pid {service.current.process.pid}) "
                f"on {service.address}",
                file=out,
                flush=True,
            )

    async def stop(self) -> None:
        for service in reversed(self.services):  # ingress replicas, then control replicas
            if service.current is not None:
                await service.current.stop(self._stop_timeout_seconds)
        # The primary first: its shutdown checkpoint still reaches a standby that streams.
        if self.postgres is not None:
            await asyncio.to_thread(self.postgres.stop)
        if self.standby is not None:
            await asyncio.to_thread(self.standby.stop)


async def run_up(options: UpOptions, out: TextIO) -> int:
    """`qinglong up`: 0 after a requested stop, 1 if start-up failed or a service could not
    be restarted."""
    data_dir = options.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    stack_path = data_dir / STACK_FILE_NAME
    with _exclusive_data_dir(data_dir) as locked:
        if not locked:
            print(f"another `qinglong up` is running on {data_dir}", file=out)
            return 1
        stack_path.unlink(missing_ok=True)  # a stale file from a crashed run would mislead
        running = _RunningStack(options.stop_timeout_seconds, options.ready_timeout_seconds)
        _stop_on_signals(asyncio.current_task())
        try:
            stack = await _start(options, data_dir, running)

            def publish() -> None:
                # Rewritten after every restart: a replica's pid changes, its address not.
                current = dataclasses.replace(
                    stack,
                    ingress_replicas=_entries(running, "ingress"),
                    control_replicas=_entries(running, "control"),
                )
                atomic_write(stack_path, json.dumps(current.to_json(), indent=2).encode(), 0o600)

            publish()
            _print_summary(stack, data_dir, stack_path, out)
            reason = await running.supervise(publish, out)
            print(f"{reason}; stopping", file=out)
            return 1
        except asyncio.CancelledError:
            _uncancel()
            print("stopping ...", file=out, flush=True)
            return 0
        except (StartupError, RuntimeError) as error:
            print(f"qinglong up failed: {error}", file=out)
            return 1
        finally:
            _ignore_signals()  # from here on, nothing may interrupt the orderly stop
            await running.stop()
            stack_path.unlink(missing_ok=True)
            print("stopped", file=out, flush=True)


def _entries(running: _RunningStack, module_prefix: str) -> tuple[ServiceEntry, ...]:
    return tuple(
        service.entry()
        for service in running.services
        if service.module.startswith(f"qinglong_{module_prefix}.")
    )


def replica_name(service: str, index: int) -> str:
    """Replica 0 keeps the plain name (and log file) a single-replica stack always had."""
    return service if index == 0 else f"{service}-{index}"


def _replica_port(port: int, index: int) -> int:
    return 0 if port == 0 else port + index


def multi_host_urls(urls: RoleUrls, servers: Sequence[DatabaseServer]) -> RoleUrls:
    """Each role's URL naming every server in order, for the read-write one only: libpq
    tries them in turn and skips a standby, so after a promotion a new connection finds
    the new primary without any change to the services (SPEC R-HA-2)."""
    hosts = ",".join(str(server.socket_dir) for server in servers)
    ports = ",".join(str(server.port) for server in servers)

    def rewrite(url: str) -> str:
        return make_conninfo(url, host=hosts, port=ports, target_session_attrs="read-write")

    return RoleUrls(
        **{role.name: rewrite(getattr(urls, role.name)) for role in dataclasses.fields(urls)}
    )


async def _start(options: UpOptions, data_dir: Path, running: _RunningStack) -> StackFile:
    postgres = await running.start_postgres(data_dir / "postgres", options.postgres_version)
    primary = DatabaseServer(
        postgres.data_dir,
        postgres.socket_dir,
        postgres.port,
        _postmaster_pid(postgres.data_dir),
    )
    standby_server: DatabaseServer | None = None
    if options.standby:
        # Before anything commits: from here on every COMMIT waits for the standby.
        standby = await running.start_standby(postgres, data_dir / "postgres-standby")
        standby_server = DatabaseServer(
            standby.data_dir, standby.socket_dir, standby.port, standby.pid
        )
    else:
        # A primary left naming a standby (an earlier `up --standby`) would block commits.
        await asyncio.to_thread(configure_synchronous_standby, postgres, enabled=False)
    role_urls = await asyncio.to_thread(
        bootstrap_database, postgres.admin_url, database=DATABASE_NAME
    )
    service_urls = role_urls
    if standby_server is not None:
        service_urls = multi_host_urls(role_urls, [primary, standby_server])
    pki = await asyncio.to_thread(
        ensure_dev_pki, data_dir / "pki", options.trust_domain, _ingress_names(options)
    )
    worker_tls = await asyncio.to_thread(ensure_worker_identity, pki, options.worker_id)
    operator_tls = await asyncio.to_thread(ensure_operator_identity, pki, options.operator_name)
    identities = DevIdentities(
        project_id=DEV_PROJECT_ID,
        worker_id=options.worker_id,
        worker_uri=worker_uri(pki.trust_domain, options.worker_id),
        operator_name=options.operator_name,
        operator_uri=operator_uri(pki.trust_domain, options.operator_name),
        operator_token_file=data_dir / "secrets" / "operator.token",
    )
    await asyncio.to_thread(enroll_development_identities, role_urls.migration, identities)
    admin_token_file = data_dir / "secrets" / "admin.token"
    await asyncio.to_thread(
        bootstrap_admin, role_urls.migration, admin_token_file, options.ready_timeout_seconds
    )
    logs = data_dir / "logs"

    control_environment = service_environment(
        os.environ,
        {
            CONTROL_DATABASE_URL_VARIABLE: service_urls.runtime,
            CONTROL_ADMIN_DATABASE_URL_VARIABLE: service_urls.admin,
        },
    )
    controls: list[SupervisedService] = []
    for index in range(options.replicas):
        name = replica_name("control", index)
        control = SupervisedService(
            name=name,
            module="qinglong_control.main",
            arguments=functools.partial(_control_arguments, pki),
            environment=control_environment,
            log=logs / f"{name}.log",
            identity=service_uri(pki.trust_domain, "control"),
            ports=(_replica_port(options.control_port, index),),
        )
        await running.start_service(control)
        controls.append(control)

    ingress_environment = service_environment(
        os.environ, {INGRESS_DATABASE_URL_VARIABLE: service_urls.ingress}
    )
    for urls in (role_urls, service_urls):
        refuse_credentials(ingress_environment, {"runtime": urls.runtime, "admin": urls.admin})
    ingresses: list[SupervisedService] = []
    for index in range(options.replicas):
        name = replica_name("ingress", index)
        # Every ingress replica reaches every control replica (round robin, its own pair
        # first): a crashed control replica is skipped while the supervisor restarts it.
        ordered = controls[index:] + controls[:index]
        control_address = ",".join(control.address for control in ordered)
        ingress = SupervisedService(
            name=name,
            module="qinglong_ingress.main",
            arguments=functools.partial(
                _ingress_arguments,
                pki,
                listen_host=options.listen_host,
                control_address=control_address,
            ),
            environment=ingress_environment,
            log=logs / f"{name}.log",
            identity=service_uri(pki.trust_domain, "ingress"),
            ports=(
                _replica_port(options.ingress_port, index),
                _replica_port(options.enrollment_port, index),
            ),
            listen_host=options.listen_host,
            advertised_host=options.advertised_host,
        )
        await running.start_service(ingress)
        ingresses.append(ingress)

    # Health is open to any certificate from the CA, so the operator's identity
    # probes every replica (control reserves its runtime API for ingress).
    for service in (*controls, *ingresses):
        await wait_until_serving(service.local_address, operator_tls, options.ready_timeout_seconds)

    return StackFile(
        trust_domain=pki.trust_domain,
        ca_cert=pki.ca_cert,
        ingress_replicas=tuple(service.entry() for service in ingresses),
        control_replicas=tuple(service.entry() for service in controls),
        worker_id=options.worker_id,
        worker=ClientIdentity(
            worker_uri(pki.trust_domain, options.worker_id), worker_tls.cert, worker_tls.key
        ),
        project_id=identities.project_id,
        operator_token_file=identities.operator_token_file,
        operator_name=options.operator_name,
        operator=ClientIdentity(
            operator_uri(pki.trust_domain, options.operator_name),
            operator_tls.cert,
            operator_tls.key,
        ),
        admin_name=DEFAULT_ADMIN_NAME,
        admin_token_file=admin_token_file,
        postgres_version=postgres.version,
        postgres=primary,
        standby=standby_server,
        supervisor_pid=os.getpid(),
    )


def bootstrap_admin(migration_url: str, token_file: Path, timeout_seconds: float) -> None:
    """The first cluster admin and its token, written 0600 to `token_file`; nothing when a
    cluster admin exists already (a second `up`), so the file from the first stays valid.

    The real `qinglong-control bootstrap-admin` command, as the Kubernetes Job runs it, with
    the migration role's URL in its environment, not on its command line.
    """
    token_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    command = [sys.executable, "-m", "qinglong_control.main", "bootstrap-admin"]
    command += ["--name", DEFAULT_ADMIN_NAME, "--token-file", str(token_file)]
    environment = service_environment(os.environ, {ENV_MIGRATION_DATABASE_URL: migration_url})
    try:
        completed = subprocess.run(
            command,
            env=environment,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_seconds,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise StartupError(
            f"bootstrap-admin did not finish within {timeout_seconds:.0f} s"
        ) from None
    if completed.returncode != 0:
        # stderr only: stdout is where the command would print a token.
        raise StartupError(
            f"bootstrap-admin exited with {completed.returncode}:\n{completed.stderr}"
        )


def _ingress_names(options: UpOptions) -> list[str]:
    """What the ingress certificate must name besides loopback: the advertised host, and
    the listen host, which `up` itself dials for health."""
    names = [options.advertised_host]
    if options.listen_host not in WILDCARD_HOSTS:
        names.append(options.listen_host)
    return names


def _control_arguments(pki: DevPki, ports: tuple[int, ...]) -> list[str]:
    (port,) = ports
    return [
        "--listen-address",
        host_port(LOOPBACK_HOST, port),
        *_tls_flags("--tls", pki.control_server),
        # Control signs joining Workers' CSRs with the dev CA (R-ADM-2).
        "--issuing-ca-cert",
        str(pki.ca_cert),
        "--issuing-ca-key",
        str(pki.ca_key),
        "--allowed-caller-uri",
        service_uri(pki.trust_domain, "ingress"),
        # Control forms an enrolled Worker's SAN URI in the stack's trust domain.
        "--trust-domain",
        pki.trust_domain,
        "--shutdown-grace-seconds",
        str(_SERVICE_SHUTDOWN_GRACE_SECONDS),
    ]


def _ingress_arguments(
    pki: DevPki, ports: tuple[int, ...], *, listen_host: str, control_address: str
) -> list[str]:
    port, enrollment_port = ports
    return [
        "--listen-address",
        host_port(listen_host, port),
        # Announced second, after the public listener: ServiceProcess reads both.
        "--enrollment-listen-address",
        host_port(listen_host, enrollment_port),
        *_tls_flags("--tls", pki.ingress_server),
        "--control-address",
        control_address,
        *_tls_flags("--control-tls", pki.ingress_client),
        "--shutdown-grace-seconds",
        str(_SERVICE_SHUTDOWN_GRACE_SECONDS),
    ]


def _tls_flags(prefix: str, files: TlsFiles) -> list[str]:
    return [
        f"{prefix}-ca",
        str(files.ca_cert),
        f"{prefix}-cert",
        str(files.cert),
        f"{prefix}-key",
        str(files.key),
    ]


def _postmaster_pid(postgres_data_dir: Path) -> int | None:
    # PostgreSQL documents the first line of postmaster.pid as the postmaster's PID.
    try:
        return int((postgres_data_dir / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


def _print_summary(stack: StackFile, data_dir: Path, stack_path: Path, out: TextIO) -> None:
    lines = [f"QingLong dev stack is up (PostgreSQL {stack.postgres_version}, data in {data_dir})"]
    for index, entry in enumerate(stack.ingress_replicas):
        name = replica_name("ingress", index)
        lines.append(f"  {name:<9} {entry.address:<22} {SERVING}  public, workers and operators")
        if entry.enrollment is not None:
            lines.append(f"  {'':<9} {entry.enrollment:<22} {'':<7}  Worker join (enrollment)")
    for index, entry in enumerate(stack.control_replicas):
        name = replica_name("control", index)
        lines.append(f"  {name:<9} {entry.address:<22} {SERVING}  internal, ingress only")
    if stack.standby is not None:
        lines.append(f"  standby   {stack.standby.socket_dir}  synchronous, streaming")
    print(
        "\n".join(lines) + "\n"
        f"  ca        {stack.ca_cert}  (what a joining Worker trusts)\n"
        f"  worker    {stack.worker.identity}\n"
        f"  operator  {stack.operator.identity}\n"
        f"  admin     {_admin_token_note(stack.admin_token_file)}\n"
        f"  stack     {stack_path}\n"
        "Press Ctrl-C to stop.",
        file=out,
        flush=True,
    )


def _admin_token_note(token_file: Path) -> str:
    if token_file.exists():
        return f"token in {token_file} (`qinglong admin …`)"
    # Bootstrap issues a token only while no cluster admin exists: a deleted file stays lost.
    return f"no token file at {token_file}; a cluster admin exists, ask it for a token"


@contextlib.contextmanager
def _exclusive_data_dir(data_dir: Path) -> Iterator[bool]:
    """Hold an advisory lock on the data directory; yields False if another `up` holds it."""
    with (data_dir / "up.lock").open("w") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def _stop_on_signals(task: asyncio.Task[Any] | None) -> None:
    # Cancelling the `up` task unwinds whatever step it is in, into the `finally` that stops
    # everything started so far. Only the first signal counts: a second one must not cut
    # that orderly stop short.
    assert task is not None

    def stop() -> None:
        _ignore_signals()
        task.cancel()

    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, stop)


def _ignore_signals() -> None:
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, lambda: None)


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
