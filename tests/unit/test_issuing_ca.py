"""Control's issuing CA (R-ADM-2): a joining Worker's CSR gives only its public key; the
certificate's identity, usage and lifetime are the CA's to decide. Real keys, a real dev CA."""

from __future__ import annotations

import base64
import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from qinglong_cli.pki import ensure_dev_pki
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.issuing import CSR_FIELD, CertificateAuthorityExpired, IssuingAuthority
from qinglong_protocol.identities import worker_uri

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
WORKER = "edge-07"
URI = worker_uri("qinglong.local", WORKER)


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> IssuingAuthority:
    pki = ensure_dev_pki(tmp_path_factory.mktemp("pki"))
    return IssuingAuthority.load(pki.ca_cert, pki.ca_key)


def csr_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, *names: x509.GeneralName) -> str:
    """A CSR that asks for more than it will get: another name, server use, a CA."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "someone-else")])
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


def test_the_certificate_names_the_worker_whatever_the_csr_asks(
    authority: IssuingAuthority,
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    forged = x509.UniformResourceIdentifier(worker_uri("qinglong.local", "another-worker"))
    requested = authority.requested_key(csr_pem(key, forged))
    issued = authority.issue_worker_certificate(requested, WORKER, URI, NOW)
    certificate = x509.load_pem_x509_certificate(issued.certificate_pem.encode())
    san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [URI]
    assert certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == WORKER
    assert certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    # The Worker's own key, signed by the CA, valid for the CA's lifetime from now.
    assert certificate.public_key() == key.public_key()
    certificate.verify_directly_issued_by(authority.certificate)
    assert certificate.not_valid_after_utc == NOW + authority.lifetime == issued.not_after
    assert certificate.not_valid_before_utc < NOW


def test_two_certificates_have_distinct_serials(authority: IssuingAuthority) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    serials = {
        x509.load_pem_x509_certificate(
            authority.issue_worker_certificate(
                authority.requested_key(csr_pem(key)), WORKER, URI, NOW
            ).certificate_pem.encode()
        ).serial_number
        for _ in range(4)
    }
    assert len(serials) == 4


def _refusal(authority: IssuingAuthority, pem: str) -> Refused:
    with pytest.raises(Refused) as refused:
        authority.requested_key(pem)
    assert (refused.value.reason, refused.value.field) == (Reason.FIELD_INVALID, CSR_FIELD)
    return refused.value


def test_bad_csrs_are_refused_by_field_without_their_content(
    authority: IssuingAuthority,
) -> None:
    good = csr_pem(ec.generate_private_key(ec.SECP256R1()))
    begin, end = "-----BEGIN CERTIFICATE REQUEST-----", "-----END CERTIFICATE REQUEST-----"
    garbage = f"{begin}\nnot base64 at all\n{end}\n"
    # A key the CA must refuse, on purpose.
    weak_rsa = csr_pem(rsa.generate_private_key(public_exponent=65537, key_size=1024))  # noqa: S505
    odd_curve = csr_pem(ec.generate_private_key(ec.SECP256K1()))
    for pem, says in (
        (garbage, "well-formed"),
        (weak_rsa, "RSA key shorter"),
        (odd_curve, "elliptic curve"),
    ):
        refused = _refusal(authority, pem)
        assert says in refused.detail
        assert "not base64" not in refused.detail
    # A CSR whose signature does not match its key: swap the signature bytes' last byte.
    der = bytearray(x509.load_pem_x509_csr(good.encode()).public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM).decode()
    assert "signed" in _refusal(authority, tampered).detail


def test_a_csr_for_an_unknown_key_algorithm_is_refused_not_an_internal_error(
    authority: IssuingAuthority,
) -> None:
    """A well-formed CSR whose key names an algorithm nobody knows: the library raises
    UnsupportedAlgorithm (neither ValueError nor InvalidSignature); anyone reaching the
    enrollment listener may send one, before any token is checked."""
    key = ec.generate_private_key(ec.SECP256R1())
    der = x509.load_pem_x509_csr(csr_pem(key).encode()).public_bytes(serialization.Encoding.DER)
    ec_public_key = bytes.fromhex("2a8648ce3d0201")  # id-ecPublicKey, 1.2.840.10045.2.1
    assert der.count(ec_public_key) == 1
    unknown = der.replace(ec_public_key, bytes.fromhex("2a8648ce3d027f"))  # 1.2.840.10045.2.127
    pem = (
        "-----BEGIN CERTIFICATE REQUEST-----\n"
        + base64.encodebytes(unknown).decode("ascii")
        + "-----END CERTIFICATE REQUEST-----\n"
    )
    assert "key type" in _refusal(authority, pem).detail


def test_the_issuing_key_must_match_its_certificate(tmp_path: Path) -> None:
    pki = ensure_dev_pki(tmp_path / "pki")
    other = ec.generate_private_key(ec.SECP256R1())
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_bytes(
        other.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(ValueError, match="is not the key of"):
        IssuingAuthority.load(pki.ca_cert, wrong_key)


def test_an_expired_ca_is_noticed_before_anything_is_spent(authority: IssuingAuthority) -> None:
    """JoinWorker asks this before consuming the join token: a CA that can sign nothing
    valid must not cost a machine its one-time token."""
    authority.ensure_can_issue(NOW)  # the dev CA is current
    after_expiry = authority.certificate.not_valid_after_utc + dt.timedelta(seconds=1)
    with pytest.raises(CertificateAuthorityExpired):
        authority.ensure_can_issue(after_expiry)
