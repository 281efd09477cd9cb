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

    .venv/bin/python bench/bench_e2e.py [--runs 200] [--renewals 400]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import psycopg
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
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.devstack_process import DevStack, dev_stack

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


@dataclass(frozen=True)
class Figure:
    name: str
    samples: list[float]  # milliseconds

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def p99(self) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return (time.perf_counter() - started) * 1000.0


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
    stack: DevStack, count: int, concurrency: Sequence[int]
) -> tuple[Figure, dict[int, float]]:
    server_tls = stack.ingress_server_tls
    far, far_port = start_echo(server_tls, "-", None)
    near, near_port = start_echo(server_tls, f"127.0.0.1:{far_port}", stack.worker_tls)
    try:
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{near_port}", mutual_tls_channel_credentials(stack.worker_tls)
        ) as channel:
            call = channel.unary_unary("/bench.Echo/Call")
            payload = secrets.token_bytes(200)
            for _ in range(50):
                await call(payload)
            samples = [await timed(lambda: call(payload)) for _ in range(count)]
            rates = {}
            for callers in concurrency:
                rates[callers] = await throughput(lambda: call(payload), callers, count)
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


async def measure(stack: DevStack, runs: int, renewals: int) -> None:
    concurrency = (1, 16, 64)
    commit = commit_floor(stack, runs)
    echo, echo_rates = await echo_floor(stack, runs, concurrency)
    worker_channel = grpc.aio.secure_channel(
        stack.ingress_address, mutual_tls_channel_credentials(stack.worker_tls)
    )
    operator_channel = grpc.aio.secure_channel(
        stack.ingress_address, mutual_tls_channel_credentials(stack.operator_tls)
    )
    try:
        bench = Bench(stack, worker_channel, operator_channel)
        await bench.open_session(64)
        task_id = await bench.task()
        figures: dict[str, list[float]] = {
            "AcknowledgeStarting": [],
            "AcknowledgeRunning": [],
            "ControlLease": [],
            "CompleteAttempt": [],
        }
        done = 0
        while done < runs:
            batch = await bench.claim(task_id, min(64, runs - done))
            for work in batch:
                figures["AcknowledgeStarting"].append(await timed(partial(bench.starting, work)))
                figures["AcknowledgeRunning"].append(await timed(partial(bench.running, work)))
                figures["ControlLease"].append(await timed(partial(bench.control, work)))
                figures["CompleteAttempt"].append(await timed(partial(bench.complete, work)))
            done += len(batch)
        held = await bench.claim(task_id, 64)
        for work in held:
            await bench.starting(work)
            await bench.running(work)
        lease_rates: dict[int, tuple[float, Figure]] = {}
        for callers in concurrency:
            samples: list[float] = []
            started = time.perf_counter()
            await asyncio.gather(
                *(
                    renew(bench, held[i::callers], renewals // callers, samples)
                    for i in range(callers)
                )
            )
            rate = len(samples) / (time.perf_counter() - started)
            lease_rates[callers] = (rate, Figure(f"ControlLease x{callers}", samples))
    finally:
        await worker_channel.close()
        await operator_channel.close()
    report(echo, commit, echo_rates, figures, lease_rates)


def report(
    echo: Figure,
    commit: Figure,
    echo_rates: dict[int, float],
    figures: dict[str, list[float]],
    lease_rates: dict[int, tuple[float, Figure]],
) -> None:
    floor = echo.p50 + 2 * commit.p50
    print(f"{'figure':40} {'p50 ms':>8} {'p99 ms':>8}")
    for figure in (echo, commit, *(Figure(name, s) for name, s in figures.items())):
        print(f"{figure.name:40} {figure.p50:8.2f} {figure.p99:8.2f}")
    print(f"\nfloor = echo + 2 x commit = {floor:.2f} ms")
    for name, samples in figures.items():
        print(f"{name:24} p50 / floor = {statistics.median(samples) / floor:5.2f}x")
    print(
        f"\n{'callers':>8} {'echo/s':>10} {'lease/s':>10} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8}"
    )
    for callers, (rate, figure) in lease_rates.items():
        ratio = rate / echo_rates[callers]
        print(
            f"{callers:8d} {echo_rates[callers]:10.0f} {rate:10.0f} {ratio:6.2f} "
            f"{figure.p50:8.2f} {figure.p99:8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--renewals", type=int, default=640)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="qinglong-bench-") as root,
        dev_stack(Path(root) / "stack") as stack,
    ):
        asyncio.run(measure(stack, args.runs, args.renewals))


if __name__ == "__main__":
    main()
