"""The status endpoint's TLS material: a self-signed CA that job pods trust, and the serving
certificate it signs for the operator.

Pods verify the endpoint with `KUBEFLOW_TRAINER_SERVER_CA_CERT`, so the CA must outlive any
one operator process (transformers' reporter reads the CA file once per process and keeps
it): the operator keeps the CA's PEM pair somewhere durable (a Secret of its own) and
issues itself a fresh serving certificate from it at each start. Keys are ECDSA P-256:
a TLS handshake then costs the operator a fraction of what an RSA key would, which
matters when reporters that open a connection per report (transformers' urllib) do so
for hundreds of jobs. Certificates carry the extensions Python 3.13's strict default
verification requires (authority and subject key identifiers, a critical CA basic
constraint, key usages).

This module only makes and loads certificates; it reads no files and calls no API.
"""

from __future__ import annotations

import ipaddress
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_COMMON_NAME = "kubetrain status endpoint CA"
# Backdated a little, so a pod whose clock runs behind the operator's still accepts it.
_CLOCK_SKEW = timedelta(minutes=5)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass(frozen=True)
class ServingCertificate:
    """A certificate and its private key (PEM) for the endpoint's TLS server."""

    cert_pem: bytes
    key_pem: bytes

    def server_context(self) -> ssl.SSLContext:
        """A TLS 1.2+ server context presenting this certificate."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # ssl loads a chain only from files: write it to a private temporary folder
        # and remove it as soon as it is loaded.
        with tempfile.TemporaryDirectory(prefix="kubetrain-status-tls-") as folder:
            cert_file, key_file = Path(folder, "tls.crt"), Path(folder, "tls.key")
            cert_file.write_bytes(self.cert_pem)
            key_file.touch(mode=0o600)
            key_file.write_bytes(self.key_pem)
            context.load_cert_chain(cert_file, key_file)
        return context


@dataclass(frozen=True)
class CertificateAuthority:
    """The CA (certificate and private key, PEM) that signs the endpoint's serving certificate.

    `cert_pem` is what job pods get as `ca.crt`; `key_pem` never leaves the operator.
    """

    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def generate(cls, *, valid_days: int = 3650,
                 now: datetime | None = None) -> CertificateAuthority:
        """A new self-signed CA, valid for `valid_days` from `now`."""
        now = now or datetime.now(UTC)
        key = _new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
        public = key.public_key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def issue(self, dns_names: Sequence[str], ip_addresses: Sequence[str] = (), *,
              valid_days: int = 365, now: datetime | None = None) -> ServingCertificate:
        """A serving certificate for these names (its subject alternative names).

        `dns_names` are what pods dial: the operator Service's
        `<service>.<namespace>.svc` (and `.svc.cluster.local`); `ip_addresses` suit
        loopback servers in tests and `kubetrain run`.
        """
        if not dns_names and not ip_addresses:
            raise ValueError("a serving certificate needs at least one DNS name or IP address")
        now = now or datetime.now(UTC)
        ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
        ca_key = serialization.load_pem_private_key(self.key_pem, password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError("the CA's private key is not an ECDSA key")
        key = _new_key()
        public = key.public_key()
        alternative_names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
        alternative_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        subject = x509.Name([x509.NameAttribute(
            NameOID.COMMON_NAME, dns_names[0] if dns_names else ip_addresses[0])])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_cert.subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(alternative_names), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return ServingCertificate(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))
