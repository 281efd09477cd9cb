"""A Worker joins with a one-time token and works (R-ADM-2), through the real listeners.

An admin creates the Worker over AdminService; `qinglong-worker join` runs as a real
process against ingress's enrollment listener (server-authenticated TLS, no client
certificate); the certificate control signs with the dev CA then opens a session on the
public mutual-TLS listener. A used, expired or wrong token is refused the same way and
audited; no token reaches an audit row, the Worker's output or an error.
"""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import psycopg
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client import REGISTRY
from qinglong.admin.v1 import admin_service_pb2, admin_service_pb2_grpc
from qinglong.enrollment.v1 import enrollment_service_pb2, enrollment_service_pb2_grpc
from qinglong.rpc.v1 import execution_pb2
from qinglong.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from qinglong_ingress.routes import ENROLLMENT_ROUTES, ROUTES
from qinglong_protocol.errors import error_reason_of
from qinglong_protocol.identities import worker_uri
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials
from qinglong_worker.client import CallFailed, ClientSettings, WorkerClient
from qinglong_worker.join import new_private_key, signing_request
from qinglong_worker.renewal import CertificateRenewer

from tests.support.calls import failure
from tests.support.lossy_proxy import FaultSchedule, LossyProxy, lose_answers
from tests.support.postgres import MigratedDatabase
from tests.support.stack import Stack, running_stack

JOIN_TIMEOUT_SECONDS = 60


async def create_worker(stack: Stack, worker_id: str) -> str:
    """The join token AdminService.CreateWorker returns (shown once)."""
    async with stack.channel(stack.operator_identity("ops")) as channel:
        created = await admin_service_pb2_grpc.AdminServiceStub(channel).CreateWorker(
            admin_service_pb2.CreateWorkerRequest(
                request_id=f"create-{worker_id}", worker_id=worker_id
            ),
            metadata=(("authorization", f"Bearer {stack.tokens['root']}"),),
        )
    assert created.join_token.startswith("qlj1_")
    return created.join_token


async def issue_join_token(stack: Stack, worker_id: str, request_id: str) -> str:
    """A new join token for an enrolled Worker (AdminService.IssueJoinToken; "" on a retry)."""
    async with stack.channel(stack.operator_identity("ops")) as channel:
        issued = await admin_service_pb2_grpc.AdminServiceStub(channel).IssueJoinToken(
            admin_service_pb2.IssueJoinTokenRequest(request_id=request_id, worker_id=worker_id),
            metadata=(("authorization", f"Bearer {stack.tokens['root']}"),),
        )
    assert issued.worker.worker_id == worker_id
    return issued.join_token


async def run_join(
    stack: Stack, token: str, directory: Path, tmp_path: Path, *, enrollment: str | None = None
) -> Joined:
    """`qinglong-worker join` as a real process (at ``enrollment``, by default the stack's
    enrollment listener). Awaited, not blocked on: the in-process servers it talks to run
    on this very event loop."""
    token_file = tmp_path / f"{directory.name}.token"
    token_file.write_text(token)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "qinglong_worker.main",
        "join",
        "--ingress",
        stack.ingress_address,
        "--enrollment",
        enrollment or stack.enrollment_address,
        "--ca",
        str(stack.pki.ca_cert),
        "--token-file",
        str(token_file),
        "--dir",
        str(directory),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), JOIN_TIMEOUT_SECONDS)
    assert process.returncode is not None
    return Joined(process.returncode, out.decode(), err.decode())


@dataclass(frozen=True)
class Joined:
    returncode: int
    stdout: str
    stderr: str


