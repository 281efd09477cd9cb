"""Issue 9 part 5 and the README's "Add a Worker on another machine" (and, with
certificates of seconds, renewal while a Run runs): `qinglong up
--listen-host 127.0.0.2` makes ingress reachable at an address other than the stack's
loopback (Linux routes all of 127/8 to loopback, so 127.0.0.2 stands in for another
machine's view of the stack). An admin creates a Worker; in a directory holding only a copy
of the CA certificate and the join token, `qinglong-worker join` enrolls at the advertised
enrollment address and `qinglong-worker run --identity` runs a task to `succeeded`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.devstack_process import DevStack, admin_cli, dev_stack, operator_cli

QINGLONG_WORKER = Path(sys.executable).with_name("qinglong-worker")
REMOTE_HOST = "127.0.0.2"
PROJECT = "remote-proj"
OPERATOR = "remy"
WORKER_ID = "edge-remote"
STOP_TIMEOUT_SECONDS = 30.0


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def _accepts(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False


def _remote_environment() -> dict[str, str]:
    # Nothing that could point the Worker at the stack's files: what it knows comes from
    # its own directory and its command line.
    return {name: value for name, value in os.environ.items() if not name.startswith("QINGLONG")}


def _worker(machine: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(QINGLONG_WORKER), *args],
        cwd=machine,
        env=_remote_environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@contextlib.contextmanager
def _running_worker(machine: Path, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """`qinglong-worker run --identity` as a real process; stopped with SIGINT, exits 0."""
    command = [str(QINGLONG_WORKER), "run", "--identity", "identity/worker.json"]
    command += ["--inbox", "inbox.db", "--tick-seconds", "0.2", *extra]
    log = machine / "worker.log"
    with log.open("wb") as stream:
        process = subprocess.Popen(
            command,
            cwd=machine,
            env=_remote_environment(),
            stdin=subprocess.DEVNULL,
            stdout=stream,
            stderr=stream,
        )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGINT)
        try:
            status = process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            status = process.wait()
    assert status == 0, log.read_text(errors="replace")


def _another_machine(stack: DevStack, root: Path, join_token: str) -> Path:
    """What an admin hands over to the other machine: the CA certificate and the token."""
    machine = root / "other-machine"
    machine.mkdir()
    shutil.copy(stack.document["ca_cert"], machine / "ca.crt")
    token_file = machine / "join.token"
    token_file.touch(mode=0o600)
    token_file.write_text(join_token)
    return machine


def test_a_worker_on_another_address_joins_and_runs_a_task(tmp_path: Path) -> None:
    with socket.socket() as probe:
        try:
            probe.bind((REMOTE_HOST, 0))
        except OSError as error:
            pytest.fail(f"{REMOTE_HOST} is not a usable loopback address here: {error}")
    data_dir = tmp_path / "stack"
    with dev_stack(data_dir, arguments=["--listen-host", REMOTE_HOST]) as stack:
        ingress, enrollment = stack.ingress_address, stack.enrollment_address
        assert {_host(ingress), _host(enrollment)} == {REMOTE_HOST}
        assert _host(stack.document["control"]["address"]) == "127.0.0.1"  # stays private
        # Bound where advertised, not on loopback besides.
        assert not _accepts("127.0.0.1", int(ingress.rpartition(":")[2]))

        (created,) = admin_cli(stack.stack_path, "admin", "worker", "create", WORKER_ID)
        machine = _another_machine(stack, tmp_path, created["joinToken"])
        joined = _worker(
            machine,
            *("join", "--ingress", ingress, "--enrollment", enrollment, "--ca", "ca.crt"),
            *("--token-file", "join.token", "--dir", "identity"),
        )
        assert joined.returncode == 0, joined.stdout + joined.stderr
        identity = (machine / "identity" / "worker.json").read_text()
        assert json.loads(identity)["ingress_address"] == ingress
        assert str(data_dir) not in identity  # its own files only

        # The README's administration: a project, an operator with a token and a role.
        admin_cli(stack.stack_path, "admin", "project", "create", PROJECT)
        admin_cli(stack.stack_path, "admin", "user", "create", OPERATOR)
        (issued,) = admin_cli(stack.stack_path, "admin", "token", "issue", OPERATOR)
        token_file = tmp_path / "operator.token"
        token_file.write_text(issued["token"])
        token_file.chmod(0o600)
        admin_cli(stack.stack_path, "admin", "role", "grant", PROJECT, OPERATOR, "operator")
        as_operator = ("--project", PROJECT, "--token-file", str(token_file))

        with _running_worker(machine):
            task = json.loads(
                operator_cli(
                    stack.stack_path,
                    *("task", "create", *as_operator, "--name", "remote", "--", "true"),
                )
            )
            run = json.loads(
                operator_cli(
                    stack.stack_path, "run", "trigger", *as_operator, "--task", task["taskId"]
                )
            )
            # `run watch` returns once the Run is terminal; no other Worker runs here.
            timeline = operator_cli(stack.stack_path, "run", "watch", *as_operator, run["runId"])
            events = [json.loads(line) for line in timeline.splitlines()]
            assert events[-1]["type"] == "run.succeeded", timeline
            claims = [event["attemptClaimed"] for event in events if "attemptClaimed" in event]
            assert [claim["workerId"] for claim in claims] == [WORKER_ID]

            fleet = {w["workerId"]: w for w in admin_cli(stack.stack_path, "worker", "list")}
            assert "session" in fleet[WORKER_ID]  # connected now


#: Certificates of about 18 s: the Worker renews each after about 12 s (two thirds).
SHORT_CERTIFICATE_DAYS = "0.0002"
RENEWING_RUN_SECONDS = 20


def test_a_joined_worker_renews_its_certificate_while_a_run_runs(tmp_path: Path) -> None:
    """The Run outlives the certificate it started under: the Worker renews (new key,
    new certificate, worker.json switched) and keeps reporting, and the Run succeeds."""
    environment = {"QINGLONG_CONTROL_WORKER_CERTIFICATE_DAYS": SHORT_CERTIFICATE_DAYS}
    with dev_stack(tmp_path / "stack", environment=environment) as stack:
        (created,) = admin_cli(stack.stack_path, "admin", "worker", "create", WORKER_ID)
        machine = _another_machine(stack, tmp_path, created["joinToken"])
        joined = _worker(
            machine,
            *("join", "--ingress", stack.ingress_address),
            *("--enrollment", stack.enrollment_address, "--ca", "ca.crt"),
            *("--token-file", "join.token", "--dir", "identity"),
        )
        assert joined.returncode == 0, joined.stdout + joined.stderr
        identity = machine / "identity" / "worker.json"
        first = json.loads(identity.read_text())
        with _running_worker(machine, "--certificate-check-seconds", "1"):
            sleeper = ("--name", "sleeper", "--", "sleep", str(RENEWING_RUN_SECONDS))
            task = json.loads(operator_cli(stack.stack_path, "task", "create", *sleeper))
            run = json.loads(
                operator_cli(stack.stack_path, "run", "trigger", "--task", task["taskId"])
            )
            timeline = operator_cli(stack.stack_path, "run", "watch", run["runId"])
            events = [json.loads(line) for line in timeline.splitlines()]
            assert events[-1]["type"] == "run.succeeded", timeline
        last = json.loads(identity.read_text())
        assert last["tls_cert"] != first["tls_cert"], "renewed at least once during the Run"
        superseded = Path(first["tls_key"])  # relative to the Worker's directory, as it ran
        assert not (superseded if superseded.is_absolute() else machine / superseded).exists()
        log = (machine / "worker.log").read_text(errors="replace")
        assert "certificate renewed" in log
        assert created["joinToken"] not in log
