"""Certificates renewed in place while the services run (cert-manager renews a Secret a
third of a lifetime early; the kubelet swaps the mounted files): nothing restarts.

Real TLS on loopback with the development CA. A server made with the services'
credentials serves its new certificate from the next handshake on; ingress's channel to
control presents ingress's new client certificate from the next call on, while a call on
the old channel still works. Before, both read their files once: the old certificates
stayed in use until they expired, and then every new connection failed.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

import grpc
from cryptography import x509
from qinglong_cli.pki import DevPki, ensure_dev_pki
from qinglong_ingress.control_channel import RenewingControlChannel
from qinglong_ingress.settings import ControlChannelSettings
from qinglong_protocol.tls import TlsFiles, mutual_tls_server_credentials

METHOD = "/qinglong.test.Who/Serial"


async def _client_serial(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    """The serial number of the certificate the caller presented."""
    [pem] = context.auth_context()["x509_pem_cert"]
    return str(x509.load_pem_x509_certificate(pem).serial_number).encode()


def _serial(files: TlsFiles) -> int:
    return x509.load_pem_x509_certificate(files.cert.read_bytes()).serial_number


def _renewed(pki_directory: Path, files: TlsFiles) -> int:
    """Replace one leaf's key and certificate, as a renewal does; its new serial."""
    files.cert.unlink()
    files.key.unlink()
    ensure_dev_pki(pki_directory)
    return _serial(files)


def _served_serial(port: int, pki: DevPki) -> int:
    """The serial of the certificate the server presents to a new connection."""
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.ingress_client.cert), str(pki.ingress_client.key))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_renewed_certificates_are_used_without_a_restart(tmp_path: Path) -> None:
    pki_directory = tmp_path / "pki"
    pki = ensure_dev_pki(pki_directory)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "qinglong.test.Who", {"Serial": grpc.unary_unary_rpc_method_handler(_client_serial)}
            ),
        )
    )
    port = server.add_secure_port("127.0.0.1:0", mutual_tls_server_credentials(pki.control_server))
    await server.start()
    control = RenewingControlChannel(
        ControlChannelSettings(f"127.0.0.1:{port}", pki.ingress_client)
    )

    class Gateway:
        channel = control.current

        def use_runtime(self, channel: grpc.aio.Channel) -> None:
            self.channel = channel

    gateway = Gateway()
    control.serve(gateway)
    try:
        first_client, first_server = _serial(pki.ingress_client), _serial(pki.control_server)
        old = gateway.channel
        assert await old.unary_unary(METHOD)(b"", timeout=10) == str(first_client).encode()
        assert await asyncio.to_thread(_served_serial, port, pki) == first_server
        assert not await control.renew_if_changed(), "nothing changed yet"

        renewed_client = _renewed(pki_directory, pki.ingress_client)
        renewed_server = _renewed(pki_directory, pki.control_server)
        assert await asyncio.to_thread(_served_serial, port, pki) == renewed_server
        assert await control.renew_if_changed()
        assert gateway.channel is control.current is not old
        assert await gateway.channel.unary_unary(METHOD)(b"", timeout=10) == (
            str(renewed_client).encode()
        )
        # A call on the old channel (in flight while the switch happened) still works.
        assert await old.unary_unary(METHOD)(b"", timeout=10) == str(first_client).encode()
        # Files caught in the middle of a rotation (the next certificate, the old key):
        # the channel made of them cannot connect, and is not switched to.
        working = gateway.channel
        key_in_use = pki.ingress_client.key.read_bytes()
        third_client = _renewed(pki_directory, pki.ingress_client)
        new_key = pki.ingress_client.key.read_bytes()
        pki.ingress_client.key.write_bytes(key_in_use)
        assert not await control.renew_if_changed()
        assert gateway.channel is working
        assert await working.unary_unary(METHOD)(b"", timeout=10) == (str(renewed_client).encode())
        pki.ingress_client.key.write_bytes(new_key)  # the rotation completes
        assert await control.renew_if_changed()
        assert await gateway.channel.unary_unary(METHOD)(b"", timeout=10) == (
            str(third_client).encode()
        )
        print(
            f"client certificate {first_client} -> {renewed_client}, server certificate"
            f" {first_server} -> {renewed_server}: both in use without a restart"
        )
    finally:
        await control.close()
        await server.stop(None)
