"""The TLS probe (deploy/components/tls/tls_probe.py) that replaces the kubelet's plaintext gRPC
probes when the workers serve TLS: run for real against a TLS gRPC health server on loopback, with
and without client certificates, and refusing a server whose name does not match.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from deploy_files import TLS_PROBE, serving_health
from grpc_health.v1 import health_pb2


def issue_certificates(directory: Path, server_name: str) -> None:
    """A CA, and a server certificate for `server_name` signed by it, as a TLS Secret lays out."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject, key, issuer, issuer_key, extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate(
        "trainwire test CA", ca_key, "trainwire test CA", ca_key,
        [(x509.BasicConstraints(ca=True, path_length=None), True)],
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = certificate(
        server_name,
        key,
        "trainwire test CA",
        ca_key,
        [
            (x509.SubjectAlternativeName([x509.DNSName(server_name)]), False),
            (x509.BasicConstraints(ca=False, path_length=None), True),
        ],
    )
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (directory / "tls.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mutual-tls"])
def test_the_tls_probe_checks_health_over_tls(tmp_path, client_auth):
    pytest.importorskip("cryptography")
    server_name = "*.trainwire-workers.trainwire.svc"
    issue_certificates(tmp_path, server_name)
    credentials = grpc.ssl_server_credentials(
        [((tmp_path / "tls.key").read_bytes(), (tmp_path / "tls.crt").read_bytes())],
        root_certificates=(tmp_path / "ca.crt").read_bytes() if client_auth else None,
        require_client_auth=client_auth,
    )
    pod_name = "trainwire-worker-0.trainwire-workers.trainwire.svc"
    with serving_health(credentials) as (servicer, port):

        def probe(name: str) -> int:
            env = dict(os.environ, TRAINWIRE_TLS_DIR=str(tmp_path), TRAINWIRE_TLS_SERVER_NAME=name)
            command = [sys.executable, str(TLS_PROBE), str(port)]
            return subprocess.run(command, env=env, capture_output=True, timeout=60).returncode

        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe(pod_name) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe(pod_name) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe("trainwire-worker-0.elsewhere.svc") == 1, "the name is verified"


# ---- the kustomization, rendered ----------------------------------------------------------------
