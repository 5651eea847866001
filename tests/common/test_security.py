"""TLS, mutual TLS and bearer tokens on real services (in-process servers on 127.0.0.1:0) with the
run credentials the demo uses (services/launch/certs.py).

A call without the token, with a wrong one, or with two `authorization` entries (ambiguous, even if
one is right) is UNAUTHENTICATED and executes nothing (the env's prompt cursor and the learner's step
do not move); health stays open to probes; under mutual TLS a client without a certificate from the
run's CA, or trusting another CA, never gets a connection.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpo.env.v1 import env_pb2, env_pb2_grpc
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.clients import GrpcClient, open_channel
from services.common.errors import Unauthenticated
from services.common.security import ClientSecurity, SecuritySettings, TokenCheck
from services.common.serve import start_server
from services.env.config import EnvSettings
from services.env.server import EnvApp
from services.launch.certs import RunCredentials, issue
from services.learner.config import LearnerSettings
from services.learner.server import LearnerApp

T = 30.0
ENV = "grpo.env.v1.EnvironmentService"


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> RunCredentials:
    return issue(tmp_path_factory.mktemp("tls"))


def _client(creds: RunCredentials, *, token: str | None = None, cert: bool = True, ca: Path | None = None):
    return ClientSecurity(
        root_certificates=(ca or creds.ca).read_bytes(),
        certificate_chain=creds.operator_cert.read_bytes() if cert else None,
        private_key=creds.operator_key.read_bytes() if cert else None,
        token=creds.token.read_text().strip() if token is None else token,
        tls=True,
    )


async def _env(security: SecuritySettings):
    settings = EnvSettings(port=0, spec="arithmetic", score_workers=1, security=security)
    return await start_server(EnvApp(settings), settings)


async def _position(address: str, security: ClientSecurity) -> int:
    async with open_channel(address, security=security) as channel:
        state = await env_pb2_grpc.EnvironmentServiceStub(channel).GetEnvironmentState(
            env_pb2.GetEnvironmentStateRequest(), timeout=T
        )
    return state.train_position


def test_token_check_is_exact_and_leaves_probes_open() -> None:
    check = TokenCheck("s3cret")
    method = "/grpo.env.v1.EnvironmentService/SamplePrompts"
    assert check.refusal(method, [("authorization", "Bearer s3cret")]) is None
    assert check.refusal(method, [("x-request-id", "r1"), ("authorization", b"Bearer s3cret")]) is None
    assert "no bearer token" in (check.refusal(method, []) or "")
    for given in ("Bearer s3cre", "s3cret", "é"):
        assert "a wrong bearer token" in (check.refusal(method, [("authorization", given)]) or "")
    for pairs in (
        [("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret")],
        [("authorization", "Bearer s3cret"), ("authorization", "Bearer s3cret")],
    ):
        assert "ambiguous credentials: 2 'authorization'" in (check.refusal(method, pairs) or "")
    assert check.refusal("/grpc.health.v1.Health/Check", []) is None
    assert check.refusal("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", []) is None
    assert TokenCheck("").refusal("/grpo.x/Y", []) is None and not TokenCheck("").enabled


async def test_two_authorization_entries_are_refused(creds: RunCredentials) -> None:
    """A wrong token and the right one on one call (either order): UNAUTHENTICATED, nothing runs."""
    running = await _env(SecuritySettings(**creds.security_table(mutual=True)))
    token = creds.token.read_text().strip()
    try:
        async with open_channel(running.address, security=_client(creds, token="")) as channel:
            stub = env_pb2_grpc.EnvironmentServiceStub(channel)
            for metadata in (
                (("authorization", "Bearer wrong"), ("authorization", f"Bearer {token}")),
                (("authorization", f"Bearer {token}"), ("authorization", "Bearer wrong")),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=2), metadata=metadata, timeout=T)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "ambiguous credentials" in err.value.details()
            one = (("authorization", f"Bearer {token}"),)
            state = await stub.GetEnvironmentState(
                env_pb2.GetEnvironmentStateRequest(), metadata=one, timeout=T
            )
        assert state.train_position == 0  # the refused draws moved nothing
    finally:
        await running.close()


async def test_mutual_tls_and_token_on_the_env(creds: RunCredentials) -> None:
    running = await _env(SecuritySettings(**creds.security_table(mutual=True)))
    good = _client(creds)
    try:
        for wrong in ("", "not-the-token"):
            async with open_channel(running.address, security=_client(creds, token=wrong)) as channel:
                stub = env_pb2_grpc.EnvironmentServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=2), timeout=T)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in err.value.details()
                # probes need no token
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=ENV), timeout=T
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert await _position(running.address, good) == 0  # the refused draws moved nothing

        async with open_channel(running.address, security=good) as channel:
            draw = await env_pb2_grpc.EnvironmentServiceStub(channel).SamplePrompts(
                env_pb2.SamplePromptsRequest(n=2), timeout=T
            )
        assert len(draw.prompts) == 2 and await _position(running.address, good) == 2

        # our client maps the status to a domain error that says what to fix
        client = GrpcClient(
            running.address, env_pb2_grpc.EnvironmentServiceStub, security=_client(creds, token="x")
        )
        with pytest.raises(Unauthenticated, match="UNAUTHENTICATED"):
            await client.unary("SamplePrompts", env_pb2.SamplePromptsRequest(n=1), T)
        await client.close()

        # mutual TLS: no client certificate, or trusting another CA → no connection at all
        other = issue(creds.directory.parent / "other-ca")
        for security in (_client(creds, cert=False), _client(creds, ca=other.ca)):
            async with open_channel(running.address, security=security) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=ENV), timeout=5
                    )
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # a plaintext client cannot talk to a TLS port
        plain = ClientSecurity(token=creds.token.read_text().strip())
        async with open_channel(running.address, security=plain) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await env_pb2_grpc.EnvironmentServiceStub(channel).GetEnvironmentState(
                    env_pb2.GetEnvironmentStateRequest(), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.close()


async def test_tls_without_client_certificates_serves_any_client_with_the_token(
    creds: RunCredentials,
) -> None:
    running = await _env(SecuritySettings(**creds.security_table(mutual=False)))
    try:
        assert await _position(running.address, _client(creds, cert=False)) == 0
    finally:
        await running.close()


async def test_a_train_step_with_a_wrong_token_changes_nothing(
    creds: RunCredentials, tiny_model_dir: Path
) -> None:
    settings = LearnerSettings(
        model=str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        port=0,
        security=SecuritySettings(**creds.security_table(mutual=True)),
    )
    running = await start_server(LearnerApp(settings), settings)
    try:
        async with open_channel(running.address, security=_client(creds, token="wrong")) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await learner_pb2_grpc.LearnerServiceStub(channel).TrainStep(
                    learner_pb2.TrainStepRequest(), timeout=T
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # checked before decoding
        async with open_channel(running.address, security=_client(creds)) as channel:
            stub = learner_pb2_grpc.LearnerServiceStub(channel)
            state = await stub.GetLearnerState(learner_pb2.GetLearnerStateRequest(), timeout=T)
            assert (state.step, state.weight_version) == (0, 0)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # with the token it reaches validation
                await stub.TrainStep(learner_pb2.TrainStepRequest(), timeout=T)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:  # streaming calls carry the token too
                async for _ in stub.FetchWeights(learner_pb2.FetchWeightsRequest(version=99), timeout=T):
                    pass
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await running.close()


def test_settings_refuse_half_configurations(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        SecuritySettings(tls_cert=tmp_path / "a.pem")
    with pytest.raises(ValueError, match="require_client_cert needs"):
        SecuritySettings(require_client_cert=True)
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        SecuritySettings(token_file=empty).token()
