"""Development PKI: one CA and the certificates the embedded stack needs.

Identities are SPIFFE-style SAN URIs under one trust domain:

- ``spiffe://<td>/service/ingress`` -- the public ingress server, and ingress as
  a *client* of control on the internal channel (a separate key and certificate);
- ``spiffe://<td>/service/control`` -- the control (runtime) server;
- ``spiffe://<td>/worker/<worker_id>`` -- one Worker;
- ``spiffe://<td>/operator/<name>`` -- one operator.

Key types are chosen on purpose:

- The CA and the client certificates use ECDSA P-256 (fast to issue).
- SERVER certificates use RSA 2048. TLS 1.2 cipher suites are bound to the
  server key type, TLS 1.3 suites are not. grpcio has no TLS 1.3 minimum, so a
  deployment can refuse TLS 1.2 by naming only ECDSA TLS 1.2 suites in
  ``GRPC_SSL_CIPHER_SUITES``: with an RSA server key no TLS 1.2 handshake can
  complete, while TLS 1.3 still does. Do not switch servers to ECDSA without
  revisiting that.

Everything is idempotent: material already in the directory is reused as long
as it is still valid, issued by the CA in the directory and carries exactly
the wanted names. Anything else is issued afresh. Private keys are written
0600 (atomically, never world-readable even for a moment) and never logged.
Not safe for two processes issuing into one directory at the same time; the
caller serialises (``qinglong up`` holds a lock on its data directory).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Re-exported: the dev stack and the tests name identities through this module.
from qinglong_protocol.files import atomic_write
from qinglong_protocol.identities import DEFAULT_TRUST_DOMAIN as DEFAULT_TRUST_DOMAIN
from qinglong_protocol.identities import operator_uri as operator_uri
from qinglong_protocol.identities import service_uri as service_uri
from qinglong_protocol.identities import worker_uri as worker_uri
from qinglong_protocol.tls import TlsFiles

# Names every development server certificate answers to, so that clients can
# dial "localhost", "127.0.0.1" or "[::1]" with full hostname verification.
LOCAL_SERVER_DNS_NAMES = ("localhost",)
LOCAL_SERVER_IP_ADDRESSES = ("127.0.0.1", "::1")

SERVER_RSA_KEY_BITS = 2048
CA_VALIDITY = dt.timedelta(days=3650)
LEAF_VALIDITY = dt.timedelta(days=365)
# Material this close to expiry is reissued rather than reused.
RENEWAL_MARGIN = dt.timedelta(days=30)
# Tolerate small clock differences between the issuing and the verifying host.
CLOCK_SKEW = dt.timedelta(minutes=5)

# SPIFFE trust domain charset; ids are single URI path segments that are also
# safe file names (no "/", no leading dot).
_TRUST_DOMAIN_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,254}")
_IDENTITY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

_KEY_FILE_MODE = 0o600
_CERT_FILE_MODE = 0o644
_DIRECTORY_MODE = 0o700

_PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


class CertificatePurpose(Enum):
    SERVER = "server"
    CLIENT = "client"


@dataclass(frozen=True)
class DevPki:
    """The CA and the service certificates of one development stack."""

    directory: Path
    trust_domain: str
    ca_cert: Path
    ingress_server: TlsFiles
    control_server: TlsFiles
    # Ingress's client identity on the internal channel to control.
    ingress_client: TlsFiles

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"


@dataclass(frozen=True)
class _LeafSpec:
    common_name: str
    uri: str
    purpose: CertificatePurpose
    dns_names: tuple[str, ...] = ()
    ip_addresses: tuple[str, ...] = ()

    def subject_alternative_name(self) -> x509.SubjectAlternativeName:
        names: list[x509.GeneralName] = [x509.DNSName(name) for name in self.dns_names]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in self.ip_addresses]
        names.append(x509.UniformResourceIdentifier(self.uri))
        return x509.SubjectAlternativeName(names)

    def extended_key_usage(self) -> x509.ExtendedKeyUsage:
        if self.purpose is CertificatePurpose.SERVER:
            # Client auth too: a service's probe (`qinglong-<service> probe`) asks its own
            # server's health over mTLS with the service's own certificate, as in Kubernetes.
            return x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            )
        return x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])


@dataclass(frozen=True)
class _Authority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def ensure_dev_pki(
    directory: Path,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
    ingress_names: Sequence[str] = (),
) -> DevPki:
    """Issue (or reuse) the CA and the three service certificates in `directory`.

    `ingress_names` are more names the public ingress certificate answers to (host names or
    IP addresses other machines dial); a change of that set re-issues the certificate,
    since a reused one would carry exactly the old names.
    """
    check_trust_domain(trust_domain)
    _ensure_private_directory(directory)
    authority = _ensure_authority(directory)
    ca_cert = directory / "ca.crt"
    pki = DevPki(
        directory=directory,
        trust_domain=trust_domain,
        ca_cert=ca_cert,
        ingress_server=_files(ca_cert, directory, "ingress-server"),
        control_server=_files(ca_cert, directory, "control-server"),
        ingress_client=_files(ca_cert, directory, "ingress-client"),
    )
    ingress_uri = service_uri(trust_domain, "ingress")
    _ensure_leaf(
        authority, pki.ingress_server, _local_server_spec("ingress", ingress_uri, ingress_names)
    )
    _ensure_leaf(
        authority,
        pki.control_server,
        _local_server_spec("control", service_uri(trust_domain, "control")),
    )
    _ensure_leaf(
        authority,
        pki.ingress_client,
        _LeafSpec("ingress", ingress_uri, CertificatePurpose.CLIENT),
    )
    return pki


def ensure_worker_identity(pki: DevPki, worker_id: str) -> TlsFiles:
    """Issue (or reuse) the client certificate of Worker `worker_id`."""
    check_identity_name("worker_id", worker_id)
    files = _files(pki.ca_cert, pki.directory / "workers", worker_id)
    _ensure_private_directory(files.cert.parent)
    _ensure_leaf(
        _load_authority(pki),
        files,
        _LeafSpec(worker_id, worker_uri(pki.trust_domain, worker_id), CertificatePurpose.CLIENT),
    )
    return files


def ensure_operator_identity(pki: DevPki, name: str) -> TlsFiles:
    """Issue (or reuse) the client certificate of operator `name`."""
    check_identity_name("operator name", name)
    files = _files(pki.ca_cert, pki.directory / "operators", name)
    _ensure_private_directory(files.cert.parent)
    _ensure_leaf(
        _load_authority(pki),
        files,
        _LeafSpec(name, operator_uri(pki.trust_domain, name), CertificatePurpose.CLIENT),
    )
    return files


def _files(ca_cert: Path, directory: Path, stem: str) -> TlsFiles:
    return TlsFiles(ca_cert=ca_cert, cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")


def _local_server_spec(common_name: str, uri: str, extra_names: Sequence[str] = ()) -> _LeafSpec:
    ip_addresses = {_ip_text(name) for name in extra_names if _is_ip_address(name)}
    dns_names = {name.lower() for name in extra_names if not _is_ip_address(name)}
    # Local names first, then the extra ones sorted: the SAN list compares in order, and a
    # stable order lets an unchanged set of names reuse the certificate.
    return _LeafSpec(
        common_name,
        uri,
        CertificatePurpose.SERVER,
        dns_names=_with_extra(LOCAL_SERVER_DNS_NAMES, dns_names),
        ip_addresses=_with_extra(LOCAL_SERVER_IP_ADDRESSES, ip_addresses),
    )


def _with_extra(local: tuple[str, ...], extra: set[str]) -> tuple[str, ...]:
    return local + tuple(sorted(extra - set(local)))


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _ip_text(address: str) -> str:
    # The canonical text ("::1", not "0:0:0:0:0:0:0:1"), so that one address is one name.
    return str(ipaddress.ip_address(address))


def check_trust_domain(trust_domain: str) -> None:
    if not _TRUST_DOMAIN_RE.fullmatch(trust_domain):
        raise ValueError(f"invalid trust domain {trust_domain!r}")


def check_identity_name(kind: str, name: str) -> None:
    if not _IDENTITY_NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid {kind} {name!r}: 1-63 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# --- the CA ---------------------------------------------------------------------------------


def _ensure_authority(directory: Path) -> _Authority:
    cert_path, key_path = directory / "ca.crt", directory / "ca.key"
    existing = _try_load_authority(cert_path, key_path)
    if existing is not None:
        return existing
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "QingLong development"),
            x509.NameAttribute(NameOID.COMMON_NAME, "QingLong development CA"),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key_and_cert(key_path, key, cert_path, cert)
    return _Authority(cert=cert, key=key)


def _load_authority(pki: DevPki) -> _Authority:
    authority = _try_load_authority(pki.ca_cert, pki.ca_key)
    if authority is None:
        raise FileNotFoundError(f"no usable development CA in {pki.directory}")
    return authority


def _try_load_authority(cert_path: Path, key_path: Path) -> _Authority | None:
    loaded = _try_load_pair(cert_path, key_path)
    if loaded is None:
        return None
    cert, key = loaded
    if not isinstance(key, ec.EllipticCurvePrivateKey) or _expires_soon(cert):
        return None
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return None
    if not constraints.ca:
        return None
    _tighten_key_mode(key_path)
    return _Authority(cert=cert, key=key)


# --- leaf certificates ----------------------------------------------------------------------


def _ensure_leaf(authority: _Authority, files: TlsFiles, spec: _LeafSpec) -> None:
    if _leaf_is_reusable(authority, files, spec):
        _tighten_key_mode(files.key)
        return
    key = _new_leaf_key(spec.purpose)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, spec.common_name)]))
        .issuer_name(authority.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + LEAF_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_key_usage(spec.purpose), critical=True)
        .add_extension(spec.extended_key_usage(), critical=False)
        .add_extension(spec.subject_alternative_name(), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()),
            critical=False,
        )
        .sign(authority.key, hashes.SHA256())
    )
    _write_key_and_cert(files.key, key, files.cert, cert)


def _new_leaf_key(purpose: CertificatePurpose) -> _PrivateKey:
    if purpose is CertificatePurpose.SERVER:
        # RSA on purpose: see the module docstring (TLS 1.2 refusal via cipher suites).
        return rsa.generate_private_key(public_exponent=65537, key_size=SERVER_RSA_KEY_BITS)
    return ec.generate_private_key(ec.SECP256R1())


def _leaf_key_usage(purpose: CertificatePurpose) -> x509.KeyUsage:
    # RSA key exchange (TLS 1.2 RSA suites) needs key_encipherment on RSA server keys.
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=purpose is CertificatePurpose.SERVER,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _leaf_is_reusable(authority: _Authority, files: TlsFiles, spec: _LeafSpec) -> bool:
    loaded = _try_load_pair(files.cert, files.key)
    if loaded is None:
        return False
    cert, key = loaded
    wanted_key_type = (
        rsa.RSAPrivateKey
        if spec.purpose is CertificatePurpose.SERVER
        else (ec.EllipticCurvePrivateKey)
    )
    if not isinstance(key, wanted_key_type) or _expires_soon(cert):
        return False
    try:
        cert.verify_directly_issued_by(authority.cert)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    return names == spec.subject_alternative_name() and usage == spec.extended_key_usage()


# --- files ----------------------------------------------------------------------------------


def _try_load_pair(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, _PrivateKey] | None:
    """Load a certificate and its key; None when missing, unreadable or not a matching pair."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        return None
    if _public_der(key.public_key()) != _public_der(cert.public_key()):
        return None
    return cert, key


def _public_der(public_key: object) -> bytes:
    if not isinstance(public_key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey):
        return b""
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _expires_soon(cert: x509.Certificate) -> bool:
    return cert.not_valid_after_utc - RENEWAL_MARGIN <= _now()


def _write_key_and_cert(
    key_path: Path, key: _PrivateKey, cert_path: Path, cert: x509.Certificate
) -> None:
    # Key first: if we stop in between, the pair no longer matches and the next
    # run reissues both instead of serving a certificate without its key.
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),  # grpc reads unencrypted PEM keys only
    )
    atomic_write(key_path, key_pem, _KEY_FILE_MODE)
    atomic_write(cert_path, cert.public_bytes(serialization.Encoding.PEM), _CERT_FILE_MODE)


def _tighten_key_mode(key_path: Path) -> None:
    # Reused keys may have been copied in with a looser mode.
    if key_path.stat().st_mode & 0o777 != _KEY_FILE_MODE:
        key_path.chmod(_KEY_FILE_MODE)


def _ensure_private_directory(directory: Path) -> None:
    directory.mkdir(mode=_DIRECTORY_MODE, parents=True, exist_ok=True)
