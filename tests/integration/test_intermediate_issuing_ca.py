"""A Worker certificate issued by an intermediate CA works against a server that trusts
the root (R-ADM-2; deploy/k8s/README.md, "A dedicated intermediate CA for Workers").

Found by review: control answered a join with the leaf alone and named the intermediate
as the CA to trust, and the Worker replaced the CA it was given with it. TLS verifiers
build a path to a trust anchor from what the peer presents, and the root is what ingress
(and the Worker) trust: the Worker could reach nobody. Here, with real keys and a real
mutual-TLS gRPC server on loopback: control's issuing authority loaded from an
intermediate and the root's file presents the chain with every certificate it issues and
names the root to trust; a Worker using exactly those files is served, and the same leaf
without its chain is refused.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from qinglong_control.issuing import IssuingAuthority
from qinglong_protocol.identities import worker_uri
from qinglong_protocol.tls import TlsFiles, mutual_tls_server_credentials
from qinglong_worker.join import new_private_key, private_key_pem, signing_request, trust_bundle

NOW = dt.datetime.now(dt.UTC)
WORKER = "edge-inter"


def _pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool,
    server_name: str | None = None,
    days: int = 30,
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, signer = (name, key) if issuer is None else (issuer[0].subject, issuer[1])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(hours=1))
        .not_valid_after(NOW + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server_name is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(server_name)]), critical=False
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return builder.sign(signer, hashes.SHA256())


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A root; an intermediate it signs (the Workers' issuing CA); a server certificate the
    root signs (ingress's); each written as a deployment mounts it."""
    root_key, inter_key, server_key = (ec.generate_private_key(ec.SECP256R1()) for _ in "abc")
    root = _certificate("root", root_key, None, ca=True)
    inter = _certificate("workers", inter_key, (root, root_key), ca=True)
    server = _certificate(
        "ingress", server_key, (root, root_key), ca=False, server_name="localhost"
    )
    files = {
        "root": _pem(root),
        "intermediate": _pem(inter),  # cert-manager's tls.crt of an intermediate CA
        "intermediate.key": private_key_pem(inter_key),
        "server": _pem(server),
        "server.key": private_key_pem(server_key),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return {name: tmp_path / name for name in files}


@pytest.fixture
async def served(pki: dict[str, Path]) -> AsyncIterator[str]:
    """A mutual-TLS server that trusts the root alone, as ingress does; its address."""
    server = grpc.aio.server()

    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(echo)}
            ),
        )
    )
    files = TlsFiles(pki["root"], pki["server"], pki["server.key"])
    port = server.add_secure_port("127.0.0.1:0", mutual_tls_server_credentials(files))
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def _call(address: str, trusted: bytes, key: bytes, chain: bytes) -> grpc.StatusCode:
    credentials = grpc.ssl_channel_credentials(trusted, key, chain)
    options = [("grpc.ssl_target_name_override", "localhost")]
    async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
        try:
            await channel.unary_unary("/test.Echo/Call")(b"hello", timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_a_worker_issued_by_an_intermediate_is_served_by_a_server_trusting_the_root(
    pki: dict[str, Path], served: str
) -> None:
    authority = IssuingAuthority.load(
        pki["intermediate"], pki["intermediate.key"], trust_path=pki["root"]
    )
    worker_key = new_private_key()
    issued = authority.issue_worker_certificate(
        authority.requested_key(signing_request(worker_key)),
        WORKER,
        worker_uri("qinglong.local", WORKER),
        NOW,
    )
    leaf, *chain = x509.load_pem_x509_certificates(issued.certificate_pem.encode())
    assert [c.subject for c in chain] == [authority.certificate.subject]
    leaf.verify_directly_issued_by(chain[0])
    assert authority.ca_certificates_pem.encode() == pki["root"].read_bytes()

    # What `join` writes: the certificate as answered; the CA it was given and the roots.
    trusted = trust_bundle(pki["root"].read_text(), authority.ca_certificates_pem)
    assert trusted.encode() == pki["root"].read_bytes()  # one root, once
    key = private_key_pem(worker_key)
    code = await _call(served, trusted.encode(), key, issued.certificate_pem.encode())
    assert code == grpc.StatusCode.OK
    # The leaf alone (what was answered before) is refused by the same server.
    alone = leaf.public_bytes(serialization.Encoding.PEM)
    assert await _call(served, trusted.encode(), key, alone) == grpc.StatusCode.UNAVAILABLE


def test_an_intermediate_without_its_root_is_refused_at_start(pki: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="ends in no root"):
        IssuingAuthority.load(pki["intermediate"], pki["intermediate.key"])
    # A bundle that ends in its root needs no trust file.
    bundle = pki["intermediate"].with_name("bundle")
    bundle.write_bytes(pki["intermediate"].read_bytes() + pki["root"].read_bytes())
    authority = IssuingAuthority.load(bundle, pki["intermediate.key"])
    assert authority.ca_certificates_pem.encode() == pki["root"].read_bytes()
    assert [c.subject for c in authority.chain] == [authority.certificate.subject]


def test_a_bundle_or_trust_file_that_does_not_chain_is_refused_at_start(
    pki: dict[str, Path], tmp_path: Path
) -> None:
    """An unrelated root in the bundle, or a trust file whose root did not sign the
    intermediate: Workers would trust a root that verifies nothing of theirs."""
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = tmp_path / "other-root"
    other.write_bytes(_pem(_certificate("other", other_key, None, ca=True)))
    unrelated = tmp_path / "unrelated-bundle"
    unrelated.write_bytes(pki["intermediate"].read_bytes() + other.read_bytes())
    with pytest.raises(ValueError, match="no root given issued"):
        IssuingAuthority.load(unrelated, pki["intermediate.key"])
    with pytest.raises(ValueError, match="no root given issued"):
        IssuingAuthority.load(pki["intermediate"], pki["intermediate.key"], trust_path=other)


def test_a_certificate_outlives_no_certificate_of_its_path(tmp_path: Path) -> None:
    """A root that expires before its intermediate ends the Worker's certificate too:
    past it, the certificate verifies nowhere."""
    root_key, inter_key = (ec.generate_private_key(ec.SECP256R1()) for _ in "ab")
    root = _certificate("short root", root_key, None, ca=True, days=10)
    inter = _certificate("workers", inter_key, (root, root_key), ca=True, days=30)
    (tmp_path / "bundle").write_bytes(_pem(inter) + _pem(root))
    (tmp_path / "key").write_bytes(private_key_pem(inter_key))
    authority = IssuingAuthority.load(
        tmp_path / "bundle", tmp_path / "key", lifetime=dt.timedelta(days=20)
    )
    issued = authority.issue_worker_certificate(
        authority.requested_key(signing_request(new_private_key())),
        WORKER,
        worker_uri("qinglong.local", WORKER),
        NOW,
    )
    assert issued.not_after == root.not_valid_after_utc < inter.not_valid_after_utc


def test_a_trust_bundle_keeps_each_certificate_once_in_order(pki: dict[str, Path]) -> None:
    root, inter = pki["root"].read_text(), pki["intermediate"].read_text()
    assert trust_bundle(root, inter + root, inter) == root + inter
