"""The issuing CA that turns a joining Worker's CSR into its client certificate (R-ADM-2).

Only control holds the issuing key (ingress never sees it; docs/decisions/0002): the dev
stack points control at its development CA, Kubernetes mounts a Secret. A certificate
takes nothing but the public key from the CSR: its subject and its one SAN URI come from
the Worker the join token was issued for, so a CSR cannot ask for another identity, a
server certificate or a CA. Certificates are short-lived (default seven days) and the
Worker renews them; its private key never leaves its machine.

The issuing CA may be a root (the dev stack's) or an intermediate (a dedicated Worker CA
under the cluster's root, deploy/k8s/README.md). A Worker presents its certificate with
the intermediates that chain it to a root — TLS verifiers build a path to a trust anchor
from what the peer sends, and the root alone is what ingress trusts — and trusts the
root(s) itself. So the issuing certificate file is a bundle: the issuing certificate
first, then any certificates above it; what is not self-signed in it travels with every
issued certificate, and the roots are the bundle's self-signed certificates, or a trust
file of their own (cert-manager's ``ca.crt`` beside an intermediate's ``tls.crt``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from qinglong_control.domain.refusals import Reason, Refused

DEFAULT_WORKER_CERTIFICATE_LIFETIME: Final = dt.timedelta(days=7)
#: Clocks of the Worker's machine may run a little behind control's.
_BACKDATE: Final = dt.timedelta(minutes=5)
_MIN_RSA_BITS: Final = 2048
_ACCEPTED_CURVES: Final = (ec.SECP256R1, ec.SECP384R1)
CSR_FIELD: Final = "certificate_signing_request_pem"

_IssuingKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey
#: The key types a Worker's certificate may carry.
WorkerKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey


@dataclass(frozen=True)
class IssuedCertificate:
    certificate_pem: str
    not_after: dt.datetime

    @property
    def not_after_ms(self) -> int:
        return int(self.not_after.timestamp() * 1000)


class CertificateAuthorityExpired(RuntimeError):
    """The issuing CA's certificate has expired: replace it (docs, deploy/k8s)."""


