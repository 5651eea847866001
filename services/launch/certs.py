"""Throwaway TLS material for one run: a CA, a service certificate, an operator certificate, a token.

`make demo ARGS="--secure"` (and tests) call `issue(directory)`; for services run by hand,
`grpo-mesh certs DIR [--hosts HOST ...]` does the same and prints the run-config `[security]` table
that turns it on. Everything lands in one directory (private keys and the token readable by the
owner only):

    ca.pem                 the run's CA (what every client verifies servers with; --cacert)
    service.pem / .key     every service's certificate: serverAuth + clientAuth, since the services
                           are also each other's clients under mutual TLS; SANs localhost, 127.0.0.1,
                           ::1 and any extra host names
    operator.pem / .key    a client certificate for people and tools (grpcurl -cert/-key)
    token                  the bearer token every RPC carries (256 random bits, URL-safe)

Made with `cryptography` (ECDSA P-256, SHA-256); valid for 30 days, long enough for any demo and
short enough that a leaked file is soon worthless. Production deployments bring their own PKI.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

import tomli_w
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import Field
from pydantic_settings import CliPositionalArg

from services.common.config import CommandSettings, parse_cli

VALID_DAYS = 30
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class RunCredentials:
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def service_cert(self) -> Path:
        return self.directory / "service.pem"

    @property
    def service_key(self) -> Path:
        return self.directory / "service.key"

    @property
    def operator_cert(self) -> Path:
        return self.directory / "operator.pem"

    @property
    def operator_key(self) -> Path:
        return self.directory / "operator.key"

    @property
    def token(self) -> Path:
        return self.directory / "token"

    def security_table(self, mutual: bool = True) -> dict[str, str | bool]:
        """The run-config `[security]` table that turns TLS (+ client certificates) and tokens on."""
        return {
            "tls_cert": str(self.service_cert),
            "tls_key": str(self.service_key),
            "tls_ca": str(self.ca),
            "require_client_cert": mutual,
            "token_file": str(self.token),
        }


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "grpo-mesh run"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    usages: tuple[x509.ObjectIdentifier, ...] = (),
    hosts: tuple[str, ...] = (),
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def issue(directory: Path, hosts: tuple[str, ...] = DEFAULT_HOSTS) -> RunCredentials:
    """Create a fresh CA, service and operator certificates and a token in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    creds = RunCredentials(directory)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("grpo-mesh run CA")
    ca_cert = _certificate("grpo-mesh run CA", ca_key, ca_name, ca_key, ca=True)
    pem = serialization.Encoding.PEM
    creds.ca.write_bytes(ca_cert.public_bytes(pem))
    both = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
    for stem, usages, names in (
        ("service", both, hosts),
        ("operator", (ExtendedKeyUsageOID.CLIENT_AUTH,), ()),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(stem, key, ca_name, ca_key, usages=usages, hosts=names)
        _write_key(directory / f"{stem}.key", key)
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(pem))
    creds.token.touch(mode=0o600, exist_ok=True)
    creds.token.chmod(0o600)
    creds.token.write_text(secrets.token_urlsafe(32) + "\n")
    return creds


# --- `grpo-mesh certs` ------------------------------------------------------------------------------

PROG = "grpo-mesh certs"


class CertsSettings(CommandSettings):
    """Make a throwaway CA, a service certificate (serverAuth + clientAuth), an operator certificate
    and a bearer token in DIR, valid for 30 days, for running the services by hand with mutual TLS;
    prints the run-config [security] table that turns them on. Production brings its own PKI.
    """

    dir: CliPositionalArg[Path] = Field(description="Where the files go (created; mode 700).")
    hosts: list[str] = Field(
        default_factory=list,
        description="Extra host names or IPs of the service certificate, besides localhost, 127.0.0.1 and "
        "::1 (e.g. --hosts learner,env,rollout,scheduler).",
    )
    overwrite: bool = Field(
        default=False, description="Replace credentials already in DIR (services using them stop trusting)."
    )


def parse(argv: list[str], prog: str = PROG) -> CertsSettings:
    """The command line; SystemExit(2) on a bad one."""
    return parse_cli(CertsSettings, argv, prog)


def main(argv: list[str]) -> int:
    args = parse(argv)
    directory = args.dir.resolve()
    if RunCredentials(directory).ca.exists() and not args.overwrite:
        print(f"{PROG}: error: {directory} holds credentials already (--overwrite)", file=sys.stderr)
        return 1
    hosts = tuple(dict.fromkeys([*DEFAULT_HOSTS, *args.hosts]))
    creds = issue(directory, hosts)
    print(f"wrote ca.pem, service.pem/.key ({', '.join(hosts)}), operator.pem/.key, token in {directory}")
    print("\n# the run-config's [security] table (every service; or --security.* flags):")
    print(tomli_w.dumps({"security": creds.security_table(mutual=True)}), end="")
    print(
        f"\n# grpcurl: -cacert {creds.ca} -cert {creds.operator_cert} -key {creds.operator_key} "
        f'-H "authorization: Bearer $(cat {creds.token})"'
    )
    return 0
