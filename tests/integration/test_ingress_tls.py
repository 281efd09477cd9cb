"""Ingress transport security on real sockets: TLS 1.3 only, client certificates of our CA only.

grpc reads ``GRPC_SSL_CIPHER_SUITES`` once per process, while ``import grpc`` runs, so every
server here is a subprocess of its own (a small script that builds the real
`qinglong_ingress.server.create_server` with the development PKI):

- ``restricted`` calls `apply_tls12_cipher_restriction()` before importing grpc, as ingress does;
- ``unrestricted`` leaves grpc's default suites (the control experiment);
- ``late`` sets the same value only after ``import grpc`` (it has no effect: the reason the
  restriction refuses to run once grpc is imported).

Each script also serves a test-only echo method that answers with what the server read from
the call's ``auth_context()``, so the negotiated version is the server's view, not the client's.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from qinglong_cli.pki import DevPki, ensure_dev_pki, ensure_worker_identity, worker_uri
from qinglong_ingress.transport_security import (
    CIPHER_SUITES_VARIABLE,
    RESTRICTED_CIPHER_SUITES,
    TLS_VERSION_REQUIRED,
    TransportSecurityError,
    apply_tls12_cipher_restriction,
    check_cipher_suites,
    is_acceptable_transport,
    negotiated_tls_version,
)
from qinglong_protocol.tls import AUTH_KEY_TLS_VERSION, TlsFiles, mutual_tls_channel_credentials

WORKER_ID = "worker-tls"
ECHO_METHOD = "/qinglong.test.TransportEcho/Echo"
START_TIMEOUT_SECONDS = 20.0
TIMEOUT = 5.0
OPENSSL = shutil.which("openssl")

# grpc's built-in default for the variable (grpcio 1.85, src/core/config/config_vars.yaml).
GRPC_DEFAULT_CIPHER_SUITES = (
    "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256:"
    "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:"
    "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-RSA-AES256-GCM-SHA384"
)

SERVER_SCRIPT = """
import asyncio
import json
import os
import sys
from pathlib import Path

from qinglong_ingress.transport_security import (
    CIPHER_SUITES_VARIABLE,
    RESTRICTED_CIPHER_SUITES,
    apply_tls12_cipher_restriction,
    is_acceptable_transport,
    negotiated_tls_version,
)

mode, config_path, ready_path = sys.argv[1:4]
if mode == "restricted":
    apply_tls12_cipher_restriction()

import grpc  # deliberately after the restriction

if mode == "late":
    os.environ[CIPHER_SUITES_VARIABLE] = RESTRICTED_CIPHER_SUITES

from grpc_health.v1 import health_pb2, health_pb2_grpc
from qinglong_ingress.server import create_server
from qinglong_ingress.settings import ControlChannelSettings, IngressSettings
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials, peer_uris


async def echo(request, context):
    auth = context.auth_context()
    return json.dumps(
        {
            "tls_version": negotiated_tls_version(auth),
            "acceptable": is_acceptable_transport(auth),
            "peer_uris": list(peer_uris(auth)),
        }
    ).encode()


async def serve(config):
    def files(who):
        return TlsFiles(Path(config["ca"]), Path(config[who + "_cert"]), Path(config[who + "_key"]))

    settings = IngressSettings(
        listen_address="127.0.0.1:0",
        tls=files("server"),
        # Required by the settings type; nothing here dials control.
        control=ControlChannelSettings(address="127.0.0.1:9", tls=files("client")),
    )
    server, port = await create_server(settings)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "qinglong.test.TransportEcho", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
            )
        ]
    )
    await server.start()
    # This process as a client (as ingress is towards control) still reaches an RSA server.
    credentials = mutual_tls_channel_credentials(files("client"))
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    ready = {
        "port": port,
        "cipher_suites": os.environ.get(CIPHER_SUITES_VARIABLE),
        "self_dial": health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status),
    }
    temporary = Path(ready_path + ".tmp")
    temporary.write_text(json.dumps(ready))
    temporary.replace(ready_path)
    await server.wait_for_termination()


