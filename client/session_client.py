"""``SessionClient``: a remote training session, one method per operation, torch-free.

A failed call raises the ``grpc.RpcError`` it received, so ``.code()`` is the status. Calls are
retried with backoff on UNAVAILABLE and DEADLINE_EXCEEDED, which is safe: state-changing calls
carry their operation key, and the server answers a key it has applied from its journal.

``close()`` closes the *session* on the server (the Close call); ``close_channel()``, or leaving a
``with SessionClient(...)`` block, only closes this client's connection.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainwire.client import chunks, outcomes, wire
from trainwire.client.config import InputExample, TrainingConfig, canonical_json
from trainwire.client.files import Pem, atomic_directory, read_pem
from trainwire.client.retry import RETRYABLE_CODES, RetryPolicy, call_with_retry
from trainwire.v1 import session_pb2 as pb
from trainwire.v1 import session_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
MAX_RECEIVE_BYTES = 64 * 1024 * 1024
EXPORT_METHOD = "/trainwire.v1.TrainingSessionService/ExportWeights"


class DownloadError(RuntimeError):
    """Downloaded export files do not match what the server recorded; nothing was kept."""


def parse_weights_source(source: str | outcomes.WeightsSource) -> outcomes.WeightsSource:
    """``checkpoint:NAME``, ``export:NAME``, ``model:PATH`` or a bare model path (model root)."""
    if isinstance(source, outcomes.WeightsSource):
        return source
    kind, sep, value = source.partition(":")
    if sep and kind in ("checkpoint", "export"):
        return outcomes.WeightsSource(kind, value)
    if sep and kind == "model":
        return outcomes.WeightsSource("model_path", value)
    return outcomes.WeightsSource("model_path", source)


class SessionClient:
    """Drives the training session of the server at ``target`` (``HOST:PORT``).

    Args:
        target: the server's address.
        token: the bearer token, when the server requires one.
        root_certificates: PEM (bytes or a file path) to verify a TLS server; giving it (or a
            client certificate) makes the connection TLS.
        private_key, certificate_chain: this client's PEM key and certificate, for mutual TLS.
        server_name: the name to verify in the server's certificate, if not the target's host.
        timeout_s: the deadline of each attempt.
        max_attempts: tries per call on UNAVAILABLE / DEADLINE_EXCEEDED (``retry`` overrides it).
        retry: the full backoff policy.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        root_certificates: Pem | None = None,
        private_key: Pem | None = None,
        certificate_chain: Pem | None = None,
        server_name: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_attempts: int = 5,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy(max_attempts=max_attempts)
        options = [
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            # Keepalive pings notice a dead server during a long export stream, which has no
            # overall deadline (a large model takes as long as it takes).
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 20_000),
        ]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if root_certificates is None and private_key is None and certificate_chain is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            credentials = grpc.ssl_channel_credentials(
                read_pem(root_certificates), read_pem(private_key), read_pem(certificate_chain)
            )
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._stub = pb_grpc.TrainingSessionServiceStub(self._channel)
        # The stub's ExportWeights, decoding chunks without copying them (chunks.RawChunk).
        self._export_stream = self._channel.unary_stream(
            EXPORT_METHOD,
            request_serializer=pb.ExportWeightsRequest.SerializeToString,
            response_deserializer=chunks.decode_export_item,
        )
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    # -- connection ------------------------------------------------------------------------------

    def close_channel(self) -> None:
        """Close this client's connection; the server's session stays as it is."""
        self._channel.close()

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_channel()

    def wait_until_serving(self, timeout_s: float = 60.0, poll_s: float = 0.1) -> None:
        """Block until the server's health is SERVING (it restores a session after a restart)."""
        health = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout_s
        while True:
            left_s = deadline - time.monotonic()
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=max(0.1, left_s))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as error:
                if error.code() not in RETRYABLE_CODES:
                    raise
            if time.monotonic() + poll_s > deadline:
                raise TimeoutError(f"{self.target} was not SERVING within {timeout_s:.0f}s")
            time.sleep(poll_s)

    def _call(self, what: str, method: Any, request: Any) -> Any:
        return call_with_retry(
            lambda: method(request, timeout=self.timeout_s, metadata=self._metadata),
            self.retry,
            what=f"{self.target} {what}",
        )

    # -- the session -----------------------------------------------------------------------------

    def open(
        self,
        run_id: str,
        config: TrainingConfig | dict[str, Any],
        *,
        max_steps: int | None = None,
        plan_fingerprint: str = "",
    ) -> outcomes.OpenOutcome:
        """Open the session for ``run_id`` (idempotent for the same run, config, steps, plan)."""
        data = config.to_dict() if isinstance(config, TrainingConfig) else config
        request = pb.OpenRequest(
            run_id=run_id,
            config_json=canonical_json(data).decode(),
            max_steps=max_steps or 0,
            plan_fingerprint=plan_fingerprint,
        )
        return wire.open_outcome_from_proto(self._call("Open", self._stub.Open, request))

    def info(self) -> outcomes.SessionInfo:
        response = self._call("Info", self._stub.Info, pb.InfoRequest())
        return wire.session_info_from_proto(response.info)

    def forward(self, examples: Sequence[InputExample]) -> outcomes.ForwardOutcome:
        """The batch loss and (classification) predictions; changes nothing."""
        request = pb.ForwardRequest(examples=wire.examples_to_proto(examples))
        return wire.forward_from_proto(self._call("Forward", self._stub.Forward, request))

    def forward_backward(
        self,
        examples: Sequence[InputExample],
        *,
        operation_key: str,
        expected_position: int | None = None,
        include_digest: bool = False,
    ) -> outcomes.ForwardBackwardOutcome:
        request = pb.ForwardBackwardRequest(
            operation=_operation(operation_key, expected_position, include_digest),
            examples=wire.examples_to_proto(examples),
        )
        response = self._call("ForwardBackward", self._stub.ForwardBackward, request)
        return wire.forward_backward_from_proto(response)

    def optim_step(
        self,
        *,
        operation_key: str,
        expected_position: int | None = None,
        include_digest: bool = False,
    ) -> outcomes.OptimStepOutcome:
        operation = _operation(operation_key, expected_position, include_digest)
        request = pb.OptimStepRequest(operation=operation)
        response = self._call("OptimStep", self._stub.OptimStep, request)
        return wire.optim_step_from_proto(response)

    def save_state(
        self, name: str, *, operation_key: str, expected_position: int | None = None
    ) -> outcomes.CheckpointOutcome:
        """Write checkpoint ``name`` on the server; the outcome always carries the digest."""
        operation = _operation(operation_key, expected_position, False)
        request = pb.SaveStateRequest(operation=operation, name=name)
        return wire.save_state_from_proto(self._call("SaveState", self._stub.SaveState, request))

    def load_state(
        self,
        name: str,
        *,
        operation_key: str,
        expected_position: int | None = None,
        include_digest: bool = False,
    ) -> outcomes.CheckpointOutcome:
        operation = _operation(operation_key, expected_position, include_digest)
        request = pb.LoadStateRequest(operation=operation, name=name)
        response = self._call("LoadState", self._stub.LoadState, request)
        return wire.load_state_from_proto(response, name)

    def load_weights(
        self,
        source: str | outcomes.WeightsSource,
        *,
        operation_key: str,
        expected_position: int | None = None,
        include_digest: bool = False,
    ) -> outcomes.OperationOutcome:
        """Copy weights from ``checkpoint:NAME``, ``export:NAME`` or a model path (model root)."""
        request = pb.LoadWeightsRequest(
            operation=_operation(operation_key, expected_position, include_digest),
            **wire.weights_source_to_proto(parse_weights_source(source)),
        )
        response = self._call("LoadWeights", self._stub.LoadWeights, request)
        return wire.load_weights_from_proto(response)

    def export_weights(
        self,
        name: str,
        *,
        operation_key: str,
        expected_position: int | None = None,
        download_to: str | Path | None = None,
        checkpoint: str | None = None,
        include_digest: bool = False,
    ) -> outcomes.ExportOutcome:
        """Write export ``name`` on the server (from ``checkpoint``'s weights when given).

        With ``download_to``, the files are streamed into that directory, which is replaced
        atomically once every file's sha256 checked out (else ``DownloadError``, nothing kept).
        """
        request = pb.ExportWeightsRequest(
            operation=_operation(operation_key, expected_position, include_digest),
            name=name,
            download=download_to is not None,
            checkpoint=checkpoint or "",
        )

        def attempt() -> outcomes.ExportOutcome:
            stream = self._export_stream(request, timeout=None, metadata=self._metadata)
            try:
                return _receive_export(stream, download_to)
            finally:
                stream.cancel()  # a no-op once the stream has ended

        return call_with_retry(attempt, self.retry, what=f"{self.target} ExportWeights")

    def close(self) -> outcomes.SessionInfo:
        """Close the session on the server (idempotent); the connection stays usable."""
        response = self._call("Close", self._stub.Close, pb.CloseRequest())
        return wire.session_info_from_proto(response.info)


