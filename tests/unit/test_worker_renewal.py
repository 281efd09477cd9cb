"""Certificate renewal's failure paths (the success path runs against the real stack in
tests/integration/test_worker_join.py and tests/e2e/test_remote_worker.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol.tls import TlsFiles
from qinglong_worker.client import CallFailed
from qinglong_worker.join import join, new_private_key, private_key_pem
from qinglong_worker.renewal import CertificateRenewer

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


class Unreachable:
    """A client whose every renewal fails like a control plane that cannot be reached."""

    def __init__(self) -> None:
        self.attempts = 0
        self.tried_thrice = asyncio.Event()

    async def renew_certificate(
        self, request: ws.RenewCertificateRequest, *, budget_seconds: float | None = None
    ) -> ws.RenewCertificateResponse:
        self.attempts += 1
        if self.attempts >= 3:
            self.tried_thrice.set()
        raise CallFailed("RenewCertificate", grpc.StatusCode.UNAVAILABLE, None)

    async def use_identity(self, tls: TlsFiles, grace_seconds: float = 30.0) -> None:
        raise AssertionError("no identity to switch to")


def certificate_pem(key: Any, not_before: dt.datetime, not_after: dt.datetime) -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edge-1")])
    built = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .sign(key, hashes.SHA256())
    )
    return built.public_bytes(serialization.Encoding.PEM)


def identity_due_now(directory: Path) -> Path:
    """A self-signed certificate of which NOW is well past two thirds of the lifetime."""
    key = new_private_key()
    certificate = certificate_pem(key, NOW - dt.timedelta(days=6), NOW + dt.timedelta(days=1))
    (directory / "worker.key").write_bytes(private_key_pem(key))
    (directory / "worker.crt").write_bytes(certificate)
    (directory / "ca.crt").write_bytes(certificate)
    identity = directory / "worker.json"
    identity.write_text(
        json.dumps(
            {
                "worker_id": "edge-1",
                "ingress_address": "127.0.0.1:1",
                "tls_ca": str(directory / "ca.crt"),
                "tls_cert": str(directory / "worker.crt"),
                "tls_key": str(directory / "worker.key"),
            }
        )
    )
    return identity


async def test_a_failed_renewal_is_retried_and_changes_nothing(tmp_path: Path) -> None:
    identity = identity_due_now(tmp_path)
    before = identity.read_text()
    client = Unreachable()
    renewer = CertificateRenewer(client, identity, "edge-1", clock=lambda: NOW)
    stop = asyncio.Event()
    task = asyncio.create_task(renewer.run(stop, check_seconds=0.01))
    await asyncio.wait_for(client.tried_thrice.wait(), 60)
    assert not task.done(), "a failed renewal must not end the renewal loop"
    stop.set()
    await task  # ends cleanly, raising nothing into the daemon's shutdown
    assert client.attempts >= 3
    assert identity.read_text() == before  # the present identity stays in use
    assert names_in(tmp_path) == [
        "ca.crt",
        "worker.crt",
        "worker.json",
        "worker.key",
    ]


class SwitchFails:
    """Control answers, but the switch to the new identity fails (an unexpected error,
    not a CallFailed): worker.json must keep naming the certificate still in use."""

    def __init__(self, certificate_pem: str) -> None:
        self.certificate_pem = certificate_pem
        self.attempts = 0
        self.tried_twice = asyncio.Event()

    async def renew_certificate(
        self, request: ws.RenewCertificateRequest, *, budget_seconds: float | None = None
    ) -> ws.RenewCertificateResponse:
        self.attempts += 1
        if self.attempts >= 2:
            self.tried_twice.set()
        answer = ws.RenewCertificateResponse(
            certificate_pem=self.certificate_pem, ca_certificates_pem=self.certificate_pem
        )
        answer.expire_time.FromDatetime(NOW + dt.timedelta(days=7))
        return answer

    async def use_identity(self, tls: TlsFiles, grace_seconds: float = 30.0) -> None:
        raise RuntimeError("the channel could not be switched")


async def test_a_switch_that_failed_leaves_the_old_identity_and_is_retried(
    tmp_path: Path,
) -> None:
    identity = identity_due_now(tmp_path)
    before = identity.read_text()
    client = SwitchFails((tmp_path / "worker.crt").read_text())
    renewer = CertificateRenewer(client, identity, "edge-1", clock=lambda: NOW)
    stop = asyncio.Event()
    task = asyncio.create_task(renewer.run(stop, check_seconds=0.01))
    await asyncio.wait_for(client.tried_twice.wait(), 60)
    assert not task.done(), "an unexpected failure must not end the renewal loop"
    stop.set()
    await task
    assert client.attempts >= 2, "worker.json still names the due certificate: renewed again"
    assert identity.read_text() == before
    # Each attempt's new key and certificate went with it: only the identity in use is left.
    assert names_in(tmp_path) == ["ca.crt", "worker.crt", "worker.json", "worker.key"]


class SwitchNeverEnds(SwitchFails):
    """The daemon stops while the client is switching channels."""

    def __init__(self, certificate_pem: str) -> None:
        super().__init__(certificate_pem)
        self.switching = asyncio.Event()

    async def use_identity(self, tls: TlsFiles, grace_seconds: float = 30.0) -> None:
        self.switching.set()
        await asyncio.Event().wait()


async def test_a_renewal_cancelled_at_shutdown_leaves_no_unused_key(tmp_path: Path) -> None:
    identity = identity_due_now(tmp_path)
    before = identity.read_text()
    client = SwitchNeverEnds((tmp_path / "worker.crt").read_text())
    renewer = CertificateRenewer(client, identity, "edge-1", clock=lambda: NOW)
    task = asyncio.create_task(renewer.run(asyncio.Event(), check_seconds=0.01))
    await asyncio.wait_for(client.switching.wait(), 60)
    assert "worker-1.key" in names_in(tmp_path)  # written, not yet named
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert identity.read_text() == before
    assert names_in(tmp_path) == ["ca.crt", "worker.crt", "worker.json", "worker.key"]


def names_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_joining_again_never_touches_a_working_identity(tmp_path: Path) -> None:
    identity = identity_due_now(tmp_path)
    key_before = (tmp_path / "worker.key").read_bytes()
    with pytest.raises(FileExistsError):
        join("127.0.0.1:1", b"", "qlj1_" + "A" * 43, tmp_path, enrollment_address="127.0.0.1:2")
    assert (tmp_path / "worker.key").read_bytes() == key_before
    assert identity.exists()


async def test_a_renewal_whose_files_cannot_all_be_written_leaves_no_key(
    tmp_path: Path,
) -> None:
    """The new key and certificate are written, the CA bundle cannot be (a real failure
    of the file system: its path is a directory now, which no file replaces — root or
    not): the unnamed key and certificate go, the identity in use stays."""
    identity = identity_due_now(tmp_path)
    before = identity.read_text()
    ca_bundle = tmp_path / "ca.crt"
    ca_bundle.unlink()
    ca_bundle.mkdir()
    client = SwitchFails((tmp_path / "worker.crt").read_text())
    renewer = CertificateRenewer(client, identity, "edge-1", clock=lambda: NOW)
    with pytest.raises(IsADirectoryError):
        await renewer.renew_if_due()
    assert identity.read_text() == before
    assert names_in(tmp_path) == ["ca.crt", "worker.crt", "worker.json", "worker.key"]
    assert list(ca_bundle.iterdir()) == []  # nor a temporary file left in its place


def test_a_start_removes_the_keys_a_crash_in_a_renewal_left(tmp_path: Path) -> None:
    """What kill -9 leaves at each point of a renewal: a new key and certificate never
    named (between steps 1 and 3), half a key in its temporary file (during step 1), and
    the superseded identity (after step 3). The next start removes them, and nothing
    else: the identity worker.json names, the CA, unrelated files."""
    identity = identity_due_now(tmp_path)
    unnamed = ["worker-1.key", "worker-1.crt", ".worker-2.key.4242.tmp"]
    for name in unnamed:
        (tmp_path / name).write_bytes(b"-----BEGIN PRIVATE KEY-----\n")
    kept = ["notes.key", "worker-x.key", "worker-3.json", ".other.4242.tmp"]
    for name in kept:
        (tmp_path / name).write_bytes(b"not ours\n")
    renewer = CertificateRenewer(Unreachable(), identity, "edge-1", clock=lambda: NOW)
    removed = renewer.sweep_unnamed()
    assert sorted(p.name for p in removed) == sorted(unnamed)
    assert names_in(tmp_path) == sorted(
        ["ca.crt", "worker.crt", "worker.json", "worker.key", *kept]
    )

    # After step 3 of an earlier renewal: worker.json names generation 4, and the joined
    # files it superseded are still there.
    (tmp_path / "worker-4.key").write_bytes((tmp_path / "worker.key").read_bytes())
    (tmp_path / "worker-4.crt").write_bytes((tmp_path / "worker.crt").read_bytes())
    named = json.loads(identity.read_text())
    named.update(tls_key=str(tmp_path / "worker-4.key"), tls_cert=str(tmp_path / "worker-4.crt"))
    identity.write_text(json.dumps(named))
    assert sorted(p.name for p in renewer.sweep_unnamed()) == ["worker.crt", "worker.key"]
    assert names_in(tmp_path) == sorted(
        ["ca.crt", "worker-4.crt", "worker-4.key", "worker.json", *kept]
    )


async def test_the_renewal_loop_sweeps_before_its_first_check(tmp_path: Path) -> None:
    identity = identity_due_now(tmp_path)
    (tmp_path / "worker-7.key").write_bytes(b"-----BEGIN PRIVATE KEY-----\n")
    client = Unreachable()
    renewer = CertificateRenewer(client, identity, "edge-1", clock=lambda: NOW)
    stop = asyncio.Event()
    task = asyncio.create_task(renewer.run(stop, check_seconds=0.01))
    await asyncio.wait_for(client.tried_thrice.wait(), 60)
    stop.set()
    await task
    assert names_in(tmp_path) == ["ca.crt", "worker.crt", "worker.json", "worker.key"]


def test_the_sweep_keeps_the_named_identity_however_its_paths_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon is started with a relative --identity while worker.json names absolute
    paths (as join writes them), and the other way round: the files in use stay."""
    identity_due_now(tmp_path)
    (tmp_path / "worker-2.key").write_bytes(b"-----BEGIN PRIVATE KEY-----\n")
    monkeypatch.chdir(tmp_path.parent)
    relative = Path(tmp_path.name) / "worker.json"
    renewer = CertificateRenewer(Unreachable(), relative, "edge-1", clock=lambda: NOW)
    assert [p.name for p in renewer.sweep_unnamed()] == ["worker-2.key"]
    assert names_in(tmp_path) == ["ca.crt", "worker.crt", "worker.json", "worker.key"]

    named = json.loads((tmp_path / "worker.json").read_text())
    named.update(
        tls_key=str(Path(tmp_path.name) / "worker.key"),
        tls_cert=str(Path(tmp_path.name) / "worker.crt"),
    )
    (tmp_path / "worker.json").write_text(json.dumps(named))
    absolute = CertificateRenewer(Unreachable(), tmp_path / "worker.json", "edge-1")
    assert absolute.sweep_unnamed() == []
    assert names_in(tmp_path) == ["ca.crt", "worker.crt", "worker.json", "worker.key"]


