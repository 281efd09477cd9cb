"""What a Worker feels: Worker commands through ingress and control, against their floors.

Starts the real stack (`qinglong up`, embedded PostgreSQL, dev certificates, control and
ingress as their own processes) and measures, in the same run:

* floor 1 — a two-hop mutual-TLS grpc.aio echo: a client calls an echo proxy (its own
  process) that calls an echo server (its own process), the same shape as
  Worker → ingress → control with no work in either hop;
* floor 2 — a one-row UPDATE + INSERT durable commit on the stack's PostgreSQL;
* AcknowledgeStarting, AcknowledgeRunning, ControlLease and CompleteAttempt through
  ingress with the Worker's real certificate, sequentially (p50/p99);
* ControlLease throughput and p50/p99 at 1, 16 and 64 concurrent callers, each on its own
  running Attempt.

It prints a table and the ratios of issue 11: e2e ACK p50 / (echo + 2 x commit), and
ControlLease throughput at 64 / the echo's at 64. This machine is shared and noisy, so
only ratios measured in one run mean anything.

    .venv/bin/python bench/bench_e2e.py [--runs 200] [--renewals 640]

With ``--tracing`` it measures what exporting traces costs instead (issue 11: tracing on /
off ≤ 1.10 on each command's p50), with two stacks up at once:

* tracing off: the stack as above, without an exporter: `configure_telemetry` installs
  no SDK then (nothing is recorded; the trace context still passes through), which is
  production without a collector;
* tracing on: the same stack started with OTEL_EXPORTER_OTLP_ENDPOINT pointing at an
  OTLP/gRPC sink (bench/otlp_sink.py, a process of its own, plaintext on 127.0.0.1; the
  same variable turns metric export on too, and the sink accepts that as well). The
  bench's Worker channel to it carries the OpenTelemetry client interceptors with its own
  exporting TracerProvider and the Worker's sampler, so each command is one trace
  Worker → ingress → control → database, as in production; ControlLease, a polling
  call, starts no trace there, as from a real Worker.

Both arms get their own session and task; each claims the same batch of Runs, then Run by
Run each times one Attempt's four commands, the arm going first alternating, so the drift
and bursts of this shared machine land on both arms alike: the 10 % looked for is smaller
than what load from other users moves a p50 by between two runs. (Two identical arms
measured this way agreed within 4 % on each p50 at 200 Runs.) ControlLease at 1, 16 and
64 callers alternates likewise (off, on, on, off), but a level lasts about a second, so
its rows stay noisy. It prints both tables, each command's p50 on / off, lease throughput
on / off, the CPU seconds each arm's ingress and control used meanwhile, and, once both
stacks have stopped (the services flush their last spans as they exit), what the sink
received: spans by service and how many traces crossed Worker, ingress and control. The
floors are not measured: tracing does not change them.

The Worker's span export shares this process with both arms' clients, so its CPU
(serializing spans) lands on whichever arm is being timed at that moment, as a real
Worker's would. The sink only keeps what it receives until the end, and parses it then.

    .venv/bin/python bench/bench_e2e.py --tracing [--runs 200] [--renewals 640]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import grpc
import psutil
import psycopg
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2, fence_pb2
from qinglong.worker.v1 import worker_pb2, worker_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol.bounds import encode_lease_capability
from qinglong_protocol.telemetry import client_interceptors, trace_sampler
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import percentiles
from tests.support.devstack_process import DevStack, dev_stack
from tests.support.postgres_control import postmaster_pid

ECHO_SERVER = """
import asyncio, sys
import grpc
from qinglong_protocol.tls import TlsFiles, mutual_tls_server_credentials
from qinglong_protocol.tls import mutual_tls_channel_credentials
from pathlib import Path

ca, cert, key, upstream = sys.argv[1:5]
tls = TlsFiles(Path(ca), Path(cert), Path(key))

async def main():
    server = grpc.aio.server()
    forward = None
    if upstream != "-":
        client = TlsFiles(Path(ca), Path(sys.argv[5]), Path(sys.argv[6]))
        channel = grpc.aio.secure_channel(upstream, mutual_tls_channel_credentials(client))
        forward = channel.unary_unary("/bench.Echo/Call")

    async def call(request, context):
        return request if forward is None else await forward(request)

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_secure_port("127.0.0.1:0", mutual_tls_server_credentials(tls))
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""

