"""`qinglong up` and `qinglong health`: the whole stack on one machine.

`up` starts, in order: the embedded PostgreSQL, its roles/database/migrations,
the development PKI, control, then ingress (each service a subprocess of its
own), waits until both answer SERVING over mutual TLS, writes ``stack.json``
and waits for SIGINT/SIGTERM. It then stops ingress, control and PostgreSQL in
that order. A second `up` on the same data directory reuses the PKI and the
database.

Each service gets exactly its own database URL in its environment (never on
the command line, where `ps` would show it): control the runtime role's,
ingress the worker-ingress role's (SPEC R-ROLE-2).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import fcntl
import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

from qinglong_control.db.bootstrap import bootstrap_database
from qinglong_control.settings import ENV_DATABASE_URL as CONTROL_DATABASE_URL_VARIABLE
from qinglong_ingress.settings import ENV_DATABASE_URL as INGRESS_DATABASE_URL_VARIABLE
from qinglong_protocol.health import NOT_SERVING, health_status
from qinglong_protocol.tls import TlsFiles

from qinglong_cli.dev_enrollment import (
    DEV_PROJECT_ID,
    DevIdentities,
    enroll_development_identities,
)
from qinglong_cli.embedded_postgres import EmbeddedPostgres, start_embedded_postgres
from qinglong_cli.pki import (
    DevPki,
    atomic_write,
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
# The dev stack binds loopback only; its server certificates name 127.0.0.1.
LOOPBACK_HOST = "127.0.0.1"
SERVING = "SERVING"

# Services get little grace in the dev stack; the supervisor kills after `stop_timeout`.
_SERVICE_SHUTDOWN_GRACE_SECONDS = 3.0
_HEALTH_POLL_INTERVAL_SECONDS = 0.1


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


# --- the stack file -------------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceEntry:
    address: str
    pid: int
    identity: str
    log: Path


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
    ingress: ServiceEntry  # public
    control: ServiceEntry  # internal: only ingress's identity may call its runtime API
    worker_id: str
    worker: ClientIdentity
    project_id: str
    operator_token_file: Path
    operator_name: str
    operator: ClientIdentity
    postgres_version: int
    postgres_pid: int | None
    supervisor_pid: int

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STACK_FORMAT,
            "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "trust_domain": self.trust_domain,
            "ca_cert": str(self.ca_cert),
            "ingress": _service_json(self.ingress),
            "control": _service_json(self.control),
            "worker": {"worker_id": self.worker_id, **_identity_json(self.worker)},
            "project_id": self.project_id,
            "operator": {
                "name": self.operator_name,
                **_identity_json(self.operator),
                # A path, not the token: the stack file may be shown or copied freely.
                "token_file": str(self.operator_token_file),
            },
            "postgres": {"version": self.postgres_version, "pid": self.postgres_pid},
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
    return {
        "address": entry.address,
        "pid": entry.pid,
        "identity": entry.identity,
        "log": str(entry.log),
    }


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
    port: int = 0
    _drain: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{LOOPBACK_HOST}:{self.port}"

    async def wait_listening(self, timeout_seconds: float) -> None:
        """Read the service's one JSON line announcing its bound port."""
        assert self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout_seconds)
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
            raise StartupError(f"{self.name}: unexpected first line {line!r}")
        self.port = int(announcement["port"])
        # Keep the pipe drained so a chatty service can never block on a full pipe.
        self._drain = asyncio.create_task(_discard(self.process.stdout))

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
    inherited: Mapping[str, str], database_variable: str, database_url: str
) -> dict[str, str]:
    """`inherited` without any database credential, plus exactly one database URL."""
    environment = {
        name: value for name, value in inherited.items() if not _is_database_credential(name)
    }
    environment[database_variable] = database_url
    return environment


def _is_database_credential(name: str) -> bool:
    # libpq reads PG* variables (PGPASSWORD, PGUSER, PGSERVICE, ...) as defaults.
    return name.startswith("PG") or (name.startswith("QINGLONG_") and "DATABASE_URL" in name)


def refuse_runtime_credential(environment: Mapping[str, str], runtime_url: str) -> None:
    """Ingress must never receive the runtime role's URL, under any variable name."""
    leaking = sorted(name for name, value in environment.items() if runtime_url in value)
    if leaking:
        raise StartupError(f"refusing to start ingress: {leaking} carry the runtime credential")


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


class _RunningStack:
    """Everything `up` started, so that it can be stopped in reverse order whatever happened."""

    def __init__(self, stop_timeout_seconds: float) -> None:
        self.postgres: EmbeddedPostgres | None = None
        self.services: list[ServiceProcess] = []
        self._stop_timeout_seconds = stop_timeout_seconds

    async def start_postgres(self, data_dir: Path, version: int) -> EmbeddedPostgres:
        starting = asyncio.to_thread(start_embedded_postgres, data_dir, version)
        return await _completed(starting, self._record_postgres)

    async def start_service(
        self,
        name: str,
        module: str,
        arguments: Sequence[str],
        environment: Mapping[str, str],
        log: Path,
    ) -> ServiceProcess:
        starting = start_service(name, module, arguments, environment, log)
        return await _completed(starting, self.services.append)

    def _record_postgres(self, postgres: EmbeddedPostgres) -> None:
        self.postgres = postgres

    async def stop(self) -> None:
        for service in reversed(self.services):  # ingress, then control
            await service.stop(self._stop_timeout_seconds)
        if self.postgres is not None:
            await asyncio.to_thread(self.postgres.stop)


