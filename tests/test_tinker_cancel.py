"""``cancel_future``, and samples asking for the SDK's logprob options, across a SIGKILL.

The SDK cancels a sample it abandoned. A sample not answered yet is answered as cancelled (a
``user`` failure naming it), written durably before anyone can see it, and is not run when its
turn comes; one answered already keeps its answer; a training call is refused (it holds its
place in its model's order); an unknown request is 404. Across a SIGKILL, a cancelled sample
still answers cancelled and every other sample (with its top-k and prompt logprobs) answers
what an uninterrupted server gives.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import httpx
import pytest
from test_tinker_restart import TinkerServeProcess
from tinker_loops import RawFront, tinker_server

from trainwire.testing import free_port

CANCELLED = "cancelled by its client"


def sampler_of(front: RawFront) -> tuple[str, str]:
    """A new session's model and a sampling session on the base model: (model id, sampler)."""
    session_id, model_id = front.model()
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "llama"}
    sampler = front.post("create_sampling_session", body).json()["sampling_session_id"]
    return model_id, sampler


def sample(front: RawFront, sampler: str, seq_id: int, max_tokens: int = 3) -> str:
    """A sample asking for the SDK's logprob options too: every answered one is compared with
    an uninterrupted server's bytes, options included."""
    body = {
        "sampling_session_id": sampler,
        "seq_id": seq_id,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]},
        "sampling_params": {"max_tokens": max_tokens, "seed": seq_id, "temperature": 1.0},
        "prompt_logprobs": True,
        "prompt_logprobs_last_n": 2,
        "topk_prompt_logprobs": 2,
        "topk_sample_logprobs": 3,
    }
    answer = front.post("asample", body)
    assert answer.status_code == 200, answer.text
    return answer.json()["request_id"]


def cancel(front: RawFront, request_id: str) -> httpx.Response:
    return front.post("cancel_future", {"request_id": request_id})


def test_a_queued_sample_cancelled_is_answered_so_and_never_runs(
    tmp_path: Path, model_root: Path, tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with tinker_server(tmp_path / "state", model_root) as handle:
        front = RawFront(handle.tinker.base_url)
        model_id, sampler = sampler_of(front)
        answered = sample(front, sampler, 1)
        result = front.poll(answered).content  # the samples, as protobuf
        # Hold the order: an ordered job of a stream of the test's own runs until released, and
        # the sample taken behind it waits for it.
        order, release, running = (
            handle.tinker.front.intake.scheduler,
            threading.Event(),
            threading.Event(),
        )
        order.start_stream("test-hold", 1)
        order.submit("test-hold", 1, "hold", lambda: (running.set(), release.wait(60)))
        assert running.wait(30)
        queued = sample(front, sampler, 2)
        with caplog.at_level(logging.DEBUG, logger="trainwire.server.service.intake"):
            assert cancel(front, queued).json() == {"type": "cancel_future", "cancelled": True}
            failure = front.poll(queued).json()
            assert failure["category"] == "user" and CANCELLED in failure["error"]
            release.set()
            later = sample(front, sampler, 3)  # runs after the cancelled one's turn
            assert "protobuf" in front.poll(later).headers["content-type"]
        assert f"{queued} not run: answered before its turn" in caplog.text
        assert cancel(front, queued).json()["cancelled"] is False  # cancelled once
        assert cancel(front, answered).json()["cancelled"] is False  # its answer stands
        assert front.poll(answered).content == result
        step = front.forward_backward(model_id, 1)
        training = cancel(front, step.json()["request_id"])
        assert training.status_code == 400 and "only samples can be cancelled" in training.text
        unknown = cancel(front, f"{sampler}/99")
        assert unknown.status_code == 404


def sampled(front: RawFront, request_ids: list[str]) -> list[bytes]:
    """Each request's answer as it came: its samples (protobuf) or its failure (JSON)."""
    return [front.poll(request_id).content for request_id in request_ids]


@pytest.mark.slow
def test_cancelled_samples_stay_cancelled_across_a_sigkill_and_the_rest_answer_as_uninterrupted(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Thirty samples sent at once, the last ten cancelled at once (each answered cancelled, or
    already sampled), then the server SIGKILLed and restarted on its port: every cancelled one
    answers cancelled, every other one the samples of a server never killed nor cancelled. The
    last ten decode long and are cancelled last sent first, so on a machine however busy at
    least the last one is cancelled before its samples end."""
    count, cancelled_from = 30, 20

    def max_tokens(seq: int) -> int:
        return 16 if seq <= cancelled_from else 240

    plain_dir, crash_dir = tmp_path / "plain", tmp_path / "crash"
    plain_dir.mkdir(), crash_dir.mkdir()
    started: list[TinkerServeProcess] = []
    try:
        port = free_port()
        started.append(TinkerServeProcess(plain_dir, plain_dir / "state", model_root, port, "p"))
        plain = RawFront(f"http://127.0.0.1:{port}")
        _, sampler = sampler_of(plain)
        sent = [sample(plain, sampler, seq, max_tokens(seq)) for seq in range(1, count + 1)]
        expected = sampled(plain, sent)

        port = free_port()
        state_dir = crash_dir / "state"
        started.append(TinkerServeProcess(crash_dir, state_dir, model_root, port, "first"))
        front = RawFront(f"http://127.0.0.1:{port}")
        _, sampler = sampler_of(front)
        sent = [sample(front, sampler, seq, max_tokens(seq)) for seq in range(1, count + 1)]
        last_ten = reversed(sent[cancelled_from:])
        cancelled = [r for r in last_ten if cancel(front, r).json()["cancelled"]]
        assert cancelled, "every sample ran before its cancel: send more, or longer ones"
        started[-1].kill()
        started.append(TinkerServeProcess(crash_dir, state_dir, model_root, port, "second"))
        for request_id, answer, plain_answer in zip(
            sent, sampled(front, sent), expected, strict=True
        ):
            if request_id in cancelled:
                assert CANCELLED.encode() in answer, answer
            else:
                assert answer == plain_answer, request_id
    finally:
        for process in started:
            process.kill()