COMMANDS: Final = ("AcknowledgeStarting", "AcknowledgeRunning", "ControlLease", "CompleteAttempt")
CONCURRENCY: Final = (1, 16, 64)
# Runs claimed at once, and the Attempts held for the concurrent renewals: the session's
# capacity.
BATCH: Final = 64


@dataclass(frozen=True)
class Figure:
    name: str
    samples: list[float]  # milliseconds

    @property
    def p50(self) -> float:
        return percentiles.p50(self.samples)

    @property
    def p99(self) -> float:
        return percentiles.p99(self.samples)


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return (time.perf_counter() - started) * 1000.0


# --- where the CPU goes ---------------------------------------------------------------------

#: The columns of the CPU table: the caller, the first hop (echo proxy / ingress), the
#: second (echo server / control), and the stack's PostgreSQL (every server process).
CPU_PARTS: Final = ("client", "hop 1", "hop 2", "postgres")


@dataclass(frozen=True)
class CpuMeter:
    """CPU seconds (user + system, from /proc) of each part's processes. PostgreSQL's
    backends are read as they are when a phase starts; the pools are warm by then, so
    the phase's connections are among them."""

    parts: dict[str, Callable[[], list[psutil.Process]]]

    def read(self) -> dict[str, float]:
        used = {}
        for part, processes in self.parts.items():
            used[part] = sum(_cpu_seconds(process) for process in processes())
        return used

    @contextlib.contextmanager
    def phase(self, name: str, calls: int, table: list[CpuRow]) -> Iterator[None]:
        """Adds the CPU per call of what runs inside to `table` as row `name`."""
        processes = {part: found() for part, found in self.parts.items()}
        frozen = CpuMeter({part: partial(list, found) for part, found in processes.items()})
        before = frozen.read()
        yield
        after = frozen.read()
        table.append(CpuRow(name, {part: after[part] - before[part] for part in self.parts}, calls))


@dataclass(frozen=True)
class CpuRow:
    name: str
    seconds: dict[str, float]  # CPU seconds of each part over the phase
    calls: int

    def per_call(self, part: str) -> float | None:
        used = self.seconds.get(part)
        return None if used is None else used / self.calls


def _cpu_seconds(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:  # a backend that ended: its CPU is not counted
        return 0.0
    return float(times.user + times.system)


def echo_meter(proxy: subprocess.Popen[str], server: subprocess.Popen[str]) -> CpuMeter:
    return CpuMeter(
        {
            "client": lambda: [psutil.Process()],
            "hop 1": lambda: [psutil.Process(proxy.pid)],
            "hop 2": lambda: [psutil.Process(server.pid)],
        }
    )


def stack_meter(stack: DevStack) -> CpuMeter:
    def postgres() -> list[psutil.Process]:
        pid = postmaster_pid(stack.data_dir / "postgres")
        if pid is None:
            raise RuntimeError("the stack's PostgreSQL is not running")
        postmaster = psutil.Process(pid)
        return [postmaster, *postmaster.children(recursive=True)]

    return CpuMeter(
        {
            "client": lambda: [psutil.Process()],
            "hop 1": lambda: [psutil.Process(int(stack.document["ingress"]["pid"]))],
            "hop 2": lambda: [psutil.Process(int(stack.document["control"]["pid"]))],
            "postgres": postgres,
        }
    )


def print_cpu(table: Sequence[CpuRow]) -> None:
    print(
        "\nCPU per call, ms (user + system of each process over the phase / its calls;"
        " hop 1 = echo proxy or ingress, hop 2 = echo server or control)"
    )
    print(f"{'phase':32}" + "".join(f"{part:>10}" for part in CPU_PARTS) + f"{'total':>10}")
    for row in table:
        cells = [row.per_call(part) for part in CPU_PARTS]
        shown = "".join(f"{'-':>10}" if cell is None else f"{cell * 1000:10.3f}" for cell in cells)
        total = sum(cell for cell in cells if cell is not None) * 1000
        print(f"{row.name:32}{shown}{total:10.3f}")


# --- floors ---------------------------------------------------------------------------------


def start_echo(
    tls: TlsFiles, upstream: str, client: TlsFiles | None
) -> tuple[subprocess.Popen[str], int]:
    extra = [] if client is None else [str(client.cert), str(client.key)]
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ECHO_SERVER,
            str(tls.ca_cert),
            str(tls.cert),
            str(tls.key),
            upstream,
            *extra,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    return process, int(process.stdout.readline())


async def echo_floor(
    stack: DevStack, count: int, level_calls: int, concurrency: Sequence[int], cpu: list[CpuRow]
) -> tuple[Figure, dict[int, float]]:
    """`count` calls one at a time, then `level_calls` at each concurrency."""
    server_tls = stack.ingress_server_tls
    far, far_port = start_echo(server_tls, "-", None)
    near, near_port = start_echo(server_tls, f"127.0.0.1:{far_port}", stack.worker_tls)
    meter = echo_meter(near, far)
    try:
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{near_port}", mutual_tls_channel_credentials(stack.worker_tls)
        ) as channel:
            call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]
            call = channel.unary_unary("/bench.Echo/Call")
            payload = secrets.token_bytes(200)
            for _ in range(50):
                await call(payload)
            samples: list[float] = []
            with meter.phase("two-hop echo, one at a time", count, cpu):
                samples += [await timed(lambda: call(payload)) for _ in range(count)]
            rates = {}
            for callers in concurrency:
                with meter.phase(f"two-hop echo x{callers}", level_calls, cpu):
                    rates[callers] = await throughput(lambda: call(payload), callers, level_calls)
        return Figure("two-hop mTLS echo", samples), rates
    finally:
        for process in (near, far):
            process.terminate()
            process.wait()