async def test_a_machine_joins_with_its_token_and_opens_a_session(
    stack: Stack, tmp_path: Path
) -> None:
    token = await create_worker(stack, "edge-07")
    identity_dir = tmp_path / "edge-07"
    joined = await run_join(stack, token, identity_dir, tmp_path)
    assert joined.returncode == 0, joined.stderr
    assert token not in joined.stdout + joined.stderr
    # The key never left the machine and nobody else may read it; the certificate names
    # the Worker the token was for, whatever the CSR said.
    assert stat.S_IMODE((identity_dir / "worker.key").stat().st_mode) == 0o600
    certificate = x509.load_pem_x509_certificate((identity_dir / "worker.crt").read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [
        worker_uri(stack.pki.trust_domain, "edge-07")
    ]
    described = json.loads((identity_dir / "worker.json").read_text())
    assert described["worker_id"] == "edge-07"
    assert described["ingress_address"] == stack.ingress_address  # where it will run
    # The new identity is a Worker on the public listener.
    files = TlsFiles(
        ca_cert=Path(described["tls_ca"]),
        cert=Path(described["tls_cert"]),
        key=Path(described["tls_key"]),
    )
    async with grpc.aio.secure_channel(
        stack.ingress_address, mutual_tls_channel_credentials(files)
    ) as channel:
        session = await worker_service_pb2_grpc.WorkerServiceStub(channel).OpenSession(
            worker_service_pb2.OpenSessionRequest(
                request_id="first",
                worker_id="edge-07",
                executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                max_concurrent_attempts=1,
            )
        )
    assert session.worker_generation >= 1


async def test_a_used_expired_or_wrong_token_is_refused_alike_and_audited(
    stack: Stack, tmp_path: Path
) -> None:
    used = await create_worker(stack, "edge-08")
    expired = await create_worker(stack, "edge-09")
    assert (await run_join(stack, used, tmp_path / "first", tmp_path)).returncode == 0
    # Expire the second token without waiting its minimum TTL out: as the table's owner,
    # past the trigger that otherwise keeps a token's expiry fixed.
    with psycopg.connect(stack.database.urls.migration) as conn:
        conn.execute(
            "ALTER TABLE qinglong.worker_join_tokens"
            " DISABLE TRIGGER worker_join_tokens_enforce_single_use"
        )
        conn.execute(
            "UPDATE qinglong.worker_join_tokens SET expires_at_ms = created_at_ms + 1"
            " WHERE worker_id = 'edge-09'"
        )
        conn.execute(
            "ALTER TABLE qinglong.worker_join_tokens"
            " ENABLE TRIGGER worker_join_tokens_enforce_single_use"
        )
    wrong = "qlj1_" + "A" * 43
    credentials = grpc.ssl_channel_credentials(root_certificates=stack.pki.ca_cert.read_bytes())
    answers = []
    async with grpc.aio.secure_channel(stack.enrollment_address, credentials) as channel:
        enrollment = enrollment_service_pb2_grpc.EnrollmentServiceStub(channel)
        for token in (used, expired, wrong):
            refused = await failure(
                enrollment.JoinWorker(
                    enrollment_service_pb2.JoinWorkerRequest(
                        join_token=token,
                        certificate_signing_request_pem=signing_request(new_private_key()),
                    )
                )
            )
            answers.append((refused.code(), error_reason_of(refused), refused.details()))
            assert token not in (refused.details() or "")
        # The enrollment listener serves enrollment only.
        other = await failure(
            worker_service_pb2_grpc.WorkerServiceStub(channel).OpenSession(
                worker_service_pb2.OpenSessionRequest()
            )
        )
        assert other.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (
        answers
        == [
            (
                grpc.StatusCode.UNAUTHENTICATED,
                "UNAUTHENTICATED_PRINCIPAL",
                "the join token is not valid",
            )
        ]
        * 3
    )
    rows = [r for r in stack.audit_rows() if r["operation"] == "EnrollmentService/JoinWorker"]
    assert len(rows) == 4  # the successful join and the three refused attempts
    assert {r["principal_kind"] for r in rows} == {"anonymous"}
    for token in (used, expired, wrong):
        assert token not in repr(rows)
    # Ingress admitted all four before control could check a token; the listing names
    # the Worker the one that spent a token enrolled, and none for the refused three.
    async with stack.channel(stack.operator_identity("ops")) as channel:
        listed = await admin_service_pb2_grpc.AdminServiceStub(channel).ListAuditRecords(
            admin_service_pb2.ListAuditRecordsRequest(operation="EnrollmentService/JoinWorker"),
            metadata=(("authorization", f"Bearer {stack.tokens['root']}"),),
        )
    assert sorted(record.worker_id for record in listed.records) == ["", "", "", "edge-08"]


async def test_a_worker_rejoins_with_a_new_join_token_and_the_old_one_is_refused(
    stack: Stack, tmp_path: Path
) -> None:
    """The CreateWorker answer was lost (or the token spent by a join whose answer was
    lost): a cluster admin issues the Worker a new token through ingress; the first one no
    longer joins, the new one does, and a retry of the issue shows no token. The call is
    audited with the Worker it named, and no token is in any audit row."""
    first = await create_worker(stack, "edge-12")
    second = await issue_join_token(stack, "edge-12", "rejoin-1")
    assert second.startswith("qlj1_")
    assert second != first
    assert await issue_join_token(stack, "edge-12", "rejoin-1") == ""  # a retry
    refused = await run_join(stack, first, tmp_path / "old", tmp_path)
    assert refused.returncode == 1
    assert "UNAUTHENTICATED" in refused.stderr
    assert list((tmp_path / "old").iterdir()) == [], "a refused join leaves no key behind"
    assert not (tmp_path / "old" / "worker.json").exists()
    joined = await run_join(stack, second, tmp_path / "edge-12", tmp_path)
    assert joined.returncode == 0, joined.stderr
    described = json.loads((tmp_path / "edge-12" / "worker.json").read_text())
    assert described["worker_id"] == "edge-12"
    # Spent: a third token re-enrolls it once more (a certificate that expired offline).
    third = await issue_join_token(stack, "edge-12", "rejoin-2")
    assert (await run_join(stack, third, tmp_path / "again", tmp_path)).returncode == 0
    rows = [r for r in stack.audit_rows() if r["operation"] == "AdminService/IssueJoinToken"]
    assert len(rows) == 3
    assert {r["worker_id"] for r in rows} == {"edge-12"}
    for token in (first, second, third):
        assert token not in repr(stack.audit_rows())


def not_audited() -> float:
    labels = {"reason": "RATE_LIMITED"}
    return REGISTRY.get_sample_value("qinglong_ingress_refusals_not_audited_total", labels) or 0.0


async def test_a_peer_over_the_rate_limit_writes_one_audit_row_a_minute(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The enrollment listener takes calls from anyone: 30 guesses from one host at 3 a
    minute are 3 refusals of the token and 27 of the rate — of which only the first is an
    audit row (the rest are counted), so the limit also bounds what anyone can make
    ingress write."""
    before = not_audited()
    async with running_stack(
        database_pg18, tmp_path_factory.mktemp("pki"), enrollment_per_peer_per_minute=3
    ) as limited:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=limited.pki.ca_cert.read_bytes()
        )
        guess = enrollment_service_pb2.JoinWorkerRequest(
            join_token="qlj1_" + "A" * 43,
            certificate_signing_request_pem=signing_request(new_private_key()),
        )
        async with grpc.aio.secure_channel(limited.enrollment_address, credentials) as channel:
            enrollment = enrollment_service_pb2_grpc.EnrollmentServiceStub(channel)
            codes = Counter(
                [(await failure(enrollment.JoinWorker(guess))).code() for _ in range(30)]
            )
        rows = [r for r in limited.audit_rows() if r["operation"] == "EnrollmentService/JoinWorker"]
    assert codes == {grpc.StatusCode.UNAUTHENTICATED: 3, grpc.StatusCode.RESOURCE_EXHAUSTED: 27}
    # The three admitted (then refused by control, which alone can check a token) and the
    # first rate-limited one.
    assert Counter(r["reason"] for r in rows) == {None: 3, "RATE_LIMITED": 1}
    assert not_audited() - before == 26


async def test_a_join_whose_answer_was_lost_is_answered_again_for_its_key(
    stack: Stack, tmp_path: Path
) -> None:
    """The answer is lost after control spent the token (a real proxy drops it): `join`
    exits 3 and keeps its key; the same command again is answered for that key; the token
    stays spent for any other key."""
    token = await create_worker(stack, "edge-14")
    directory = tmp_path / "edge-14"
    schedule = FaultSchedule([lose_answers("JoinWorker", 1)])
    with LossyProxy(
        upstream_address=stack.enrollment_address,
        upstream_identity=None,  # a joining machine has no certificate yet
        server_identity=stack.pki.ingress_server,
        allowed_peer_uri=None,
        schedule=schedule,
    ) as proxy:
        lost = await run_join(stack, token, directory, tmp_path, enrollment=proxy.address)
        assert lost.returncode == 3, lost.stderr
        assert "run the same command again" in lost.stderr
        key = (directory / "worker.key").read_bytes()
        retried = await run_join(stack, token, directory, tmp_path, enrollment=proxy.address)
        answers_lost = schedule.faults["JoinWorker"]
    assert retried.returncode == 0, retried.stderr
    assert (directory / "worker.key").read_bytes() == key
    certificate = x509.load_pem_x509_certificate((directory / "worker.crt").read_bytes())
    private = serialization.load_pem_private_key(key, password=None)
    assert certificate.public_key() == private.public_key()
    other = await run_join(stack, token, tmp_path / "other", tmp_path)
    assert other.returncode == 1, other.stderr
    assert not (tmp_path / "other" / "worker.key").exists()
    # A key left by another identity (its worker.json moved aside to join anew, or a disk
    # image copied with one) is never presented for a new token: only a pending join's.
    (directory / "worker.json").rename(directory / "worker.json.old")
    rejoined = await run_join(
        stack, await issue_join_token(stack, "edge-14", "rejoin"), directory, tmp_path
    )
    assert rejoined.returncode == 0, rejoined.stderr
    assert (directory / "worker.key").read_bytes() != key
    print(
        f"\njoin: answers lost {answers_lost}, retry answered {retried.returncode == 0},"
        f" another key answered {other.returncode == 0}"
    )
    assert answers_lost == 1


async def test_a_bad_csr_spends_no_token(stack: Stack, tmp_path: Path) -> None:
    token = await create_worker(stack, "edge-10")
    credentials = grpc.ssl_channel_credentials(root_certificates=stack.pki.ca_cert.read_bytes())
    async with grpc.aio.secure_channel(stack.enrollment_address, credentials) as channel:
        refused = await failure(
            enrollment_service_pb2_grpc.EnrollmentServiceStub(channel).JoinWorker(
                enrollment_service_pb2.JoinWorkerRequest(
                    join_token=token,
                    certificate_signing_request_pem="-----BEGIN CERTIFICATE REQUEST-----\n"
                    + "A" * 64
                    + "\n-----END CERTIFICATE REQUEST-----\n",
                )
            )
        )
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The token is still good for a real request.
    assert (await run_join(stack, token, tmp_path / "edge-10", tmp_path)).returncode == 0


async def test_control_signs_only_its_own_name_for_a_worker(stack: Stack, tmp_path: Path) -> None:
    """The CA also signs the services' certificates: the name it gives a Worker is this
    deployment's URI for it, whatever the identity table says. The table cannot name a
    service for a Worker (migration 0025), and a Worker enrolled under another trust
    domain's URI is refused, its token spent, no certificate issued."""
    token = await create_worker(stack, "edge-12")
    with psycopg.connect(stack.database.urls.migration, autocommit=True) as conn:
        for stolen in ("spiffe://qinglong.local/service/ingress", "spiffe://x/worker/edge-13"):
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(
                    "UPDATE qinglong.worker_identities SET certificate_uri = %s"
                    " WHERE worker_id = 'edge-12'",
                    (stolen,),
                )
        conn.execute(
            "UPDATE qinglong.worker_identities SET certificate_uri = %s"
            " WHERE worker_id = 'edge-12'",
            (worker_uri("elsewhere.example", "edge-12"),),
        )
    joined = await run_join(stack, token, tmp_path / "edge-12", tmp_path)
    assert joined.returncode != 0
    assert "UNAUTHENTICATED" in joined.stderr, joined.stderr
    assert not (tmp_path / "edge-12" / "worker.json").exists()


def test_the_public_listener_does_not_serve_enrollment() -> None:
    assert {r.service for r in ROUTES}.isdisjoint({r.service for r in ENROLLMENT_ROUTES})
    assert [r.name for r in ENROLLMENT_ROUTES] == ["JoinWorker"]


async def test_a_joined_worker_renews_its_certificate_and_keeps_working(
    stack: Stack, tmp_path: Path
) -> None:
    """Two thirds into its lifetime the Worker makes a new key, gets a successor over its
    present mTLS channel, switches worker.json in one rename and its channel to the new
    identity; the old key is gone. A disabled Worker cannot renew."""
    token = await create_worker(stack, "edge-11")
    identity_dir = tmp_path / "edge-11"
    assert (await run_join(stack, token, identity_dir, tmp_path)).returncode == 0
    identity_file = identity_dir / "worker.json"
    before = on_disk(identity_file)
    start, end = before.certificate.not_valid_before_utc, before.certificate.not_valid_after_utc
    client = WorkerClient(ClientSettings(stack.ingress_address, before.files))
    try:
        early = CertificateRenewer(client, identity_file, "edge-11", clock=lambda: start)
        assert not await early.renew_if_due()
        later = start + (end - start) * 0.7
        renewer = CertificateRenewer(client, identity_file, "edge-11", clock=lambda: later)
        assert await renewer.renew_if_due()
        after = on_disk(identity_file)
        assert after.certificate.serial_number != before.certificate.serial_number
        assert after.certificate.public_key() != before.certificate.public_key()
        assert after.certificate.subject == before.certificate.subject
        assert after.key_mode == 0o600
        assert not before.files.key.exists(), "the superseded key is removed"
        # The client now presents the new certificate, and the Worker still works.
        session = await client.open_session(
            worker_service_pb2.OpenSessionRequest(
                request_id="after-renewal",
                worker_id="edge-11",
                executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                max_concurrent_attempts=1,
            )
        )
        assert session.worker_generation >= 1
        # Disabled: the next renewal is refused (at ingress already: no active identity).
        async with stack.channel(stack.operator_identity("ops")) as channel:
            await admin_service_pb2_grpc.AdminServiceStub(channel).DisableWorker(
                admin_service_pb2.DisableWorkerRequest(worker_id="edge-11"),
                metadata=(("authorization", f"Bearer {stack.tokens['root']}"),),
            )
        with pytest.raises(CallFailed) as refused:
            await client.renew_certificate(
                worker_service_pb2.RenewCertificateRequest(
                    worker_id="edge-11",
                    certificate_signing_request_pem=signing_request(new_private_key()),
                )
            )
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await client.close()


@dataclass(frozen=True)
class OnDisk:
    files: TlsFiles
    certificate: x509.Certificate
    key_mode: int


def on_disk(identity_file: Path) -> OnDisk:
    """What worker.json names now: its files, its certificate and its key's mode."""
    identity = json.loads(identity_file.read_text())
    files = TlsFiles(
        ca_cert=Path(identity["tls_ca"]),
        cert=Path(identity["tls_cert"]),
        key=Path(identity["tls_key"]),
    )
    certificate = x509.load_pem_x509_certificate(files.cert.read_bytes())
    return OnDisk(files, certificate, stat.S_IMODE(files.key.stat().st_mode))


async def test_a_join_at_the_wrong_listener_says_so_leaves_nothing_and_may_be_retried(
    stack: Stack, tmp_path: Path
) -> None:
    """The public listener asks for a client certificate a joining machine does not have:
    the join cannot even connect. It exits 3 (try again) and names the flag; it leaves
    only its key (an unanswered join cannot tell a call that never arrived from an answer
    that was lost, so the retry presents the same key), and the token is unspent: the same
    join at the enrollment listener then works, with that key."""
    token = await create_worker(stack, "edge-09")
    directory = tmp_path / "edge-09"
    wrong = await run_join(stack, token, directory, tmp_path, enrollment=stack.ingress_address)
    assert wrong.returncode == 3, wrong.stderr
    assert "--enrollment" in wrong.stderr
    assert sorted(path.name for path in directory.iterdir()) == ["join.pending", "worker.key"]
    key = (directory / "worker.key").read_bytes()
    joined = await run_join(stack, token, directory, tmp_path)
    assert joined.returncode == 0, joined.stderr
    assert (directory / "worker.key").read_bytes() == key
    assert not (directory / "join.pending").exists()