asyncio.run(serve(json.loads(Path(config_path).read_text())))
"""


@dataclass(frozen=True)
class Material:
    pki: DevPki
    worker: TlsFiles
    worker_uri: str
    # Same shape as `worker`, minted here: a twin proves the minting itself is sound.
    minted_valid: TlsFiles
    expired: TlsFiles
    foreign_ca: TlsFiles


@dataclass(frozen=True)
class ServerProcess:
    port: int
    ready: Mapping[str, Any]
    stderr: Path

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")


# --- material ---------------------------------------------------------------------------------


def _write_identity(
    directory: Path, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, ca: Path
) -> TlsFiles:
    files = TlsFiles(ca_cert=ca, cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files.key.chmod(0o600)
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return files


def _client_certificate(
    uri: str,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A worker client certificate shaped like qinglong_cli.pki's, with chosen dates."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, WORKER_ID)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
        .sign(issuer_key, hashes.SHA256())
    )
    return key, cert


def _foreign_authority(name: x509.Name) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A CA with the development CA's very name but a key of its own."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> Material:
    pki = ensure_dev_pki(tmp_path_factory.mktemp("pki"))
    uri = worker_uri(pki.trust_domain, WORKER_ID)
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    strangers = tmp_path_factory.mktemp("strangers")
    now = dt.datetime.now(dt.UTC)

    valid = _client_certificate(
        uri, ca_cert.subject, ca_key, now - dt.timedelta(minutes=5), now + dt.timedelta(days=1)
    )
    expired = _client_certificate(
        uri, ca_cert.subject, ca_key, now - dt.timedelta(days=2), now - dt.timedelta(days=1)
    )
    foreign_key, foreign_ca = _foreign_authority(ca_cert.subject)
    foreign = _client_certificate(
        uri,
        foreign_ca.subject,
        foreign_key,
        now - dt.timedelta(minutes=5),
        now + dt.timedelta(days=1),
    )
    return Material(
        pki=pki,
        worker=ensure_worker_identity(pki, WORKER_ID),
        worker_uri=uri,
        minted_valid=_write_identity(strangers, "minted-valid", *valid, pki.ca_cert),
        expired=_write_identity(strangers, "expired", *expired, pki.ca_cert),
        foreign_ca=_write_identity(strangers, "foreign", *foreign, pki.ca_cert),
    )


# --- server subprocesses ----------------------------------------------------------------------


@contextmanager
def _server_process(mode: str, material: Material, directory: Path) -> Iterator[ServerProcess]:
    pki = material.pki
    script = directory / "tls_server.py"
    script.write_text(SERVER_SCRIPT)
    config = directory / "config.json"
    config.write_text(
        json.dumps(
            {
                "ca": str(pki.ca_cert),
                "server_cert": str(pki.ingress_server.cert),
                "server_key": str(pki.ingress_server.key),
                "client_cert": str(pki.ingress_client.cert),
                "client_key": str(pki.ingress_client.key),
            }
        )
    )
    ready_path = directory / "ready.json"
    stderr_path = directory / "stderr.log"
    environment = {k: v for k, v in os.environ.items() if k != CIPHER_SUITES_VARIABLE}
    # The handshake failure line ("NO_SHARED_CIPHER") is an INFO log of grpc core.
    environment["GRPC_VERBOSITY"] = "INFO"
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(script), mode, str(config), str(ready_path)],
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not ready_path.exists():
            if process.poll() is not None:
                pytest.fail(
                    f"{mode} server exited {process.returncode}:\n{stderr_path.read_text()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"{mode} server not ready in time:\n{stderr_path.read_text()}")
            time.sleep(0.05)
        ready: dict[str, Any] = json.loads(ready_path.read_text())
        yield ServerProcess(port=ready["port"], ready=ready, stderr=stderr_path)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def restricted(
    material: Material, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with _server_process("restricted", material, tmp_path_factory.mktemp("restricted")) as server:
        yield server


@pytest.fixture(scope="module")
def unrestricted(
    material: Material, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with _server_process("unrestricted", material, tmp_path_factory.mktemp("plain")) as server:
        yield server


@pytest.fixture(scope="module")
def late(material: Material, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with _server_process("late", material, tmp_path_factory.mktemp("late")) as server:
        yield server


# --- raw TLS clients --------------------------------------------------------------------------


def _ssl_context(client: TlsFiles, maximum: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(client.ca_cert)
    context.load_cert_chain(client.cert, client.key)
    context.set_alpn_protocols(["h2"])
    if maximum is not None:
        context.maximum_version = maximum
    return context


@contextmanager
def _tls_connection(port: int, context: ssl.SSLContext) -> Iterator[ssl.SSLSocket]:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        yield tls


def _openssl_s_client(port: int, version_flag: str, client: TlsFiles) -> tuple[int, str]:
    assert OPENSSL is not None
    # stdin at EOF: s_client handshakes, prints the session and exits.
    completed = subprocess.run(
        [
            OPENSSL,
            "s_client",
            version_flag,
            "-connect",
            f"127.0.0.1:{port}",
            "-servername",
            "localhost",
            "-CAfile",
            str(client.ca_cert),
            "-cert",
            str(client.cert),
            "-key",
            str(client.key),
            "-alpn",
            "h2",
            "-verify_return_error",
        ],
        input="",
        capture_output=True,
        # After the handshake the server's HTTP/2 SETTINGS frame is echoed as raw bytes.
        encoding="utf-8",
        errors="replace",
        timeout=TIMEOUT * 2,
        check=False,
    )
    return completed.returncode, completed.stdout + completed.stderr


def _wait_for_log(server: ServerProcess, needle: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while needle not in server.log():
        if time.monotonic() > deadline:
            pytest.fail(f"server never logged {needle!r}:\n{server.log()}")
        time.sleep(0.05)


# A gRPC call by hand over an already negotiated TLS socket (HTTP/2 prior knowledge via ALPN).
# grpcio's client cannot be capped at TLS 1.2, so this is how a TLS 1.2 call reaches the server.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    # Literal header field without indexing, new name, no Huffman; short strings only.
    assert len(name) < 127
    assert len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _read_exactly(tls: ssl.SSLSocket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = tls.recv(size - len(data))
        if not chunk:
            raise ConnectionError("server closed the connection")
        data += chunk
    return data


def _raw_grpc_unary(tls: ssl.SSLSocket, method: str, request: bytes = b"") -> bytes:
    headers = b"".join(
        _hpack_literal(name, value)
        for name, value in (
            (b":method", b"POST"),
            (b":scheme", b"https"),
            (b":path", method.encode()),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
    )
    message = b"\x00" + len(request).to_bytes(4, "big") + request
    tls.sendall(
        _PREFACE
        + _frame(_SETTINGS, 0, 0)
        + _frame(_HEADERS, _END_HEADERS, 1, headers)
        + _frame(_DATA, _END_STREAM, 1, message)
    )
    body = b""
    while True:
        head = _read_exactly(tls, 9)
        kind, flags = head[3], head[4]
        stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        payload = _read_exactly(tls, int.from_bytes(head[:3], "big"))
        if kind == _SETTINGS and not flags & _ACK:
            tls.sendall(_frame(_SETTINGS, _ACK, 0))
        elif kind == _PING and not flags & _ACK:
            tls.sendall(_frame(_PING, _ACK, 0, payload))
        elif kind == _GOAWAY or (kind == _RST_STREAM and stream == 1):
            raise ConnectionError(f"server ended the call (frame type {kind})")
        elif kind == _DATA and stream == 1:
            body += payload
        if stream == 1 and kind in (_DATA, _HEADERS) and flags & _END_STREAM:
            break
    assert len(body) >= 5, f"no gRPC message in {body!r}"
    assert body[0] == 0, f"compressed gRPC message in {body!r}"
    return body[5 : 5 + int.from_bytes(body[1:5], "big")]


# --- gRPC clients -----------------------------------------------------------------------------


async def _health(port: int, client: TlsFiles) -> str:
    credentials = mutual_tls_channel_credentials(client)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT
        )
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    return name


async def _echo(port: int, client: TlsFiles) -> dict[str, Any]:
    credentials = mutual_tls_channel_credentials(client)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(ECHO_METHOD)
        answer: dict[str, Any] = json.loads(await call(b"", timeout=TIMEOUT))
    return answer


# --- the restriction itself -------------------------------------------------------------------


def test_the_module_imports_no_grpc() -> None:
    probe = "import sys, qinglong_ingress.transport_security; print('grpc' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=30
    )
    assert loaded.stdout.strip() == "False"


def test_the_restriction_refuses_to_run_once_grpc_is_imported() -> None:
    assert "grpc" in sys.modules  # this test process imported it at the top
    environ: dict[str, str] = {}
    with pytest.raises(TransportSecurityError, match="before grpc is imported"):
        apply_tls12_cipher_restriction(environ)
    assert environ == {}


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(GRPC_DEFAULT_CIPHER_SUITES, id="grpc-default"),
        "ECDHE-RSA-AES128-GCM-SHA256",
        "ECDHE-ECDSA-AES128-GCM-SHA256:AES128-GCM-SHA256",
        "ECDHE-ECDSA-AES128-GCM-SHA256,ECDHE-RSA-CHACHA20-POLY1305",
        "ECDHE-ECDSA-AES128-SHA",
        "HIGH",
        "HIGH+ECDSA",
        "ALL:!RSA",
        "[ECDHE-ECDSA-AES128-GCM-SHA256|ECDHE-RSA-AES128-GCM-SHA256]",
        "TLS_AES_128_GCM_SHA256",
        pytest.param("", id="empty"),
    ],
)
def test_an_operator_value_that_is_not_ecdsa_only_is_refused(value: str) -> None:
    environ = {CIPHER_SUITES_VARIABLE: value}
    with pytest.raises(TransportSecurityError, match=CIPHER_SUITES_VARIABLE):
        apply_tls12_cipher_restriction(environ)
    assert environ == {CIPHER_SUITES_VARIABLE: value}


@pytest.mark.parametrize(
    "value",
    [
        RESTRICTED_CIPHER_SUITES,
        "ECDHE-ECDSA-AES256-GCM-SHA384",
        "TLS_AES_128_GCM_SHA256:ECDHE-ECDSA-CHACHA20-POLY1305",
    ],
)
def test_an_ecdsa_only_operator_value_passes_the_check(value: str) -> None:
    check_cipher_suites(value)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        (None, RESTRICTED_CIPHER_SUITES),
        ("ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-ECDSA-AES256-GCM-SHA384"),
    ],
)
def test_before_grpc_the_restriction_sets_or_keeps_the_variable(
    preset: str | None, expected: str
) -> None:
    probe = (
        "import os, sys\n"
        "from qinglong_ingress.transport_security import apply_tls12_cipher_restriction\n"
        "returned = apply_tls12_cipher_restriction()\n"
        f"print(returned == os.environ[{CIPHER_SUITES_VARIABLE!r}] and returned)\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != CIPHER_SUITES_VARIABLE}
    if preset is not None:
        environment[CIPHER_SUITES_VARIABLE] = preset
    completed = subprocess.run(
        [sys.executable, "-c", probe],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert completed.stdout.strip() == expected


def test_the_negotiated_version_is_read_from_the_auth_context() -> None:
    assert AUTH_KEY_TLS_VERSION == "ssl_tls_version"
    tls13 = {AUTH_KEY_TLS_VERSION: [b"TLSv1.3"], "peer_uri": [b"spiffe://x/worker/a"]}
    assert negotiated_tls_version(tls13) == TLS_VERSION_REQUIRED == "TLSv1.3"
    assert is_acceptable_transport(tls13)
    refused_contexts: list[dict[str, list[bytes]]] = [
        {AUTH_KEY_TLS_VERSION: [b"TLSv1.2"]},
        {AUTH_KEY_TLS_VERSION: [b"TLSv1.3", b"TLSv1.2"]},
        {AUTH_KEY_TLS_VERSION: []},
        {},
    ]
    for refused in refused_contexts:
        assert not is_acceptable_transport(refused), refused


# --- handshakes -------------------------------------------------------------------------------


def test_a_tls12_handshake_fails_against_the_restricted_server(
    restricted: ServerProcess, material: Material
) -> None:
    assert restricted.ready["cipher_suites"] == RESTRICTED_CIPHER_SUITES
    context = _ssl_context(material.worker, maximum=ssl.TLSVersion.TLSv1_2)
    with pytest.raises(ssl.SSLError), _tls_connection(restricted.port, context):
        pass
    # The server's own account: it found no suite it could use with its RSA key.
    _wait_for_log(restricted, "NO_SHARED_CIPHER")
    if OPENSSL is not None:
        returncode, output = _openssl_s_client(restricted.port, "-tls1_2", material.worker)
        assert returncode != 0, output
        assert "Cipher is (NONE)" in output, output


def test_a_tls13_handshake_completes_against_the_restricted_server(
    restricted: ServerProcess, material: Material
) -> None:
    with _tls_connection(restricted.port, _ssl_context(material.worker)) as tls:
        assert tls.version() == "TLSv1.3"
        assert tls.selected_alpn_protocol() == "h2"
        assert json.loads(_raw_grpc_unary(tls, ECHO_METHOD))["tls_version"] == "TLSv1.3"
    if OPENSSL is not None:
        returncode, output = _openssl_s_client(restricted.port, "-tls1_3", material.worker)
        assert returncode == 0, output
        assert "New, TLSv1.3" in output, output
        assert "ALPN protocol: h2" in output, output


def test_without_the_restriction_tls12_completes_and_the_server_sees_it(
    unrestricted: ServerProcess, material: Material
) -> None:
    # The control experiment: the same server, certificate and client, grpc's default suites.
    assert unrestricted.ready["cipher_suites"] is None
    context = _ssl_context(material.worker, maximum=ssl.TLSVersion.TLSv1_2)
    with _tls_connection(unrestricted.port, context) as tls:
        assert tls.version() == "TLSv1.2"
        cipher = tls.cipher()
        assert cipher is not None
        assert cipher[0].startswith("ECDHE-RSA-"), cipher
        assert tls.selected_alpn_protocol() == "h2"
        seen = json.loads(_raw_grpc_unary(tls, ECHO_METHOD))
    # What the per-call check sees on such a connection: ingress must refuse the call.
    assert seen == {
        "tls_version": "TLSv1.2",
        "acceptable": False,
        "peer_uris": [material.worker_uri],
    }
    if OPENSSL is not None:
        returncode, output = _openssl_s_client(unrestricted.port, "-tls1_2", material.worker)
        assert returncode == 0, output
        assert "New, TLSv1.2" in output, output


def test_the_variable_set_after_import_grpc_has_no_effect(
    late: ServerProcess, material: Material
) -> None:
    # Set before create_server, before any credentials: still too late.
    assert late.ready["cipher_suites"] == RESTRICTED_CIPHER_SUITES
    context = _ssl_context(material.worker, maximum=ssl.TLSVersion.TLSv1_2)
    with _tls_connection(late.port, context) as tls:
        assert tls.version() == "TLSv1.2"


# --- gRPC over the restricted server ----------------------------------------------------------


async def test_a_worker_certificate_is_served_over_tls13(
    restricted: ServerProcess, material: Material
) -> None:
    assert await _health(restricted.port, material.worker) == "SERVING"
    assert await _echo(restricted.port, material.worker) == {
        "tls_version": "TLSv1.3",
        "acceptable": True,
        "peer_uris": [material.worker_uri],
    }
    # The minted twin of the rejected certificates below is accepted: only what differs counts.
    assert await _health(restricted.port, material.minted_valid) == "SERVING"


def test_the_restricted_process_still_dials_an_rsa_server(restricted: ServerProcess) -> None:
    # The restriction is process-wide; ingress's own channel (to control) must keep working.
    assert restricted.ready["self_dial"] == "SERVING"


async def test_a_client_without_certificate_is_refused(
    restricted: ServerProcess, material: Material
) -> None:
    credentials = grpc.ssl_channel_credentials(material.pki.ca_cert.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{restricted.port}", credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("which", ["foreign_ca", "expired"])
async def test_a_certificate_the_ca_does_not_vouch_for_is_refused(
    restricted: ServerProcess, material: Material, which: str
) -> None:
    client: TlsFiles = getattr(material, which)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _health(restricted.port, client)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