def commit_floor(stack: DevStack, count: int) -> Figure:
    with psycopg.connect(stack.migration_url, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE one (id int PRIMARY KEY, n bigint)")
        conn.execute("CREATE TABLE IF NOT EXISTS public.bench_log (id bigserial, n bigint)")
        conn.execute("INSERT INTO one VALUES (1, 0)")
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            with conn.pipeline():
                conn.execute("BEGIN")
                conn.execute("UPDATE one SET n = n + 1 WHERE id = 1")
                conn.execute("INSERT INTO public.bench_log (n) VALUES (1)")
                conn.execute("COMMIT")
            samples.append((time.perf_counter() - started) * 1000.0)
        conn.execute("DROP TABLE public.bench_log")
    return Figure("UPDATE+INSERT durable commit", samples)


async def throughput(call: Callable[[], Awaitable[Any]], callers: int, total: int) -> float:
    """Calls per second with `callers` concurrent loops sharing `total` calls."""
    remaining = total

    async def loop() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(callers)))
    return total / (time.perf_counter() - started)


# --- the Worker's path ---------------------------------------------------------------------


@dataclass
class Work:
    fence: fence_pb2.Fence


class Bench:
    def __init__(self, stack: DevStack, channel: grpc.aio.Channel, operator: grpc.aio.Channel):
        self.stack = stack
        self.worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        self.tasks = task_service_pb2_grpc.TaskServiceStub(operator)
        self.runs = run_service_pb2_grpc.RunServiceStub(operator)
        self.meta = (("authorization", "Bearer " + stack.operator_token),)
        self.session: ws.OpenSessionResponse | None = None

    async def open_session(self, capacity: int) -> None:
        self.session = await self.worker.OpenSession(
            ws.OpenSessionRequest(
                request_id=uuid.uuid4().hex,
                worker_id=self.stack.worker_id,
                agent_version="bench",
                executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                max_concurrent_attempts=capacity,
            )
        )

    @contextlib.asynccontextmanager
    async def session_kept(self) -> AsyncIterator[None]:
        """Renews the session in the background, as a Worker does, for measurements that
        outlast its lifetime (30 s by default). A renewal that fails is raised on exit."""
        session = self.session
        assert session is not None
        interval = max(1.0, session.renew_interval.ToMilliseconds() / 1000.0)
        request = ws.RenewSessionRequest(
            worker_id=self.stack.worker_id,
            session_id=session.session_id,
            worker_generation=session.worker_generation,
        )

        async def keep() -> None:
            while True:
                await asyncio.sleep(interval)
                await self.worker.RenewSession(request)

        keeper = asyncio.create_task(keep())
        try:
            yield
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    async def task(self) -> str:
        created = await self.tasks.CreateTask(
            task_service_pb2.CreateTaskRequest(
                project_id=self.stack.project_id, request_id=uuid.uuid4().hex, display_name="bench"
            ),
            metadata=self.meta,
        )
        await self.tasks.CreateTaskRevision(
            task_service_pb2.CreateTaskRevisionRequest(
                project_id=self.stack.project_id,
                task_id=created.task.task_id,
                request_id=uuid.uuid4().hex,
                plan=execution_pb2.ExecutionPlan(
                    executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER,
                    command=["true"],
                    timeout_ms=3_600_000,
                ),
            ),
            metadata=self.meta,
        )
        return created.task.task_id

    async def claim(self, task_id: str, count: int) -> list[Work]:
        assert self.session is not None
        for _ in range(count):
            await self.runs.TriggerRun(
                run_service_pb2.TriggerRunRequest(
                    project_id=self.stack.project_id, task_id=task_id, request_id=uuid.uuid4().hex
                ),
                metadata=self.meta,
            )
        claimed: list[Work] = []
        while len(claimed) < count:
            pulled = await self.worker.PullOffers(
                ws.PullOffersRequest(
                    worker_id=self.stack.worker_id,
                    session_id=self.session.session_id,
                    worker_generation=self.session.worker_generation,
                    max_offers=min(64, count - len(claimed)),
                )
            )
            for offer in pulled.offers:
                token = encode_lease_capability(secrets.token_bytes(32))
                answer = await self.worker.ClaimOffer(
                    ws.ClaimOfferRequest(
                        worker_id=self.stack.worker_id,
                        session_id=self.session.session_id,
                        worker_generation=self.session.worker_generation,
                        offer_id=offer.offer_id,
                        project_id=offer.project_id,
                        run_id=offer.run_id,
                        lease_token=token,
                    )
                )
                claimed.append(
                    Work(
                        fence_pb2.Fence(
                            worker_id=self.stack.worker_id,
                            session_id=self.session.session_id,
                            worker_generation=self.session.worker_generation,
                            project_id=offer.project_id,
                            run_id=offer.run_id,
                            attempt_id=answer.attempt_id,
                            offer_id=offer.offer_id,
                            lease_generation=answer.lease_generation,
                            lease_token=token,
                            expected_lease_version=answer.lease_version,
                        )
                    )
                )
        return claimed

    async def starting(self, work: Work) -> None:
        await self.worker.AcknowledgeStarting(ws.AcknowledgeStartingRequest(fence=work.fence))

    async def running(self, work: Work) -> None:
        await self.worker.AcknowledgeRunning(
            ws.AcknowledgeRunningRequest(
                fence=work.fence,
                executor_handle="pid:4242;start:1",
                callback_sequence=1,
                callback_token_digest="ab" * 32,
            )
        )

    async def control(self, work: Work) -> None:
        answer = await self.worker.ControlLease(ws.ControlLeaseRequest(fence=work.fence))
        work.fence.expected_lease_version = answer.renewed.lease_version

    async def complete(self, work: Work) -> None:
        await self.worker.CompleteAttempt(
            ws.CompleteAttemptRequest(
                fence=work.fence,
                callback_sequence=1,
                outcome=worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED,
                exit_code=0,
            )
        )


