"""TLS, mutual TLS and bearer tokens: one settings block every service shares, and what it becomes.

Server side (`server_credentials`, `TokenCheck`): TLS when a certificate is configured, a client
certificate signed by the CA when `require_client_cert` (mutual TLS), and a bearer token on every
call of our services when a token is configured (exactly one `authorization` entry, compared in
constant time, checked before the request is even decoded: an unauthenticated call executes nothing).
The same token (or HTTP basic auth) can guard the Prometheus `/metrics` endpoint (telemetry.py).

Client side (`ClientSecurity`): the same block tells every client this process opens (scheduler →
services, rollout → learner weight fetches, launcher) how to reach its peers: the CA to verify them
with, the certificate to present under mutual TLS, and the token to send. A service process sets it
once at start-up (`set_client_security`), so no caller passes credentials around.

Health (`grpc.health.v1`) and reflection need no token: probes (Kubernetes, Docker healthchecks)
cannot send one, and they reveal only the service names and the public protobuf schema, never
state. Under mutual TLS they still need a client certificate, like any connection.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

TOKEN_ENV = "GRPO_TOKEN"
AUTHORIZATION = "authorization"
# Methods reachable without a token (their full names start with these).
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class SecuritySettings(BaseModel):
    """`--security.*` of every service (the run-config's top-level `[security]` table sets it for all)."""

    model_config = ConfigDict(extra="forbid")

    tls_cert: Path | None = Field(
        default=None, description="PEM certificate chain this service presents; set = serve TLS only."
    )
    tls_key: Path | None = Field(default=None, description="PEM private key of --security.tls-cert.")
    tls_ca: Path | None = Field(
        default=None,
        description="PEM CA bundle that signed the peers' certificates: clients verify servers with it, "
        "and under --security.require-client-cert servers verify clients with it.",
    )
    require_client_cert: bool = Field(
        default=False, description="Mutual TLS: refuse connections without a client certificate from the CA."
    )
    client_cert: Path | None = Field(
        default=None,
        description="PEM certificate this process presents as a client under mutual TLS; empty = tls-cert.",
    )
    client_key: Path | None = Field(default=None, description="PEM private key of the client certificate.")
    server_name: str = Field(
        default="",
        description="Host name to verify in peers' certificates instead of the dialled host (e.g. "
        "'grpo-mesh' when certificates name the service, not the address).",
    )
    token_file: Path | None = Field(
        default=None,
        description=f"File holding the bearer token every RPC must carry (and this process sends); the "
        f"{TOKEN_ENV} environment variable is used when this is empty. Neither = no token check.",
    )

    @model_validator(mode="after")
    def _pairs(self) -> SecuritySettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("security: tls_cert and tls_key go together")
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("security: client_cert and client_key go together")
        if self.require_client_cert and (self.tls_cert is None or self.tls_ca is None):
            raise ValueError("security: require_client_cert needs tls_cert, tls_key and tls_ca")
        return self

    @property
    def tls(self) -> bool:
        """Whether this process serves TLS (and so dials its peers with TLS too)."""
        return self.tls_cert is not None or self.tls_ca is not None

    def token(self) -> str:
        """The configured bearer token ("" = none): the file's first line, else $GRPO_TOKEN."""
        if self.token_file is not None:
            try:
                token = self.token_file.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ValueError(f"security: cannot read token file {self.token_file}: {exc}") from exc
            if not token:
                raise ValueError(f"security: token file {self.token_file} is empty")
            return token
        return os.environ.get(TOKEN_ENV, "").strip()


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


def server_credentials(settings: SecuritySettings) -> grpc.ServerCredentials | None:
    """TLS credentials for the server, or None for a plaintext port."""
    if settings.tls_cert is None:
        return None
    key_cert = (_read(settings.tls_key), _read(settings.tls_cert))
    return grpc.ssl_server_credentials(
        [key_cert],
        root_certificates=_read(settings.tls_ca) if settings.require_client_cert else None,
        require_client_auth=settings.require_client_cert,
    )


@dataclass(frozen=True)
class ClientSecurity:
    """How this process dials its peers: TLS material (None = plaintext) and the token to send."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str = ""
    token: str = ""
    tls: bool = False

    @classmethod
    def from_settings(cls, settings: SecuritySettings) -> ClientSecurity:
        cert = settings.client_cert or (settings.tls_cert if settings.require_client_cert else None)
        key = settings.client_key or (settings.tls_key if settings.require_client_cert else None)
        return cls(
            root_certificates=_read(settings.tls_ca),
            certificate_chain=_read(cert),
            private_key=_read(key),
            server_name=settings.server_name,
            token=settings.token(),
            tls=settings.tls,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTHORIZATION, f"Bearer {self.token}"),) if self.token else ()


_process_client_security = ClientSecurity()


def set_client_security(security: ClientSecurity) -> None:
    """Set once at process start: every channel this process opens afterwards uses it."""
    global _process_client_security
    _process_client_security = security


def client_security() -> ClientSecurity:
    return _process_client_security


class TokenCheck:
    """Constant-time bearer-token check of one call's metadata ("" token = check off).

    A call must carry exactly one `authorization` entry: two (say a wrong token, then the right one)
    are ambiguous credentials and refused, whichever of them is right, since a proxy or a
    server that reads the other one would decide differently."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def refusal(self, method: str, metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
        """None when the call may go on, else why not (the UNAUTHENTICATED message)."""
        if self._expected is None or method.startswith(OPEN_PREFIXES):
            return None
        given = [value for key, value in metadata if key.lower() == AUTHORIZATION]
        if not given:
            return f"no bearer token: {_SEND}"
        if len(given) > 1:
            return f"ambiguous credentials: {len(given)} 'authorization' metadata entries; {_SEND} once"
        value = given[0]
        raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
        if not hmac.compare_digest(raw, self._expected):
            return f"a wrong bearer token: {_SEND}"
        return None


_SEND = "send metadata 'authorization: Bearer <token>'"
