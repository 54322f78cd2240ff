"""Certificates, keys and kubeconfigs for the local control plane.

Everything is generated locally on first start: a cluster CA, the API server's
serving certificate, one client certificate per component and the
service-account signing key. ECDSA P-256 keeps generation instant.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=365)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


class PKI:
    """Files under ``<state>/pki``; created once, reused on restart."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.ca_cert = directory / "ca.crt"
        self.ca_key = directory / "ca.key"
        self.sa_key = directory / "sa.key"
        self.sa_pub = directory / "sa.pub"

    def ensure(self, dns_names: list[str], ips: list[str]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.ca_cert.exists():
            key = _key()
            now = dt.datetime.now(dt.timezone.utc)
            cert = (x509.CertificateBuilder()
                    .subject_name(_name("disagg-local-ca")).issuer_name(_name("disagg-local-ca"))
                    .public_key(key.public_key()).serial_number(x509.random_serial_number())
                    .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + _VALIDITY)
                    .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                    .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                 content_commitment=False, key_encipherment=False,
                                                 data_encipherment=False, key_agreement=False,
                                                 encipher_only=False, decipher_only=False), critical=True)
                    .sign(key, hashes.SHA256()))
            _write_key(self.ca_key, key)
            _write_cert(self.ca_cert, cert)
        if not self.sa_key.exists():
            key = _key()
            _write_key(self.sa_key, key)
            self.sa_pub.write_bytes(key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        if not (self.dir / "apiserver.crt").exists():
            self.issue("apiserver", "kube-apiserver", server=True, dns_names=dns_names, ips=ips)

    def _ca(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        cert = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        key = serialization.load_pem_private_key(self.ca_key.read_bytes(), password=None)
        return cert, key  # type: ignore[return-value]

    def issue(self, name: str, common_name: str, organization: str | None = None, server: bool = False,
              dns_names: list[str] | None = None, ips: list[str] | None = None) -> tuple[Path, Path]:
        """A certificate signed by the cluster CA; returns (cert, key) paths."""
        cert_path, key_path = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        if cert_path.exists() and key_path.exists():
            return cert_path, key_path
        ca_cert, ca_key = self._ca()
        key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (x509.CertificateBuilder()
                   .subject_name(_name(common_name, organization)).issuer_name(ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + _VALIDITY)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server:
            sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names or []]
            sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips or []]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        _write_key(key_path, key)
        _write_cert(cert_path, builder.sign(ca_key, hashes.SHA256()))
        return cert_path, key_path

    def kubeconfig(self, path: Path, server: str, user: str, cert: Path, key: Path,
                   context: str = "disagg-local") -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": server,
                                                        "certificate-authority": str(self.ca_cert)}}],
            "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
            "current-context": context,
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path
