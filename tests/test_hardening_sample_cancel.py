"""A sample whose caller gave up (its RPC cancelled) stops decoding at the next step instead of
running to ``max_tokens`` for nobody; a request decoding beside it gets the bits it gets alone,
and the server serves the next call."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from service_fixtures import connect, running_server, wait_for

from trainwire.contract import codec
from trainwire.server.engine.sampling import batch_decode
from trainwire.server.service.requests import SampleRequest
from trainwire.v1 import session_pb2_grpc as pb_grpc

MAX_TOKENS = 120
HELD_AT_STEP = 3


def test_a_cancelled_sample_stops_decoding_and_its_neighbour_keeps_its_bits(
    tmp_path, model_root, llama_config, monkeypatch
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle)
        client.open("run", llama_config(max_length=256))
        neighbour = {"max_tokens": 8, "num_samples": 2, "seed": 5, "temperature": 1.0}
        alone = client.sample([1, 2, 3], **neighbour)
        (full,) = client.sample([4, 5, 6], max_tokens=MAX_TOKENS, seed=1)
        assert len(full.tokens) == MAX_TOKENS  # uncancelled, it decodes every step

        # The real step, counted; the decode waits after step HELD_AT_STEP until released, so
        # the cancel lands while it is under way (wherever the clock is).
        steps, step = [0], batch_decode.BatchDecoder.step
        held, release = threading.Event(), threading.Event()

        def counted(decoder: batch_decode.BatchDecoder) -> None:
            step(decoder)
            steps[0] += 1
            if steps[0] == HELD_AT_STEP:
                held.set()
                assert release.wait(60)

        monkeypatch.setattr(batch_decode.BatchDecoder, "step", counted)
        stub = pb_grpc.TrainingSessionServiceStub(client._channel)
        settings = SampleRequest([4, 5, 6], MAX_TOKENS, seed=1).sampling_settings()
        call = stub.Sample.future(
            codec.sample_request_to_proto([4, 5, 6], **settings), metadata=client._metadata
        )
        assert held.wait(60)
        with ThreadPoolExecutor(1) as pool:
            beside = pool.submit(client.sample, [1, 2, 3], **neighbour)  # joins the decode
            scheduler = handle.session_host.scheduler  # the decode and the sample queued
            wait_for(lambda: scheduler.queued == 2, 60)
            call.cancel()
            assert call.code() == grpc.StatusCode.CANCELLED
            release.set()
            assert beside.result(timeout=60) == alone
        wait_for(lambda: not handle.session_host.scheduler.busy, 60)
        assert steps[0] < MAX_TOKENS // 2, f"{steps[0]} decode steps for a cancelled request"
        assert client.sample([1, 2, 3], **neighbour) == alone
        client.close()
