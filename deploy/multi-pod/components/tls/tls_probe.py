"""Kubelet exec probe for a trainwire worker that serves TLS.

    python tls_probe.py [PORT]      exit status 0 iff grpc.health.v1 says SERVING

The kubelet's native ``grpc`` probes speak plaintext only, so the ``tls`` component replaces them
with this script, mounted from a ConfigMap and run by the image's interpreter (``grpc`` and
``grpc_health`` are trainwire dependencies). It asks the standard health service on
127.0.0.1:PORT (default 50051) over TLS, with the files of the Secret trainwire-tls mounted in
TRAINWIRE_TLS_DIR (default /etc/trainwire/tls):

- the server is verified against ``ca.crt`` when the Secret has one, else against ``tls.crt``
  itself (a self-signed certificate);
- ``tls.crt``/``tls.key`` are offered as the client certificate, which a server started with
  ``--tls-client-ca`` accepts when that CA signed them (and a server without it ignores);
- the certificate must be valid for TRAINWIRE_TLS_SERVER_NAME, the pod's name in the headless
  Service, e.g. ``trainwire-worker-0.trainwire-workers.trainwire.svc``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    port = int(argv[1]) if len(argv) > 1 else 50051
    directory = Path(os.environ.get("TRAINWIRE_TLS_DIR", "/etc/trainwire/tls"))
    certificate = (directory / "tls.crt").read_bytes()
    ca = directory / "ca.crt"
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes() if ca.exists() else certificate,
        private_key=(directory / "tls.key").read_bytes(),
        certificate_chain=certificate,
    )
    options = []
    server_name = os.environ.get("TRAINWIRE_TLS_SERVER_NAME")
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.RpcError as error:
            print(f"health check failed: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
