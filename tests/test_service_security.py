"""Bearer tokens, TLS and mutual TLS, with certificates made in the test (cryptography)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_fixtures import NO_RETRY, running_server

from trainwire.client import SessionClient
from trainwire.contract import outcomes
from trainwire.server import serve

TOKEN = "0123456789abcdef"


@dataclass(frozen=True)
class Issued:
    cert: bytes
    key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


Authority = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def issue(
    common_name: str, *, ca: Authority | None, server: bool = False
) -> tuple[Issued, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``common_name`` signed by ``ca`` (self-signed CA when None)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_cert, issuer_key = ca if ca else (None, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer_cert.subject if issuer_cert else _name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        usage = [ExtendedKeyUsageOID.SERVER_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    elif ca is not None:
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), pem_key), cert, key


@pytest.fixture(scope="module")
def pki():
    ca, ca_cert, ca_key = issue("trainwire test CA", ca=None)
    server, _, _ = issue("localhost", ca=(ca_cert, ca_key), server=True)
    client, _, _ = issue("controller", ca=(ca_cert, ca_key))
    _, rogue_cert, rogue_key = issue("rogue CA", ca=None)
    rogue_client, _, _ = issue("intruder", ca=(rogue_cert, rogue_key))
    return {"ca": ca, "server": server, "client": client, "rogue_client": rogue_client}


def target(handle) -> str:
    return f"localhost:{handle.port}"


def test_a_token_is_required_on_every_call_but_health(tmp_path, model_root):
    with running_server(tmp_path / "state", model_root, token=TOKEN) as handle:
        channel = grpc.insecure_channel(target(handle))
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        channel.close()
        for token, code in [(None, "UNAUTHENTICATED"), ("wrong", "UNAUTHENTICATED")]:
            with SessionClient(target(handle), token=token, retry=NO_RETRY) as client:
                with pytest.raises(grpc.RpcError) as refused:
                    client.info()
                assert refused.value.code().name == code
        with SessionClient(target(handle), token=TOKEN, retry=NO_RETRY) as client:
            assert client.info().state == outcomes.IDLE


def test_tls_serves_a_verifying_client_and_refuses_a_plaintext_one(tmp_path, model_root, pki):
    server = pki["server"]
    with running_server(
        tmp_path / "state", model_root, token=TOKEN, tls_cert=server.cert, tls_key=server.key
    ) as handle:
        with SessionClient(
            target(handle), token=TOKEN, root_certificates=pki["ca"].cert, retry=NO_RETRY
        ) as client:
            assert client.info().state == outcomes.IDLE
        with SessionClient(
            f"127.0.0.1:{handle.port}",
            token=TOKEN,
            root_certificates=pki["ca"].cert,
            retry=NO_RETRY,
        ) as by_ip:  # the certificate names 127.0.0.1 too
            assert by_ip.info().state == outcomes.IDLE
        with SessionClient(target(handle), token=TOKEN, retry=NO_RETRY, timeout_s=5) as plain:
            with pytest.raises(grpc.RpcError) as refused:
                plain.info()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_trusted_ca(tmp_path, model_root, pki):
    server, ca = pki["server"], pki["ca"]
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.cert)  # the server also takes files
    with running_server(
        tmp_path / "state",
        model_root,
        tls_cert=server.cert,
        tls_key=server.key,
        tls_client_ca=ca_file,
    ) as handle:

        def client_with(issued: Issued | None) -> SessionClient:
            return SessionClient(
                target(handle),
                root_certificates=ca.cert,
                private_key=issued and issued.key,
                certificate_chain=issued and issued.cert,
                retry=NO_RETRY,
                timeout_s=5,
            )

        with client_with(pki["client"]) as trusted:
            assert trusted.info().state == outcomes.IDLE
        for untrusted in (None, pki["rogue_client"]):
            with client_with(untrusted) as client, pytest.raises(grpc.RpcError) as refused:
                client.info()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_settings_are_checked_before_serving(tmp_path, model_root, pki):
    with pytest.raises(ValueError, match="both a certificate and its key"):
        serve("127.0.0.1:0", tmp_path, model_root, tls_cert=pki["server"].cert)
    with pytest.raises(ValueError, match="need TLS"):
        serve("127.0.0.1:0", tmp_path, model_root, tls_client_ca=pki["ca"].cert)
