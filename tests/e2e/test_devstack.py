"""`qinglong up` as a real process tree: embedded PostgreSQL, control and ingress subprocesses,
health over mutual TLS, the database credentials each service needs and no other, the first
cluster admin's token, and a clean stop on SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from qinglong_cli.dev_enrollment import DEV_PROJECT_ID
from qinglong_cli.devstack import DEFAULT_OPERATOR_NAME
from qinglong_control.db.roles import ADMIN_ROLE, RUNTIME_ROLE
from qinglong_control.settings import ENV_ADMIN_DATABASE_URL as CONTROL_ADMIN_DATABASE_URL
from qinglong_control.settings import ENV_DATABASE_URL as CONTROL_DATABASE_URL
from qinglong_ingress.settings import ENV_DATABASE_URL as INGRESS_DATABASE_URL

from tests.support.devstack_process import admin_cli, dev_stack, operator_cli

QINGLONG = Path(sys.executable).with_name("qinglong")
QINGLONG_WORKER = Path(sys.executable).with_name("qinglong-worker")
START_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 60.0


def _start_up(
    data_dir: Path, extra_environment: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(QINGLONG), "up", "--data-dir", str(data_dir)],
        env={**os.environ, **(extra_environment or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_stack(process: subprocess.Popen[str], stack_path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if stack_path.exists():
            document: dict[str, Any] = json.loads(stack_path.read_text())
            return document
        if process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"qinglong up exited with {process.returncode}:\n{out}\n{err}")
        time.sleep(0.1)
    process.kill()
    pytest.fail("qinglong up wrote no stack.json in time")


def _health(stack_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(QINGLONG), "health", "--stack", str(stack_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (entry.decode(errors="replace").partition("=") for entry in raw if entry)
    return {name: value for name, _, value in pairs}


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie waiting for its reaper counts as exited."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout_seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _stop(process: subprocess.Popen[str]) -> tuple[str, str]:
    process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def _admin_token(stack: dict[str, Any], stack_path: Path) -> str:
    """The first cluster admin's token: in a 0600 file that the stack file only names."""
    token_file = Path(stack["admin"]["token_file"])
    assert token_file.stat().st_mode & 0o077 == 0
    token = token_file.read_text().strip()
    assert token.startswith("qlo1_")
    assert token not in stack_path.read_text()
    return token