@dataclass(frozen=True)
class IssuingAuthority:
    certificate: x509.Certificate
    key: _IssuingKey
    lifetime: dt.timedelta = DEFAULT_WORKER_CERTIFICATE_LIFETIME
    #: The CA certificates an issued certificate is presented with (the issuing one when
    #: it is an intermediate, and those above it up to a root; none for a root).
    chain: tuple[x509.Certificate, ...] = ()
    #: The roots a Worker trusts (they verify ingress, and the chain above); by default
    #: the issuing certificate, a root.
    roots: tuple[x509.Certificate, ...] = ()

    @classmethod
    def load(
        cls,
        certificate_path: Path,
        key_path: Path,
        lifetime: dt.timedelta = DEFAULT_WORKER_CERTIFICATE_LIFETIME,
        trust_path: Path | None = None,
    ) -> IssuingAuthority:
        """``certificate_path``: the issuing certificate, then any certificates above it
        (PEM); ``trust_path``: the roots, when the bundle does not end in one."""
        bundle = x509.load_pem_x509_certificates(certificate_path.read_bytes())
        certificate = bundle[0]
        chain = () if _self_signed(certificate) else tuple(c for c in bundle if not _self_signed(c))
        candidates = (
            tuple(x509.load_pem_x509_certificates(trust_path.read_bytes()))
            if trust_path is not None
            else tuple(c for c in bundle if _self_signed(c))
        )
        if not candidates:
            raise ValueError(
                f"{certificate_path} is an intermediate CA and ends in no root: append the"
                " root certificate to it, or name the roots' file (--issuing-ca-trust)"
            )
        roots = (certificate,) if not chain else _roots_of(certificate_path, chain, candidates)
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, _IssuingKey):
            raise ValueError(f"{key_path}: unsupported issuing key type {type(key).__name__}")
        if key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) != certificate.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ):
            raise ValueError(f"{key_path} is not the key of {certificate_path}")
        return cls(certificate, key, lifetime, chain, roots)

    @property
    def ca_certificates_pem(self) -> str:
        """What a Worker trusts: the roots (the issuing certificate itself when it is one)."""
        return _pem(self.roots or (self.certificate,))

    def ensure_can_issue(self, now: dt.datetime) -> None:
        """Raise (a fault of the deployment, answered INTERNAL and logged) when this CA can
        sign nothing valid any more: checked before a join token is spent on a call that
        could not be answered."""
        if self.certificate.not_valid_after_utc <= now:
            raise CertificateAuthorityExpired(
                f"the issuing CA expired at {self.certificate.not_valid_after_utc.isoformat()}"
            )

    @staticmethod
    def requested_key(csr_pem: str) -> WorkerKey:
        """The public key of a CSR this CA would sign; a refusal for any other, before
        anything is spent on it (a join token is consumed only for a request that can be
        answered)."""
        return _verified_public_key(csr_pem)

    def issue_worker_certificate(
        self, public_key: WorkerKey, worker_id: str, worker_uri: str, now: dt.datetime
    ) -> IssuedCertificate:
        """A client certificate for ``public_key`` (from :meth:`requested_key`), naming
        ``worker_uri`` only; valid no longer than any certificate of its path."""
        path = (self.certificate, *self.chain, *self.roots)
        not_after = min(now + self.lifetime, *(c.not_valid_after_utc for c in path))
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, worker_id)]))
            .issuer_name(self.certificate.subject)
            .public_key(public_key)
            .serial_number(int.from_bytes(secrets.token_bytes(16), "big") >> 1)
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(worker_uri)]),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=isinstance(public_key, rsa.RSAPublicKey),
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        algorithm = None if isinstance(self.key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
        certificate = builder.sign(self.key, algorithm)
        # Presented with its chain: ingress trusts the root, not an intermediate.
        return IssuedCertificate(_pem((certificate, *self.chain)), not_after)


def key_digest(key: WorkerKey) -> str:
    """SHA-256 of the key's SubjectPublicKeyInfo, lowercase hex: what a spent join token
    records of the key it was spent for."""
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def _roots_of(
    source: Path, chain: tuple[x509.Certificate, ...], candidates: tuple[x509.Certificate, ...]
) -> tuple[x509.Certificate, ...]:
    """The roots (of ``candidates``) that end ``chain``, the issuing intermediate first:
    each certificate of it is issued by the next, the last by such a root. A bundle of
    unrelated certificates, or a trust file whose roots did not sign the chain, is
    refused at start: Workers would be told to trust a root that verifies nothing of
    theirs, and present certificates that verify nothing."""
    for lower, upper in itertools.pairwise(chain):
        if not _issued_by(lower, upper):
            raise ValueError(
                f"{source}: {lower.subject.rfc4514_string()} is not issued by the"
                f" certificate after it ({upper.subject.rfc4514_string()})"
            )
    top = chain[-1]
    roots = tuple(c for c in candidates if _issued_by(top, c))
    if not roots:
        raise ValueError(f"{source}: no root given issued {top.subject.rfc4514_string()}")
    return roots


def _issued_by(certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
    if certificate.issuer != issuer.subject:
        return False
    try:
        certificate.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _self_signed(certificate: x509.Certificate) -> bool:
    return _issued_by(certificate, certificate)


def _pem(certificates: tuple[x509.Certificate, ...]) -> str:
    return "".join(c.public_bytes(serialization.Encoding.PEM).decode("ascii") for c in certificates)


def _verified_public_key(csr_pem: str) -> WorkerKey:
    """The CSR's public key, if the CSR parses, is signed by that key, and the key is one
    we issue for; anything else is a FIELD_INVALID refusal that names no value."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode("ascii"))
        signed = csr.is_signature_valid
        key = csr.public_key()
    except (ValueError, UnicodeError, InvalidSignature):
        raise _bad_csr("is not a well-formed PEM certificate signing request") from None
    except UnsupportedAlgorithm:  # a well-formed CSR for a key or signature nobody knows
        raise _bad_csr("has a key type this CA does not issue for") from None
    if not signed:
        raise _bad_csr("is not signed by its own key")
    if isinstance(key, ec.EllipticCurvePublicKey):
        if isinstance(key.curve, _ACCEPTED_CURVES):
            return key
        raise _bad_csr("uses an elliptic curve other than P-256 or P-384")
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size >= _MIN_RSA_BITS:
            return key
        raise _bad_csr(f"has an RSA key shorter than {_MIN_RSA_BITS} bits")
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key
    raise _bad_csr("has a key type this CA does not issue for")


def _bad_csr(problem: str) -> Refused:
    return Refused(Reason.FIELD_INVALID, f"{CSR_FIELD} {problem}", field=CSR_FIELD)