def _operation(key: str, expected_position: int | None, include_digest: bool) -> pb.Operation:
    return wire.operation_to_proto(outcomes.OperationSpec(key, expected_position, include_digest))


ExportItem = pb.ExportWeightsResponse | chunks.RawChunk


def _receive_export(
    stream: Iterator[ExportItem], download_to: str | Path | None
) -> outcomes.ExportOutcome:
    first = next(stream)
    if isinstance(first, chunks.RawChunk) or first.WhichOneof("item") != "result":
        raise DownloadError("the export stream did not start with its result")
    outcome = wire.export_outcome_from_proto(first.result)
    if download_to is None:
        return outcome
    target = Path(download_to)
    with atomic_directory(target) as staging:
        _receive_files(stream, staging, outcome.files)
    return replace(outcome, directory=target)


class _IncomingFile:
    def __init__(self, staging: Path, path: str) -> None:
        self.path = path
        self.local = staging / _safe_relative(path)
        self.local.parent.mkdir(parents=True, exist_ok=True)
        self.handle: BinaryIO = open(self.local, "wb")  # noqa: SIM115 (closed by finish)
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, offset: int, data: memoryview) -> None:
        if offset != self.size:
            raise DownloadError(f"{self.path}: chunk at offset {offset}, expected {self.size}")
        self.handle.write(data)
        self.sha256.update(data)
        self.size += len(data)

    def finish(self, end: pb.FileEnd, recorded: outcomes.ExportedFile) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        got = (self.size, self.sha256.hexdigest())
        for what, expected in (("the stream", end), ("the export's record", recorded)):
            if got != (expected.size_bytes, expected.sha256):
                raise DownloadError(
                    f"{self.path}: received {got[0]} bytes with sha256 {got[1]}, but {what} says "
                    f"{expected.size_bytes} bytes with sha256 {expected.sha256}; export it again"
                )


