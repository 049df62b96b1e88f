"""``SessionClient``: a remote training session, one method per operation, torch-free.

A failed call raises trainwire's own ``SessionError`` (a ``grpc.RpcError``, so ``.code()`` is the
status) whose message is one line: the reason and the status. Calls are retried with backoff on
UNAVAILABLE and DEADLINE_EXCEEDED, which is safe: state-changing calls carry their operation key,
and the server answers a key it has applied from its journal. A target no server ever answered
at (nothing listens, the name does not resolve, it does not speak gRPC) is not retried: it
raises ``ServerUnreachable`` at once, saying what was tried and what to check.

``close()`` closes the *session* on the server (the Close call); ``close_channel()``, or leaving a
``with SessionClient(...)`` block, only closes this client's connection.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainwire.client.session.downloads import DownloadError, receive_export
from trainwire.client.session.errors import (
    PROBE_TIMEOUT_S,
    STARTUP_GRACE_S,
    ServerUnreachable,
    SessionError,
    Unreachable,
    check_target,
    unreachable,
)
from trainwire.client.session.pipeline import OperationPipeline
from trainwire.client.session.retry import RETRYABLE_CODES, RetryPolicy, call_with_retry
from trainwire.contract import chunks, codec, outcomes
from trainwire.contract.config import TrainingConfig, canonical_json
from trainwire.contract.files import Pem, read_pem
from trainwire.contract.tokens import DEFAULT_LOSS, Examples
from trainwire.v1 import session_pb2 as pb
from trainwire.v1 import session_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
MAX_RECEIVE_BYTES = 64 * 1024 * 1024
EXPORT_METHOD = "/trainwire.v1.TrainingSessionService/ExportWeights"
DEFAULT_MAX_IN_FLIGHT = 4
T = TypeVar("T")
P = ParamSpec("P")

__all__ = ["DownloadError", "ServerUnreachable", "SessionClient", "SessionError"]


def _after_pipelined_calls(
    method: Callable[Concatenate[SessionClient, P], T],
) -> Callable[Concatenate[SessionClient, P], T]:
    """A keyed call made directly: it runs after the pipelined calls issued before it, and the
    pipeline numbers the next one from the server again, since this call moved the session
    (``OperationPipeline.out_of_band``). The pipeline itself runs the undecorated method
    (``__wrapped__``): that is the call alone, which must not wait for the pipeline it is in."""

    @functools.wraps(method)
    def ordered(self: SessionClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._pipeline.out_of_band(lambda: method(self, *args, **kwargs))

    return ordered


class SessionClient:
    """Drives the training session of the server at ``target`` (``HOST:PORT``).

    Args:
        target: the server's address, ``HOST:PORT`` (a URL or a host without a port is
            refused with ``InvalidTarget``, a ``ValueError``).
        token: the bearer token, when the server requires one.
        root_certificates: PEM (bytes or a file path) to verify a TLS server; giving it (or a
            client certificate) makes the connection TLS.
        private_key, certificate_chain: this client's PEM key and certificate, for mutual TLS.
        server_name: the name to verify in the server's certificate, if not the target's host.
        timeout_s: the deadline of each attempt.
        max_attempts: tries per call on UNAVAILABLE / DEADLINE_EXCEEDED (``retry`` overrides it).
        retry: the full backoff policy.
        max_in_flight: pipelined calls (``*_async``) on the wire at once.
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
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        check_target(target)
        self.target = target
        self.timeout_s = timeout_s
        # Whether a server ever answered here: only then is an UNAVAILABLE worth retrying.
        self.reached = False
        self.retry = retry or RetryPolicy(max_attempts=max_attempts)
        options = [
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            # Keepalive pings notice a dead server during a long export stream, which has no
            # overall deadline (a large model takes as long as it takes).
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            # Reconnect within seconds of a server coming back (gRPC's default backoff grows to
            # two minutes), so neither a restart nor a server that just started waits on it.
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 5_000),
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
        self._pipeline = OperationPipeline(max_in_flight, lambda: self.info().position)
        # The run this client is bound to (``open``): every call names it, so a call never
        # lands on another run (one opened after it closed, or beside it on a server of many).
        # "" before ``open``: the server's only open run.
        self.run_id = ""

    # -- connection ------------------------------------------------------------------------------

    def close_channel(self) -> None:
        """Close this client's connection; the server's session stays as it is."""
        self._pipeline.close()
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
                self.reached = True
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as error:
                if error.code() not in RETRYABLE_CODES:
                    raise SessionError.from_rpc_error(error) from None
            if time.monotonic() + poll_s > deadline:
                raise TimeoutError(f"{self.target} was not SERVING within {timeout_s:.0f}s")
            time.sleep(poll_s)

    def _call(self, what: str, method: Any, request: Any) -> Any:
        request = self._for_the_run(request)
        return self._retried(
            what, lambda: method(request, timeout=self.timeout_s, metadata=self._metadata)
        )

    def _for_the_run(self, request: Any) -> Any:
        """``request`` naming the run this client is bound to, if it names none itself."""
        names_runs = "run_id" in type(request).DESCRIPTOR.fields_by_name
        if self.run_id and names_runs and not request.run_id:
            request.run_id = self.run_id
        return request

    def _retried(self, what: str, attempt: Callable[[], T]) -> T:
        """``attempt()`` with the retry policy; a failure raised as trainwire's own, in one line
        and without grpc's traceback chained to it."""

        def noting_the_server() -> T:
            try:
                result = attempt()
            except grpc.RpcError as error:
                self._note_failure(error)
                raise
            self.reached = True
            return result

        try:
            return call_with_retry(noting_the_server, self.retry, what=f"{self.target} {what}")
        except grpc.RpcError as error:
            raise SessionError.from_rpc_error(error) from None

    def _note_failure(self, error: grpc.RpcError) -> None:
        """Tell a server that answered from a target where none ever did: the latter raises
        ``ServerUnreachable`` (never retried); an UNAVAILABLE over a working connection (a
        server restoring, say) marks the server reached, as any other status does."""
        code = error.code()
        if self.reached or code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return
        if code != grpc.StatusCode.UNAVAILABLE:
            self.reached = True
            return
        found = unreachable(self.target)
        if found is not None and found.refused:
            found = self._wait_for_listener(found)
        if found is None and self._answers_health():
            self.reached = True
            return
        raise ServerUnreachable(
            self.target,
            found.reason
            if found is not None
            else "something accepts connections there but does not answer gRPC (an HTTP server "
            "such as the Tinker front's --tinker-listen port, or TLS on one side only)",
        ) from None

    def _wait_for_listener(self, refused: Unreachable) -> Unreachable | None:
        """A port nobody listens on yet, given ``STARTUP_GRACE_S`` to open (a server started a
        moment ago); what stands in the way once it has passed, None when it opened."""
        logger.warning(
            "nothing listens at %s yet (connection refused); waiting up to %.0fs for a server "
            "to start there",
            self.target,
            STARTUP_GRACE_S,
        )
        deadline = time.monotonic() + STARTUP_GRACE_S
        found: Unreachable | None = refused
        while found is not None and found.refused and time.monotonic() < deadline:
            time.sleep(0.2)
            found = unreachable(self.target)
        return found

    def _answers_health(self) -> bool:
        """Whether a gRPC server answers the health check here (any answer but UNAVAILABLE);
        waits for the connection (a listener that just opened) up to ``PROBE_TIMEOUT_S``."""
        health = health_pb2_grpc.HealthStub(self._channel)
        try:
            health.Check(
                health_pb2.HealthCheckRequest(),
                timeout=PROBE_TIMEOUT_S,
                metadata=self._metadata,
                wait_for_ready=True,
            )
        except grpc.RpcError as error:
            return error.code() not in RETRYABLE_CODES
        return True

    # -- the session -----------------------------------------------------------------------------

    def open(
        self,
        run_id: str,
        config: TrainingConfig | dict[str, Any],
        *,
        max_steps: int | None = None,
        plan_fingerprint: str = "",
    ) -> outcomes.OpenOutcome:
        """Open the session for ``run_id`` (idempotent for the same run, config, steps, plan);
        this client's later calls are for that run (``run_id``)."""
        data = config.to_dict() if isinstance(config, TrainingConfig) else config
        request = pb.OpenRequest(
            run_id=run_id,
            config_json=canonical_json(data).decode(),
            max_steps=max_steps or 0,
            plan_fingerprint=plan_fingerprint,
        )
        outcome = codec.open_outcome_from_proto(self._call("Open", self._stub.Open, request))
        self.run_id = run_id
        return outcome

    def info(self) -> outcomes.SessionInfo:
        """Where this client's run stands (a closed one's state is ``closed``); before
        ``open``, the server's."""
        response = self._call("Info", self._stub.Info, pb.InfoRequest())
        return codec.session_info_from_proto(response.info)

    def runs(self) -> list[outcomes.SessionInfo]:
        """The runs open on the server that this client's key may see."""
        response = self._call("ListRuns", self._stub.ListRuns, pb.ListRunsRequest())
        return [codec.session_info_from_proto(info) for info in response.runs]

    def forward(
        self,
        examples: Examples,
        *,
        loss_fn: str = DEFAULT_LOSS,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> outcomes.ForwardOutcome:
        """The batch loss, predictions (text classification) or, for ``TokenExample``s, every
        target's logprob and the loss's metrics; changes nothing."""
        request = pb.ForwardRequest(loss=codec.loss_spec_to_proto(loss_fn, loss_fn_config))
        codec.add_examples(request, examples)
        return codec.forward_from_proto(self._call("Forward", self._stub.Forward, request))

    @_after_pipelined_calls
    def forward_backward(
        self,
        examples: Examples,
        *,
        operation_key: str,
        loss_fn: str = DEFAULT_LOSS,
        loss_fn_config: Mapping[str, float] | None = None,
        expected_position: int | None = None,
        include_digest: bool = False,
    ) -> outcomes.ForwardBackwardOutcome:
        """One microbatch; the outcome has ``.loss`` and, for token examples, ``.logprobs``
        (before the update) and ``.metrics``. The key is bound to every field sent."""
        request = pb.ForwardBackwardRequest(
            operation=_operation(operation_key, expected_position, include_digest),
            loss=codec.loss_spec_to_proto(loss_fn, loss_fn_config),
        )
        codec.add_examples(request, examples)
        response = self._call("ForwardBackward", self._stub.ForwardBackward, request)
        return codec.forward_backward_from_proto(response)

    @_after_pipelined_calls
    def optim_step(
        self,
        *,
        operation_key: str,
        learning_rate: float | None = None,
        expected_position: int | None = None,
        include_digest: bool = False,
    ) -> outcomes.OptimStepOutcome:
        """One update, at the schedule's rate or at ``learning_rate`` for this update."""
        operation = _operation(operation_key, expected_position, include_digest)
        request = pb.OptimStepRequest(operation=operation, learning_rate=learning_rate)
        response = self._call("OptimStep", self._stub.OptimStep, request)
        return codec.optim_step_from_proto(response)

    # -- pipelined calls -------------------------------------------------------------------------

    def forward_backward_async(
        self, examples: Examples, *, expected_position: int | None = None, **options: Any
    ) -> futures.Future[outcomes.ForwardBackwardOutcome]:
        """``forward_backward`` without waiting: a Future of its outcome.

        Calls issued in order apply in that order (each carries the position it will have: the
        given ``expected_position``, else the one after the previous pipelined call's), at most
        ``max_in_flight`` on the wire; each applies exactly once under its key.
        """
        return self._pipelined(
            SessionClient.forward_backward, (examples,), expected_position, options
        )

    def optim_step_async(
        self, *, expected_position: int | None = None, **options: Any
    ) -> futures.Future[outcomes.OptimStepOutcome]:
        """``optim_step`` without waiting, ordered like ``forward_backward_async``."""
        return self._pipelined(SessionClient.optim_step, (), expected_position, options)

    def drain(self) -> None:
        """Wait for every pipelined call issued so far."""
        self._pipeline.drain()

    def _pipelined(
        self,
        method: Callable[..., T],
        args: tuple[Any, ...],
        expected_position: int | None,
        options: dict[str, Any],
    ) -> futures.Future[T]:
        """``method`` (an ``_after_pipelined_calls`` one) issued through the pipeline, which
        numbers it; what runs there is the call alone (``__wrapped__``)."""
        call = method.__wrapped__  # type: ignore[attr-defined]
        return self._pipeline.submit(
            lambda position: call(self, *args, expected_position=position, **options),
            expected_position,
        )

    def sample(
        self,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: int,
        num_samples: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_tokens: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        seed: int = 0,
    ) -> list[outcomes.Sample]:
        """Continuations from the live weights, with the trainer's own logprobs (read-only).
        A sample also ends once its text contains one of ``stop_strings`` (its tokens keep the
        string's)."""
        if isinstance(stop_strings, str):  # list() would split it into characters
            raise TypeError("stop_strings is a list of strings; wrap the one given")
        request = codec.sample_request_to_proto(
            prompt_tokens,
            max_tokens=max_tokens,
            num_samples=num_samples,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_tokens=stop_tokens,
            stop_strings=stop_strings,
            seed=seed,
        )
        return codec.samples_from_proto(self._call("Sample", self._stub.Sample, request))

    def tokenize(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, with the server's tokenizer (no model copy needed here)."""
        request = pb.TokenizeRequest(texts=list(texts), add_special_tokens=add_special_tokens)
        response = self._call("Tokenize", self._stub.Tokenize, request)
        return codec.token_lists_from_proto(response.token_lists)

    def detokenize(self, token_lists: Sequence[Sequence[int]]) -> list[str]:
        """Each id list back into text, with the server's tokenizer."""
        request = pb.DetokenizeRequest(token_lists=codec.token_lists_to_proto(token_lists))
        return list(self._call("Detokenize", self._stub.Detokenize, request).texts)

    @_after_pipelined_calls
    def save_state(
        self, name: str, *, operation_key: str, expected_position: int | None = None
    ) -> outcomes.CheckpointOutcome:
        """Write checkpoint ``name`` on the server; the outcome always carries the digest."""
        operation = _operation(operation_key, expected_position, False)
        request = pb.SaveStateRequest(operation=operation, name=name)
        return codec.save_state_from_proto(self._call("SaveState", self._stub.SaveState, request))

    @_after_pipelined_calls
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
        return codec.load_state_from_proto(response, name)

    @_after_pipelined_calls
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
            **codec.weights_source_to_proto(outcomes.WeightsSource.parse(source)),
        )
        response = self._call("LoadWeights", self._stub.LoadWeights, request)
        return codec.load_weights_from_proto(response)

    @_after_pipelined_calls
    def export_weights(
        self,
        name: str,
        *,
        operation_key: str,
        expected_position: int | None = None,
        download_to: str | Path | None = None,
        replace: bool = False,
        checkpoint: str | None = None,
        include_digest: bool = False,
    ) -> outcomes.ExportOutcome:
        """Write export ``name`` on the server (from ``checkpoint``'s weights when given).

        With ``download_to`` (a new or empty directory, or any with ``replace=True``), the files
        are streamed there and swapped in atomically once every file's sha256 checked out (else
        ``DownloadError``, nothing kept).
        """
        request = pb.ExportWeightsRequest(
            operation=_operation(operation_key, expected_position, include_digest),
            name=name,
            download=download_to is not None,
            checkpoint=checkpoint or "",
        )

        request = self._for_the_run(request)

        def attempt() -> outcomes.ExportOutcome:
            stream = self._export_stream(request, timeout=None, metadata=self._metadata)
            try:
                return receive_export(stream, download_to, replace=replace)
            finally:
                stream.cancel()  # a no-op once the stream has ended

        return self._retried("ExportWeights", attempt)

    def close(self, run_id: str | None = None) -> outcomes.SessionInfo:
        """Close the session on the server (idempotent); the connection stays usable.

        With ``run_id`` (by default the run this client opened), only that run: a no-op once it
        is closed, FAILED_PRECONDITION while another run is open (so a late retry never closes
        somebody else's run).
        """
        request = pb.CloseRequest(run_id=run_id or self.run_id)
        response = self._call("Close", self._stub.Close, request)
        return codec.session_info_from_proto(response.info)


def _operation(key: str, expected_position: int | None, include_digest: bool) -> pb.Operation:
    return codec.operation_to_proto(outcomes.OperationSpec(key, expected_position, include_digest))