async def renew(bench: Bench, mine: list[Work], count: int, samples: list[float]) -> None:
    """One caller renewing only its own Attempts, so no two renewals race on one lease."""
    for index in range(count):
        samples.append(await timed(partial(bench.control, mine[index % len(mine)])))


def empty_figures() -> dict[str, list[float]]:
    return {name: [] for name in COMMANDS}


async def one_run(bench: Bench, work: Work, figures: dict[str, list[float]]) -> None:
    """Times one Attempt's four commands, one at a time, in the order a Worker sends them."""
    commands = (bench.starting, bench.running, bench.control, bench.complete)
    for name, command in zip(COMMANDS, commands, strict=True):
        figures[name].append(await timed(partial(command, work)))


async def hold(bench: Bench, task_id: str) -> list[Work]:
    """Running Attempts for the concurrent renewals (never completed: only renewed)."""
    held = await bench.claim(task_id, BATCH)
    for work in held:
        await bench.starting(work)
        await bench.running(work)
    return held


async def lease_level(
    bench: Bench, held: list[Work], callers: int, renewals: int
) -> tuple[float, Figure]:
    """ControlLease calls/s and latencies with `callers` concurrent callers."""
    samples: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(
        *(renew(bench, held[i::callers], renewals // callers, samples) for i in range(callers))
    )
    rate = len(samples) / (time.perf_counter() - started)
    return rate, Figure(f"ControlLease x{callers}", samples)


@contextlib.asynccontextmanager
async def worker_bench(
    stack: DevStack, interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None
) -> AsyncIterator[Bench]:
    """A Bench on its own channels to `stack`'s ingress: the Worker's (through
    `interceptors`, if any) and the operator's."""
    worker_channel = grpc.aio.secure_channel(
        stack.ingress_address,
        mutual_tls_channel_credentials(stack.worker_tls),
        interceptors=interceptors,
    )
    operator_channel = grpc.aio.secure_channel(
        stack.ingress_address, mutual_tls_channel_credentials(stack.operator_tls)
    )
    try:
        yield Bench(stack, worker_channel, operator_channel)
    finally:
        await worker_channel.close()
        await operator_channel.close()


async def measure(stack: DevStack, runs: int, renewals: int) -> None:
    commit = commit_floor(stack, runs)
    cpu: list[CpuRow] = []
    echo, echo_rates = await echo_floor(stack, runs, renewals, CONCURRENCY, cpu)
    async with worker_bench(stack) as bench:
        await bench.open_session(BATCH)
        task_id = await bench.task()
        async with bench.session_kept():  # a long run outlasts the session's lifetime
            figures, lease_rates = await worker_figures(
                bench, task_id, runs, renewals, stack_meter(stack), cpu
            )
    report(echo, commit, echo_rates, figures, lease_rates)
    print_cpu(_in_order(cpu))


def _in_order(cpu: list[CpuRow]) -> list[CpuRow]:
    """Each echo row beside the Worker's row at the same concurrency."""
    echo = [row for row in cpu if row.name.startswith("two-hop")]
    worker = [row for row in cpu if not row.name.startswith("two-hop")]
    return [row for pair in zip(echo, worker, strict=True) for row in pair]


async def worker_figures(
    bench: Bench,
    task_id: str,
    runs: int,
    renewals: int,
    meter: CpuMeter | None = None,
    cpu: list[CpuRow] | None = None,
) -> tuple[dict[str, list[float]], dict[int, tuple[float, Figure]]]:
    """The four commands one Run at a time, then ControlLease at each concurrency; with
    `meter`, the CPU per call of each phase goes to `cpu` (claiming is not counted)."""
    figures = empty_figures()
    table: list[CpuRow] = [] if cpu is None else cpu
    phase = meter.phase if meter is not None else _unmetered
    done = 0
    while done < runs:
        batch = await bench.claim(task_id, min(BATCH, runs - done))
        with phase("Worker commands, one at a time", len(batch) * len(COMMANDS), table):
            for work in batch:
                await one_run(bench, work, figures)
        done += len(batch)
    _merge_rows(table, "Worker commands, one at a time")
    held = await hold(bench, task_id)
    lease_rates: dict[int, tuple[float, Figure]] = {}
    for callers in CONCURRENCY:
        with phase(f"ControlLease x{callers}", renewals // callers * callers, table):
            lease_rates[callers] = await lease_level(bench, held, callers, renewals)
    return figures, lease_rates


@contextlib.contextmanager
def _unmetered(name: str, calls: int, table: list[CpuRow]) -> Iterator[None]:
    yield


def _merge_rows(table: list[CpuRow], name: str) -> None:
    """One row for a phase measured in several parts (each batch of Runs): their CPU
    seconds and calls added up, so every call weighs the same."""
    parts = [row for row in table if row.name == name]
    if len(parts) <= 1:
        return
    seconds = {part: sum(row.seconds[part] for row in parts) for part in parts[0].seconds}
    merged = CpuRow(name, seconds, sum(row.calls for row in parts))
    table[:] = [row for row in table if row.name != name] + [merged]


def print_table(figures: Iterable[Figure]) -> None:
    print(f"{'figure':40} {'p50 ms':>8} {'p99 ms':>8}")
    for figure in figures:
        print(f"{figure.name:40} {figure.p50:8.2f} {figure.p99:8.2f}")


def report(
    echo: Figure,
    commit: Figure,
    echo_rates: dict[int, float],
    figures: dict[str, list[float]],
    lease_rates: dict[int, tuple[float, Figure]],
) -> None:
    floor = echo.p50 + 2 * commit.p50
    print_table((echo, commit, *(Figure(name, s) for name, s in figures.items())))
    print(f"\nfloor = echo + 2 x commit = {floor:.2f} ms")
    for name, samples in figures.items():
        print(f"{name:24} p50 / floor = {percentiles.p50(samples) / floor:5.2f}x")
    print(
        f"\n{'callers':>8} {'echo/s':>10} {'lease/s':>10} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8}"
    )
    for callers, (rate, figure) in lease_rates.items():
        ratio = rate / echo_rates[callers]
        print(
            f"{callers:8d} {echo_rates[callers]:10.0f} {rate:10.0f} {ratio:6.2f} "
            f"{figure.p50:8.2f} {figure.p99:8.2f}"
        )


# --- tracing overhead ----------------------------------------------------------------------

WORKER_SERVICE: Final = "bench-worker"
TRACED_PATH: Final = frozenset({WORKER_SERVICE, "qinglong-ingress", "qinglong-control"})
# Set in both arms, so that no OTEL_* variable of the caller's environment turns export on
# in the "off" stack, or the SDK off in the "on" one.
TRACING_OFF: Final = {
    "OTEL_SDK_DISABLED": "false",
    "OTEL_TRACES_EXPORTER": "none",
    "OTEL_METRICS_EXPORTER": "none",
}


def tracing_on(endpoint: str) -> dict[str, str]:
    """What an operator sets to send a stack's telemetry to a collector at `endpoint`."""
    return {
        "OTEL_SDK_DISABLED": "false",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
    }


@dataclass(frozen=True)
class SinkReport:
    spans_by_service: dict[str, int]
    traces: list[list[str]]  # the services each trace reached
    metric_exports: int


@dataclass(frozen=True)
class Sink:
    endpoint: str
    process: subprocess.Popen[str]

    def report(self) -> SinkReport:
        """What the sink received; it exits then."""
        out, _ = self.process.communicate(timeout=60)
        return SinkReport(**json.loads(out.splitlines()[-1]))


@contextlib.contextmanager
def otlp_sink() -> Iterator[Sink]:
    """An OTLP/gRPC collector on 127.0.0.1, plaintext, in a process of its own
    (bench/otlp_sink.py): it keeps answering while this process blocks starting and
    stopping the stacks, and its work never holds this process's interpreter lock while
    a command is being timed."""
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("otlp_sink.py"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield Sink(f"http://127.0.0.1:{int(process.stdout.readline())}", process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def worker_tracing(endpoint: str) -> TracerProvider:
    """The Worker's tracing as `configure_telemetry` sets it up under `tracing_on` (its
    sampler too: ControlLease is polling, so it starts no trace), but not installed
    globally: only the traced arm's channel uses it."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": WORKER_SERVICE}),
        sampler=trace_sampler(tracing_on(endpoint)),
    )
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


@dataclass
class Arm:
    """One stack of the comparison, with its own Worker session, task and figures."""

    name: str
    stack: DevStack
    bench: Bench
    task_id: str
    figures: dict[str, list[float]] = field(default_factory=empty_figures)
    leases: dict[int, tuple[float, Figure]] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)


async def open_arm(name: str, stack: DevStack, bench: Bench) -> Arm:
    await bench.open_session(BATCH)
    return Arm(name, stack, bench, await bench.task())


def service_cpu(stack: DevStack) -> dict[str, float]:
    """CPU seconds (user + system) each service process of `stack` has used so far: both
    arms do the same work, so the difference is what tracing costs the services."""
    used = {}
    for service in ("ingress", "control"):
        times = psutil.Process(int(stack.document[service]["pid"])).cpu_times()
        used[service] = times.user + times.system
    return used


async def interleaved_runs(arms: Sequence[Arm], runs: int) -> None:
    """Each arm claims the same batch of Runs; then Run by Run each arm times one Attempt's
    commands, the arm going first alternating."""
    done = 0
    while done < runs:
        size = min(BATCH, runs - done)
        batches = [await arm.bench.claim(arm.task_id, size) for arm in arms]
        for index in range(size):
            turns = [(arm, batch[index]) for arm, batch in zip(arms, batches, strict=True)]
            if (done + index) % 2:
                turns.reverse()
            for arm, work in turns:
                await one_run(arm.bench, work, arm.figures)
        done += size


async def interleaved_leases(arms: Sequence[Arm], renewals: int) -> None:
    """Each concurrency level twice per arm, in the order A B B A, pooled: a level lasts
    about a second, so one burst of the machine's other load would otherwise decide it."""
    held = [await hold(arm.bench, arm.task_id) for arm in arms]
    pairs = list(zip(arms, held, strict=True))
    for callers in CONCURRENCY:
        rounds: dict[str, list[tuple[float, Figure]]] = {arm.name: [] for arm in arms}
        for arm, mine in (*pairs, *reversed(pairs)):
            rounds[arm.name].append(await lease_level(arm.bench, mine, callers, renewals))
        for arm in arms:
            rates, figures = zip(*rounds[arm.name], strict=True)
            samples = [sample for figure in figures for sample in figure.samples]
            arm.leases[callers] = (statistics.mean(rates), Figure(figures[0].name, samples))


async def compare(
    off: DevStack, on: DevStack, provider: TracerProvider, runs: int, renewals: int
) -> None:
    # The Worker's interceptors on the bench's own provider (whose sampler keeps polls out
    # of traces, as in production: then a poll outside a trace is not instrumented).
    traced = client_interceptors(tracer_provider=provider)
    async with worker_bench(off) as quiet, worker_bench(on, traced) as loud:
        arms = [
            await open_arm("tracing off", off, quiet),
            await open_arm("tracing on", on, loud),
        ]
        # Two arms, each lease level twice: longer than a session lives unrenewed.
        async with arms[0].bench.session_kept(), arms[1].bench.session_kept():
            before = [service_cpu(arm.stack) for arm in arms]
            await interleaved_runs(arms, runs)
            await interleaved_leases(arms, renewals)
        for arm, used in zip(arms, before, strict=True):
            arm.cpu = {name: cpu - used[name] for name, cpu in service_cpu(arm.stack).items()}
    report_tracing(*arms)


def report_tracing(off: Arm, on: Arm) -> None:
    for arm in (off, on):
        print(f"{arm.name}:")
        print_table(Figure(name, samples) for name, samples in arm.figures.items())
        print()
    for name in COMMANDS:
        ratio = percentiles.p50(on.figures[name]) / percentiles.p50(off.figures[name])
        print(f"{name:24} p50 on / off = {ratio:5.2f}x  (target <= 1.10)")
    print(
        f"\n{'callers':>8} {'off/s':>10} {'on/s':>10} {'ratio':>6} "
        f"{'off p50':>8} {'on p50':>8} {'off p99':>8} {'on p99':>8}"
    )
    for callers in CONCURRENCY:
        (off_rate, off_figure), (on_rate, on_figure) = off.leases[callers], on.leases[callers]
        print(
            f"{callers:8d} {off_rate:10.0f} {on_rate:10.0f} {on_rate / off_rate:6.2f} "
            f"{off_figure.p50:8.2f} {on_figure.p50:8.2f} {off_figure.p99:8.2f} {on_figure.p99:8.2f}"
        )
    print(f"\n{'CPU s meanwhile':16} {'off':>8} {'on':>8} {'ratio':>6}")
    for service in off.cpu:
        used_off, used_on = off.cpu[service], on.cpu[service]
        print(f"{service:16} {used_off:8.2f} {used_on:8.2f} {used_on / used_off:6.2f}")


def report_sink(received: SinkReport) -> None:
    counted = Counter(received.spans_by_service)
    by_service = ", ".join(f"{name} {count}" for name, count in sorted(counted.items()))
    print(f"\nspans received by the OTLP sink: {counted.total()} ({by_service})")
    crossed = sum(1 for services in received.traces if set(services) >= TRACED_PATH)
    print(f"traces through bench-worker -> ingress -> control: {crossed} of {len(received.traces)}")
    print(f"metric exports received: {received.metric_exports}")


def compare_tracing(runs: int, renewals: int) -> None:
    with otlp_sink() as sink:
        with (
            tempfile.TemporaryDirectory(prefix="qinglong-bench-") as root,
            dev_stack(Path(root) / "off", TRACING_OFF) as off,
            dev_stack(Path(root) / "on", tracing_on(sink.endpoint)) as on,
        ):
            provider = worker_tracing(sink.endpoint)
            try:
                asyncio.run(compare(off, on, provider, runs, renewals))
            finally:
                provider.shutdown()  # flushes the Worker's last spans
        # Both stacks have stopped: their services flushed their last spans as they exited.
        report_sink(sink.report())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--renewals", type=int, default=640)
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="measure the commands with tracing exported vs not instead (see the docstring)",
    )
    args = parser.parse_args()
    if args.tracing:
        compare_tracing(args.runs, args.renewals)
        return
    with (
        tempfile.TemporaryDirectory(prefix="qinglong-bench-") as root,
        dev_stack(Path(root) / "stack") as stack,
    ):
        asyncio.run(measure(stack, args.runs, args.renewals))


if __name__ == "__main__":
    main()
