"""The development PKI: names in each certificate, key types and modes, reuse and reissue."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID
from qinglong_cli.pki import (
    DEFAULT_TRUST_DOMAIN,
    DevPki,
    ensure_dev_pki,
    ensure_operator_identity,
    ensure_worker_identity,
)
from qinglong_protocol.tls import TlsFiles


def _cert(files: TlsFiles) -> x509.Certificate:
    return x509.load_pem_x509_certificate(files.cert.read_bytes())


def _sans(files: TlsFiles) -> x509.SubjectAlternativeName:
    return _cert(files).extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def _uris(files: TlsFiles) -> list[str]:
    return _sans(files).get_values_for_type(x509.UniformResourceIdentifier)


def _usages(files: TlsFiles) -> list[x509.ObjectIdentifier]:
    return list(_cert(files).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _all_files(pki: DevPki, *identities: TlsFiles) -> list[Path]:
    leaves = (pki.ingress_server, pki.control_server, pki.ingress_client, *identities)
    return [pki.ca_cert, pki.ca_key, *(p for leaf in leaves for p in (leaf.cert, leaf.key))]


def _contents(paths: list[Path]) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in paths}


@pytest.fixture
def pki(tmp_path: Path) -> DevPki:
    return ensure_dev_pki(tmp_path / "pki")


def test_server_certificates_name_loopback_and_their_service(pki: DevPki) -> None:
    for files, service in ((pki.ingress_server, "ingress"), (pki.control_server, "control")):
        names = _sans(files)
        assert names.get_values_for_type(x509.DNSName) == ["localhost"]
        assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)
        assert _uris(files) == [f"spiffe://{DEFAULT_TRUST_DOMAIN}/service/{service}"]
        # client auth as well: the service probes itself over mTLS with this certificate
        assert _usages(files) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]


def test_server_keys_are_rsa_so_tls12_can_be_refused_by_cipher_suites(pki: DevPki) -> None:
    for files in (pki.ingress_server, pki.control_server):
        key = load_pem_private_key(files.key.read_bytes(), password=None)
        assert isinstance(key, rsa.RSAPrivateKey)
        assert key.key_size >= 2048


def test_client_identities_carry_exactly_one_spiffe_uri(pki: DevPki) -> None:
    worker = ensure_worker_identity(pki, "worker-7")
    operator = ensure_operator_identity(pki, "alice")
    expected = {
        pki.ingress_client: f"spiffe://{DEFAULT_TRUST_DOMAIN}/service/ingress",
        worker: f"spiffe://{DEFAULT_TRUST_DOMAIN}/worker/worker-7",
        operator: f"spiffe://{DEFAULT_TRUST_DOMAIN}/operator/alice",
    }
    for files, uri in expected.items():
        assert list(_sans(files)) == [x509.UniformResourceIdentifier(uri)]
        assert _usages(files) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        key = load_pem_private_key(files.key.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)


def test_every_certificate_is_issued_by_the_ca(pki: DevPki) -> None:
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca
    worker = ensure_worker_identity(pki, "w1")
    for files in (pki.ingress_server, pki.control_server, pki.ingress_client, worker):
        _cert(files).verify_directly_issued_by(ca)  # raises if not
        assert files.ca_cert == pki.ca_cert


def test_keys_are_private_to_the_owner(pki: DevPki) -> None:
    worker = ensure_worker_identity(pki, "w1")
    operator = ensure_operator_identity(pki, "op")
    for path in _all_files(pki, worker, operator):
        if path.suffix == ".key":
            assert _mode(path) == 0o600, path
    assert _mode(pki.directory) == 0o700


def test_second_run_reuses_everything(tmp_path: Path) -> None:
    first = ensure_dev_pki(tmp_path / "pki")
    worker = ensure_worker_identity(first, "w1")
    before = _contents(_all_files(first, worker))

    second = ensure_dev_pki(tmp_path / "pki")
    assert second == first
    assert ensure_worker_identity(second, "w1") == worker
    assert _contents(_all_files(second, worker)) == before


def test_a_missing_key_reissues_only_that_certificate(pki: DevPki) -> None:
    before = _contents(_all_files(pki))
    pki.control_server.key.unlink()

    ensure_dev_pki(pki.directory)

    after = _contents(_all_files(pki))
    changed = {path for path in before if before[path] != after[path]}
    assert changed == {pki.control_server.cert, pki.control_server.key}


def test_a_new_ca_reissues_every_certificate(pki: DevPki) -> None:
    worker = ensure_worker_identity(pki, "w1")
    old_worker_cert = worker.cert.read_bytes()
    pki.ca_key.unlink()

    renewed = ensure_dev_pki(pki.directory)
    ensure_worker_identity(renewed, "w1")

    ca = x509.load_pem_x509_certificate(renewed.ca_cert.read_bytes())
    for files in (renewed.ingress_server, renewed.control_server, renewed.ingress_client, worker):
        _cert(files).verify_directly_issued_by(ca)
    assert worker.cert.read_bytes() != old_worker_cert


def test_another_trust_domain_reissues_the_names(pki: DevPki) -> None:
    renamed = ensure_dev_pki(pki.directory, trust_domain="example.test")
    assert _uris(renamed.ingress_server) == ["spiffe://example.test/service/ingress"]
    assert _uris(ensure_worker_identity(renamed, "w1")) == ["spiffe://example.test/worker/w1"]


def test_a_loosened_key_mode_is_tightened_on_reuse(pki: DevPki) -> None:
    pki.ingress_server.key.chmod(0o644)
    ensure_dev_pki(pki.directory)
    assert _mode(pki.ingress_server.key) == 0o600


@pytest.mark.parametrize("bad", ["", "../escape", "a/b", ".hidden", "x" * 64, "sp ace"])
def test_identity_names_must_be_safe_path_segments(pki: DevPki, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        ensure_worker_identity(pki, bad)
    with pytest.raises(ValueError, match="invalid"):
        ensure_operator_identity(pki, bad)


def test_invalid_trust_domain_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid trust domain"):
        ensure_dev_pki(tmp_path / "pki", trust_domain="Not A Domain/")