def _pieces(stream: Iterator[ExportItem]) -> Iterator[chunks.RawChunk | pb.FileEnd]:
    """The stream's chunks (as ``RawChunk``) and file ends, after the result."""
    for item in stream:
        if isinstance(item, chunks.RawChunk):
            yield item
        elif item.WhichOneof("item") == "chunk":  # not one of our pre-encoded chunks
            yield chunks.RawChunk(item.chunk.path, item.chunk.offset, memoryview(item.chunk.data))
        elif item.WhichOneof("item") == "file_end":
            yield item.file_end
        else:
            raise DownloadError("the export stream sent a second result")


def _receive_files(
    stream: Iterator[ExportItem], staging: Path, files: Sequence[outcomes.ExportedFile]
) -> None:
    recorded = {file.path: file for file in files}
    received: list[str] = []
    current: _IncomingFile | None = None
    try:
        for piece in _pieces(stream):
            if piece.path not in recorded:
                raise DownloadError(f"the server sent {piece.path!r}, which the export lacks")
            if current is None or current.path != piece.path:
                if current is not None:
                    raise DownloadError(f"{current.path}: the stream moved on before its end")
                current = _IncomingFile(staging, piece.path)
            if isinstance(piece, chunks.RawChunk):
                current.write(piece.offset, piece.data)
            else:
                current.finish(piece, recorded[piece.path])
                received.append(piece.path)
                current = None
    finally:
        if current is not None:
            current.handle.close()
    missing = sorted(set(recorded) - set(received))
    if current is not None or missing:
        raise DownloadError(f"the download ended early; missing {missing}")


def _safe_relative(path: str) -> Path:
    relative = PurePosixPath(path)
    if not path or relative.is_absolute() or ".." in relative.parts or "\\" in path:
        raise DownloadError(f"the server sent an unsafe file path {path!r}")
    return Path(*relative.parts)
