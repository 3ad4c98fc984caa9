"""The TLS option: the embedded server with a certificate made here, clients verifying it
with ``ROLLBUS_NATS_TLS_CA`` over ``tls://`` URLs that carry a role's credentials."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services import natsd
from shared import creds
from shared.bus import Bus
from shared.errors import BusUnreachable


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
    return k.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca_and_server_cert(d: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key): a throwaway CA and a cert for 127.0.0.1."""
    now = dt.datetime.now(dt.UTC)
    ca_key, key = _key(), _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollbus test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = d / "ca.pem", d / "server.pem", d / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(_pem_key(key))
    return paths


async def test_tls_embedded_server_with_auth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    users = creds.ensure(tmp_path / "creds")
    srv = natsd.start(
        tmp_path / "nats", port=0, users=users, tls_cert=str(cert), tls_key=str(key)
    )
    try:
        assert srv.url.startswith("tls://127.0.0.1:")
        url = creds.with_creds(srv.url, *users["operator"])
        # the CA from the setting every process shares
        monkeypatch.setenv("ROLLBUS_NATS_TLS_CA", str(ca))
        bus = await Bus.connect(url, "tls-test")
        try:
            assert bus.nc.is_connected and bus.url == srv.url
            assert bus.nc._server_info.get("tls_required")
        finally:
            await bus.close()
        # without the CA the server's certificate is not trusted
        monkeypatch.delenv("ROLLBUS_NATS_TLS_CA")
        with pytest.raises(BusUnreachable):
            await Bus.connect(url, "tls-test", timeout=3)
        # a plaintext client is refused by a TLS-only server
        with pytest.raises(BusUnreachable):
            await Bus.connect(url.replace("tls://", "nats://"), "plain", timeout=3)
    finally:
        srv.stop()