def _probe(service: str, stack: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(Path(sys.executable).with_name(f"qinglong-{service}")),
            "probe",
            "--address",
            stack[service]["address"],
            "--tls-ca",
            stack["ca_cert"],
            "--tls-cert",
            stack["operator"]["cert"],
            "--tls-key",
            stack["operator"]["key"],
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def _service_pids(stack: dict[str, Any]) -> dict[str, int]:
    return {
        "control": stack["control"]["pid"],
        "ingress": stack["ingress"]["pid"],
        "postgres": stack["postgres"]["pid"],
    }


def test_up_health_and_stop(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    stack_path = data_dir / "stack.json"
    # Credentials in the caller's environment must not be passed on to either service.
    inherited = {CONTROL_DATABASE_URL: "host=/nowhere user=inherited", "PGPASSWORD": "inherited"}
    process = _start_up(data_dir, inherited)
    try:
        stack = _wait_for_stack(process, stack_path)

        checked = _health(stack_path)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.count("SERVING") == 2
        assert "NOT_SERVING" not in checked.stdout

        pids = _service_pids(stack)
        assert all(isinstance(pid, int) and _alive(pid) for pid in pids.values()), pids
        assert stack["postgres"]["version"] == 18
        # One replica of each: `replicas` lists exactly the single-endpoint entries, and
        # without --standby the services get one database host.
        assert stack["replicas"]["count"] == 1
        assert stack["replicas"]["ingress"] == [stack["ingress"]]
        assert stack["replicas"]["control"] == [stack["control"]]
        # Workers join at ingress's enrollment listener, on loopback like the rest by default.
        assert stack["ingress"]["enrollment"]["address"].startswith("127.0.0.1:")
        assert "enrollment" not in stack["control"]
        assert stack["postgres"]["standby"] is None
        assert len(stack["postgres"]["hosts"]) == 1
        assert Path(stack["ca_cert"]).is_file()
        assert Path(stack["worker"]["cert"]).is_file()
        assert Path(stack["worker"]["key"]).is_file()
        assert stack["worker"]["worker_id"]
        assert Path(stack["operator"]["cert"]).is_file()

        # The operator token lives in a 0600 file; the stack file only names it.
        token_file = Path(stack["operator"]["token_file"])
        assert token_file.stat().st_mode & 0o077 == 0
        token = token_file.read_text().strip()
        assert token.startswith("qlo1_")
        assert token not in stack_path.read_text()
        admin_token = _admin_token(stack, stack_path)

        # The Worker's own command line reaches ingress with the Worker's identity.
        worker_check = subprocess.run(
            [str(QINGLONG_WORKER), "check", "--stack", str(stack_path)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert worker_check.returncode == 0, worker_check.stdout + worker_check.stderr
        assert "SERVING" in worker_check.stdout

        # The operator CLI through ingress: create, trigger, cancel, and watch the
        # control plane's convergence end the queued Run (nobody is pulling work).
        created = operator_cli(stack_path, "task", "create", "--name", "e2e", "--", "echo", "hi")
        task_id = json.loads(created)["taskId"]
        run = json.loads(operator_cli(stack_path, "run", "trigger", "--task", task_id))
        assert run["state"] == "RUN_STATE_QUEUED"
        assert run["runId"] in operator_cli(stack_path, "run", "list")
        cancel = json.loads(operator_cli(stack_path, "run", "cancel", run["runId"]))
        assert cancel["outcome"] == "CANCEL_RUN_OUTCOME_ACCEPTED"
        timeline = operator_cli(stack_path, "run", "watch", run["runId"])
        types = [json.loads(line)["type"] for line in timeline.splitlines()]
        assert types == ["run.queued", "run.cancel_requested", "run.cancelled"]
        assert token not in created + timeline

        # The admin's commands with the token `up` bootstrapped: a project, and the fleet.
        (project,) = admin_cli(stack_path, "admin", "project", "create", "e2e-admin")
        assert project["state"] == "RESOURCE_STATE_ACTIVE"
        fleet = admin_cli(stack_path, "worker", "list")
        assert stack["worker"]["worker_id"] in [worker["workerId"] for worker in fleet]

        # The Kubernetes probe command of each service (mTLS; kubelet's gRPC probe can't).
        for service in ("control", "ingress"):
            probed = _probe(service, stack)
            assert probed.returncode == 0, probed.stdout + probed.stderr
            assert probed.stdout.strip().endswith("SERVING")

        # SPEC R-ROLE-2: the runtime credential reaches control only.
        control_env = _environment(pids["control"])
        ingress_env = _environment(pids["ingress"])
        runtime_url = control_env[CONTROL_DATABASE_URL]
        assert RUNTIME_ROLE in runtime_url
        assert ADMIN_ROLE in control_env[CONTROL_ADMIN_DATABASE_URL]
        assert INGRESS_DATABASE_URL not in control_env
        assert RUNTIME_ROLE not in ingress_env[INGRESS_DATABASE_URL]
        assert CONTROL_DATABASE_URL not in ingress_env
        for role in (RUNTIME_ROLE, ADMIN_ROLE):
            assert not [name for name, value in ingress_env.items() if role in value]
        for environment in (control_env, ingress_env):
            assert "PGPASSWORD" not in environment
            assert "inherited" not in environment.get(CONTROL_DATABASE_URL, "")
        for pid in (pids["control"], pids["ingress"]):
            command_line = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"DATABASE" not in command_line.upper()
            assert b"dbname" not in command_line
    except BaseException:
        process.kill()
        raise

    stale_copy = tmp_path / "stale-stack.json"
    stale_copy.write_text(stack_path.read_text())
    out, err = _stop(process)
    assert process.returncode == 0, out + err
    for name, pid in pids.items():
        assert _wait_gone(pid), f"{name} (pid {pid}) still running after stop"
    assert not stack_path.exists()

    after_stop = _health(stale_copy)
    assert after_stop.returncode != 0
    assert "NOT_SERVING" in after_stop.stdout
    assert _probe("control", stack).returncode == 1
    assert admin_token not in out + err


def test_second_up_reuses_pki_database_and_admin_token(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    stack_path = data_dir / "stack.json"
    pki_files = [
        data_dir / "pki" / name
        for name in ("ca.crt", "ca.key", "ingress-server.key", "control-server.key")
    ]
    cluster_marker = data_dir / "postgres" / "PG_VERSION"

    first = _start_up(data_dir)
    try:
        admin_token = _admin_token(_wait_for_stack(first, stack_path), stack_path)
        # An administrator revokes the dev operator's role: the next `up` leaves it so.
        (operator,) = [
            user
            for user in admin_cli(stack_path, "admin", "user", "list", "--all")
            if user["name"] == DEFAULT_OPERATOR_NAME
        ]
        admin_cli(stack_path, "admin", "role", "revoke", DEV_PROJECT_ID, operator["principalId"])
    except BaseException:
        first.kill()
        raise
    pki_before = {path: path.read_bytes() for path in pki_files}
    cluster_created = cluster_marker.stat().st_mtime_ns
    out, err = _stop(first)
    assert first.returncode == 0, out + err

    second = _start_up(data_dir)
    try:
        stack = _wait_for_stack(second, stack_path)
        assert _health(stack_path).returncode == 0
        # Bootstrap found its cluster admin and issued nothing: the first token still works.
        assert _admin_token(stack, stack_path) == admin_token
        assert admin_cli(stack_path, "admin", "project", "list", "--all")
        bindings = admin_cli(stack_path, "admin", "role", "list", DEV_PROJECT_ID)
        (kept,) = [b for b in bindings if b["principalId"] == operator["principalId"]]
        assert kept["state"] == "RESOURCE_STATE_DISABLED"
    finally:
        out, err = _stop(second)
    assert second.returncode == 0, out + err
    assert {path: path.read_bytes() for path in pki_files} == pki_before
    assert cluster_marker.stat().st_mtime_ns == cluster_created
    for pid in _service_pids(stack).values():
        assert _wait_gone(pid)


def test_cli_with_explicit_settings_and_no_stack_file(tmp_path: Path) -> None:
    """What the operator of a deployed cluster does: no stack file to read, the address,
    CA, client certificate, token file and project from flags or the environment."""
    with dev_stack(tmp_path / "stack") as stack:
        document = stack.document
        # A directory without `.qinglong/stack.json`, and no QINGLONG_* from the caller:
        # had the CLI fallen back to a stack file, it would have found none.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        clean = {k: v for k, v in os.environ.items() if not k.startswith("QINGLONG_")}

        def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [str(QINGLONG), *args],
                cwd=elsewhere,
                env={**clean, **(env or {})},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )

        operator = document["operator"]
        flags = [
            "--address", document["ingress"]["address"],
            "--ca-cert", document["ca_cert"],
            "--cert", operator["cert"],
            "--key", operator["key"],
        ]  # fmt: skip
        as_operator = [*flags, "--token-file", operator["token_file"]]
        as_operator += ["--project", document["project_id"]]
        created = cli("task", "create", *as_operator, "--name", "explicit", "--", "echo", "hi")
        assert created.returncode == 0, created.stdout + created.stderr
        task_id = json.loads(created.stdout)["taskId"]
        listed = cli("task", "list", *as_operator)
        assert listed.returncode == 0, listed.stderr
        assert task_id in [json.loads(line)["taskId"] for line in listed.stdout.splitlines()]

        # The same through the environment alone, as a cluster admin.
        environment = {
            "QINGLONG_ADDRESS": document["ingress"]["address"],
            "QINGLONG_CA_CERT": document["ca_cert"],
            "QINGLONG_CERT": operator["cert"],
            "QINGLONG_KEY": operator["key"],
            "QINGLONG_ADMIN_TOKEN_FILE": document["admin"]["token_file"],
        }
        fleet = cli("worker", "list", env=environment)
        assert fleet.returncode == 0, fleet.stderr
        workers = [json.loads(line)["workerId"] for line in fleet.stdout.splitlines()]
        assert stack.worker_id in workers
        token = Path(document["admin"]["token_file"]).read_text().strip()
        assert token not in fleet.stdout + fleet.stderr

        # Half the settings: refused before any call, naming what is missing.
        partial = cli("worker", "list", "--address", document["ingress"]["address"])
        assert (partial.returncode, partial.stdout) == (2, "")
        assert "but not the CA certificate (--ca-cert or $QINGLONG_CA_CERT)" in partial.stderr