class Switching(Unreachable):
    """Records the identities the renewer switched the client to."""

    def __init__(self) -> None:
        super().__init__()
        self.switched: list[TlsFiles] = []

    async def use_identity(self, tls: TlsFiles, grace_seconds: float = 30.0) -> None:
        self.switched.append(tls)


async def test_a_renewal_cut_short_is_finished_at_the_next_start(tmp_path: Path) -> None:
    """Killed after step 1, down until the named certificate expired: the new pair it had
    written is named and used at the next start, not removed (which would make the Worker
    join again); a newer but broken pair (its key is another) is not."""
    identity = identity_due_now(tmp_path)
    expired = certificate_pem(
        new_private_key(), NOW - dt.timedelta(days=9), NOW - dt.timedelta(days=2)
    )
    (tmp_path / "worker.crt").write_bytes(expired)
    renewed_key = new_private_key()
    (tmp_path / "worker-1.key").write_bytes(private_key_pem(renewed_key))
    (tmp_path / "worker-1.crt").write_bytes(
        certificate_pem(renewed_key, NOW - dt.timedelta(days=3), NOW + dt.timedelta(days=4))
    )
    (tmp_path / "worker-2.key").write_bytes(private_key_pem(new_private_key()))
    (tmp_path / "worker-2.crt").write_bytes(
        certificate_pem(renewed_key, NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=6))
    )
    client = Switching()
    renewer = CertificateRenewer(client, identity, "edge-1", clock=lambda: NOW)
    stop = asyncio.Event()
    stop.set()  # only what a start does: finish or clear what a crash left
    await renewer.run(stop, check_seconds=60)
    named = json.loads(identity.read_text())
    assert Path(named["tls_key"]).name == "worker-1.key"
    assert Path(named["tls_cert"]).name == "worker-1.crt"
    assert [tls.cert.name for tls in client.switched] == ["worker-1.crt"]
    assert names_in(tmp_path) == ["ca.crt", "worker-1.crt", "worker-1.key", "worker.json"]


