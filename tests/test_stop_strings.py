"""Stop strings: a sample ends once its decoded text contains one, keeping every token up to and
including the one that completes it (the Tinker SDK's convention), with the trainer's own
logprobs, the same bits in process, over gRPC and through the SDK, and bounded before any work."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from fresh_state import fresh_digest, fresh_server_info
from service_fixtures import connect, running_server
from test_bounds_tinker import start
from tinker import types
from tinker_loops import lora_training

from trainwire.client import LoraSettings, TokenExample
from trainwire.server.engine.sampling.params import SamplingLimits
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument
from trainwire.server.tinker import sample_codec

NO_DROPOUT_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


@pytest.fixture(scope="module")
def session(tiny_llama: Path) -> TrainingSession:
    from trainwire.client import TrainingConfig

    config = TrainingConfig(
        model=str(tiny_llama), lora=NO_DROPOUT_LORA, lr_scheduler="constant", max_length=64
    )
    return TrainingSession(config, device="cpu")


def prompt_of(session: TrainingSession) -> list[int]:
    return session.tokenize(["the movie was"])[0]


def spanning_stop(session: TrainingSession, tokens: tuple[int, ...]) -> tuple[str, int]:
    """A stop string whose text starts inside one sampled token and ends inside the next, and
    how many tokens the sample keeps when it stops on it (its first occurrence)."""
    decode = session.tokenizer.decode
    for index in range(len(tokens) - 1):
        first, second = decode([tokens[index]]), decode([tokens[index + 1]])
        if len(first.strip()) < 2 or len(second.strip()) < 2 or "\ufffd" in first + second:
            continue
        stop = first[-2:] + second[:2]
        for end in range(1, len(tokens) + 1):
            if stop in decode(list(tokens[:end])):
                if end == index + 2:
                    return stop, end
                break
    raise AssertionError(f"no two neighbouring tokens of {tokens} to span")


def forward_logprobs(session: TrainingSession, prompt: list[int], tokens) -> list[float]:
    full = [*prompt, *tokens]
    example = TokenExample(tuple(full[:-1]), tuple(full[1:]))
    return session.forward([example]).logprobs[0][-len(tokens) :]


def test_a_stop_string_spanning_two_tokens_ends_the_sample_on_the_second(session):
    prompt = prompt_of(session)
    (free,) = session.sample(prompt, max_tokens=20, temperature=0)
    stop, kept = spanning_stop(session, free.tokens)
    before = fresh_digest(session)
    (stopped,) = session.sample(prompt, max_tokens=20, temperature=0, stop_strings=[stop])
    assert stopped.tokens == free.tokens[:kept]
    assert stopped.stop_reason == "stop"
    assert stop in session.tokenizer.decode(list(stopped.tokens))
    assert stop not in session.tokenizer.decode(list(stopped.tokens[:-1]))
    # The forward of this sample alone (the contract), not the longer sample's prefix: a forward
    # over fewer positions may round otherwise in its last bits on some CPUs.
    assert list(stopped.logprobs) == forward_logprobs(session, prompt, stopped.tokens)
    assert fresh_digest(session) == before


def test_a_stop_string_never_reached_ends_by_length(session):
    prompt = prompt_of(session)
    (free,) = session.sample(prompt, max_tokens=12, temperature=0)
    (same,) = session.sample(
        prompt, max_tokens=12, temperature=0, stop_strings=["never \u00e9crit ici", "zzzzqq"]
    )
    assert same == free
    assert same.stop_reason == "length"


def test_stop_strings_are_deterministic_and_each_row_stops_on_its_own(session):
    prompt = prompt_of(session)
    options = {"max_tokens": 16, "num_samples": 6, "temperature": 1.0, "seed": 11}
    free = session.sample(prompt, **options)
    common = session.tokenizer.decode([free[0].tokens[1]])  # a piece some rows hold
    stops = [common.strip() or common]
    first = session.sample(prompt, stop_strings=stops, **options)
    assert first == session.sample(prompt, stop_strings=stops, **options)
    for drawn, stopped in zip(free, first, strict=True):
        # Rows draw at every step whoever stopped: each stopped row is its free row's prefix.
        assert drawn.tokens[: len(stopped.tokens)] == stopped.tokens
        text = session.tokenizer.decode(list(stopped.tokens))
        assert (stopped.stop_reason == "stop") == any(s in text for s in stops)
        assert list(stopped.logprobs) == forward_logprobs(session, prompt, stopped.tokens)
    assert any(s.stop_reason == "stop" for s in first)


@pytest.mark.parametrize(
    ("stop_strings", "message"),
    [
        ([""], r"stop_strings\[0\] is empty"),
        (["ok", 7], r"stop_strings\[1\] must be a string, got int"),
        (["x" * 257], r"stop_strings\[0\] has 257 characters; the limit is 256"),
        (["a"] * 33, "33 stop_strings; the limit is 32"),
        ("one", "stop_strings is a list of strings"),
    ],
)
def test_bad_stop_strings_are_refused_before_any_work(session, stop_strings, message):
    before = fresh_digest(session)
    with pytest.raises(InvalidArgument, match=message):
        session.sample(prompt_of(session), max_tokens=4, stop_strings=stop_strings)
    assert fresh_digest(session) == before


def test_the_fronts_stop_string_bounds_are_the_engines():
    limits = SamplingLimits()
    assert limits.max_stop_strings == sample_codec.MAX_STOP_STRINGS
    assert limits.max_stop_string_chars == sample_codec.MAX_STOP_STRING_CHARS


def test_remote_stop_string_samples_equal_in_process_ones(tmp_path, model_root, session):
    prompt = prompt_of(session)
    (free,) = session.sample(prompt, max_tokens=20, temperature=0)
    stop, _ = spanning_stop(session, free.tokens)
    options = {"max_tokens": 20, "num_samples": 3, "temperature": 0.9, "seed": 4}
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle)
        client.open("stops", session.config)
        state = fresh_server_info(handle)  # samples and their refusals change nothing
        for stops in ([stop], ["never reached"]):
            got = client.sample(prompt, stop_strings=stops, **options)
            assert got == session.sample(prompt, stop_strings=stops, **options)
        greedy = client.sample(prompt, max_tokens=20, temperature=0, stop_strings=[stop])
        assert greedy[0].stop_reason == "stop"
        with pytest.raises(grpc.RpcError) as refused:
            client.sample(prompt, max_tokens=4, stop_strings=["x" * 300])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the limit is 256" in refused.value.details()
        assert fresh_server_info(handle) == state
        client.close_channel()


def test_the_sdks_asample_with_stop_strings_ends_on_them(tmp_path, model_root, tiny_llama):
    with lora_training(tmp_path / "state", model_root) as run:
        sampler = run.training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(run.tokenizer.encode("the movie was"))
        free_params = types.SamplingParams(max_tokens=20, temperature=0.0)
        (free,) = sampler.sample(prompt, 1, free_params).result(timeout=60).sequences
        decode = run.tokenizer.decode
        stop = next(
            decode([token]).strip()
            for token in free.tokens[2:]
            if len(decode([token]).strip()) > 1 and "\ufffd" not in decode([token])
        )
        for given in (stop, [stop, "never reached"]):
            params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=given)
            (stopped,) = sampler.sample(prompt, 1, params).result(timeout=60).sequences
            assert stopped.stop_reason == "stop"
            assert stopped.tokens == free.tokens[: len(stopped.tokens)]
            assert decode(stopped.tokens).count(stop) == 1  # the response splits into two
            assert stop not in decode(stopped.tokens[:-1])
            assert len(stopped.logprobs) == len(stopped.tokens)  # the values: the engine tests


def test_an_asample_with_bad_stop_strings_is_a_400_and_is_never_logged(
    tmp_path, model_root, tiny_llama
):
    with start(tmp_path / "state", model_root) as front:
        for stop, message in (
            (["x" * 257], "sampling_params.stop[0] has 257 characters; at most 256"),
            (["a"] * 33, "33 stop strings; at most 32"),
            ([""], "sampling_params.stop[0] is an empty string"),
            (["a", 5], "all strings or all token ids"),
        ):
            before = front.log_bytes()
            response = front.sample(7, sampling_params={"stop": stop})
            assert response.status_code == 400, response.text
            assert message in response.json()["detail"]
            assert front.log_bytes() == before
        served = front.sample(8, sampling_params={"stop": ["\n\nUser:"]})
        assert served.status_code == 200, served.text
        assert front.result(served.json()["request_id"]).status_code == 200