async def run_up(options: UpOptions, out: TextIO) -> int:
    """`qinglong up`: 0 after a requested stop, 1 if start-up failed or a service died."""
    data_dir = options.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    stack_path = data_dir / STACK_FILE_NAME
    with _exclusive_data_dir(data_dir) as locked:
        if not locked:
            print(f"another `qinglong up` is running on {data_dir}", file=out)
            return 1
        stack_path.unlink(missing_ok=True)  # a stale file from a crashed run would mislead
        running = _RunningStack(options.stop_timeout_seconds)
        _stop_on_signals(asyncio.current_task())
        try:
            stack = await _start(options, data_dir, running)
            atomic_write(stack_path, json.dumps(stack.to_json(), indent=2).encode(), 0o600)
            _print_summary(stack, data_dir, stack_path, out)
            exited = await _first_exit(running.services)
            print(
                f"{exited.name} exited unexpectedly ({exited.process.returncode}); stopping",
                file=out,
            )
            return 1
        except asyncio.CancelledError:
            _uncancel()
            print("stopping ...", file=out, flush=True)
            return 0
        except StartupError as error:
            print(f"qinglong up failed: {error}", file=out)
            return 1
        finally:
            _ignore_signals()  # from here on, nothing may interrupt the orderly stop
            await running.stop()
            stack_path.unlink(missing_ok=True)
            print("stopped", file=out, flush=True)


async def _start(options: UpOptions, data_dir: Path, running: _RunningStack) -> StackFile:
    postgres = await running.start_postgres(data_dir / "postgres", options.postgres_version)
    role_urls = await asyncio.to_thread(
        bootstrap_database, postgres.admin_url, database=DATABASE_NAME
    )
    pki = await asyncio.to_thread(ensure_dev_pki, data_dir / "pki", options.trust_domain)
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
    logs = data_dir / "logs"

    control = await running.start_service(
        "control",
        "qinglong_control.main",
        _control_arguments(pki, options.control_port),
        service_environment(os.environ, CONTROL_DATABASE_URL_VARIABLE, role_urls.runtime),
        logs / "control.log",
    )
    await control.wait_listening(options.ready_timeout_seconds)

    ingress_environment = service_environment(
        os.environ, INGRESS_DATABASE_URL_VARIABLE, role_urls.ingress
    )
    refuse_runtime_credential(ingress_environment, role_urls.runtime)
    ingress = await running.start_service(
        "ingress",
        "qinglong_ingress.main",
        _ingress_arguments(pki, options.ingress_port, control.address),
        ingress_environment,
        logs / "ingress.log",
    )
    await ingress.wait_listening(options.ready_timeout_seconds)

    # Health is open to any certificate from the CA, so the operator's identity
    # probes both (control reserves its runtime API for ingress).
    for service in (control, ingress):
        await wait_until_serving(service.address, operator_tls, options.ready_timeout_seconds)

    return StackFile(
        trust_domain=pki.trust_domain,
        ca_cert=pki.ca_cert,
        ingress=ServiceEntry(
            ingress.address,
            ingress.process.pid,
            service_uri(pki.trust_domain, "ingress"),
            ingress.log,
        ),
        control=ServiceEntry(
            control.address,
            control.process.pid,
            service_uri(pki.trust_domain, "control"),
            control.log,
        ),
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
        postgres_version=postgres.version,
        postgres_pid=_postmaster_pid(postgres.data_dir),
        supervisor_pid=os.getpid(),
    )


def _control_arguments(pki: DevPki, port: int) -> list[str]:
    return [
        "--listen-address",
        f"{LOOPBACK_HOST}:{port}",
        *_tls_flags("--tls", pki.control_server),
        "--allowed-caller-uri",
        service_uri(pki.trust_domain, "ingress"),
        "--shutdown-grace-seconds",
        str(_SERVICE_SHUTDOWN_GRACE_SECONDS),
    ]


def _ingress_arguments(pki: DevPki, port: int, control_address: str) -> list[str]:
    return [
        "--listen-address",
        f"{LOOPBACK_HOST}:{port}",
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


async def _first_exit(services: Sequence[ServiceProcess]) -> ServiceProcess:
    waits = {asyncio.create_task(service.process.wait()): service for service in services}
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return waits[next(iter(done))]


def _postmaster_pid(postgres_data_dir: Path) -> int | None:
    # PostgreSQL documents the first line of postmaster.pid as the postmaster's PID.
    try:
        return int((postgres_data_dir / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


def _print_summary(stack: StackFile, data_dir: Path, stack_path: Path, out: TextIO) -> None:
    print(
        f"QingLong dev stack is up (PostgreSQL {stack.postgres_version}, data in {data_dir})\n"
        f"  ingress   {stack.ingress.address:<22} {SERVING}  public, workers and operators\n"
        f"  control   {stack.control.address:<22} {SERVING}  internal, ingress only\n"
        f"  worker    {stack.worker.identity}\n"
        f"  operator  {stack.operator.identity}\n"
        f"  stack     {stack_path}\n"
        "Press Ctrl-C to stop.",
        file=out,
        flush=True,
    )


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
