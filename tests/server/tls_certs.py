"""Throwaway certificate authorities and certificates for the TLS tests, made at test time.

`make_ca` writes a self-signed CA; `issue` writes a certificate it signs for 127.0.0.1 and
localhost, usable by a server and a client (as a cluster process's certificate must be).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclasses.dataclass(frozen=True)
class CA:
    cert: Path
    key: ec.EllipticCurvePrivateKey
    name: x509.Name


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


def make_ca(directory: Path, name: str) -> CA:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = _validity(
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
    )
    builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    builder = builder.add_extension(
        x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
    )
    cert = builder.sign(key, hashes.SHA256())
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return CA(path, key, subject)


def issue(ca: CA, directory: Path, name: str, addresses: tuple[str, ...] = ()) -> Issued:
    """A certificate `ca` signs for `name`, valid for 127.0.0.1, localhost and `addresses` (IPs),
    server and client use."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _validity(
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
    )
    builder = builder.add_extension(
        x509.SubjectAlternativeName(
            [x509.DNSName("localhost")]
            + [x509.IPAddress(ipaddress.ip_address(a)) for a in dict.fromkeys(("127.0.0.1", *addresses))]
        ),
        critical=False,
    )
    builder = builder.add_extension(
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
    )
    builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    cert = builder.sign(ca.key, hashes.SHA256())
    issued = Issued(directory / f"{name}.crt", directory / f"{name}.key")
    issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, issued.key)
    return issued