async def test_a_newer_pair_valid_for_less_time_is_not_adopted(tmp_path: Path) -> None:
    identity = identity_due_now(tmp_path)  # valid until NOW + 1 day
    before = identity.read_text()
    key = new_private_key()
    (tmp_path / "worker-1.key").write_bytes(private_key_pem(key))
    (tmp_path / "worker-1.crt").write_bytes(
        certificate_pem(key, NOW - dt.timedelta(days=8), NOW + dt.timedelta(hours=1))
    )
    client = Switching()
    assert (
        CertificateRenewer(client, identity, "edge-1", clock=lambda: NOW).adopt_interrupted()
        is None
    )
    assert identity.read_text() == before
    assert client.switched == []


class Renews(SwitchFails):
    """Control answers, and the switch works."""

    async def use_identity(self, tls: TlsFiles, grace_seconds: float = 30.0) -> None:
        self.used = tls


async def test_a_renewal_from_a_relative_identity_path_names_absolute_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--identity worker.json` run from its directory: the renewed worker.json must name
    files a Worker started from any other directory (systemd's `/`) still finds."""
    identity_due_now(tmp_path)
    monkeypatch.chdir(tmp_path)
    key = new_private_key()
    client = Renews(certificate_pem(key, NOW, NOW + dt.timedelta(days=7)).decode())
    renewer = CertificateRenewer(client, Path("worker.json"), "edge-1", clock=lambda: NOW)
    assert await renewer.renew_if_due()
    renewed = json.loads((tmp_path / "worker.json").read_text())
    named = [Path(renewed[name]) for name in ("tls_key", "tls_cert", "tls_ca")]
    assert all(path.is_absolute() for path in named), named
    assert {path.parent for path in named} == {tmp_path}
    assert {path.name for path in named} <= set(os.listdir(tmp_path))
