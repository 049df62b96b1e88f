"""SDK loops for the Tinker front's tests, written the way Tinker's docs write them (only
``base_url`` and the key differ), and the server they run against."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import tinker
from tinker import types

from trainwire.server.process import ServerHandle, serve

KEY = "tml-trainwire-test-key"
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "birds sing in the morning"]


_OPEN_CLIENTS: dict[int, list[tinker.ServiceClient]] = {}  # per server handle


@contextlib.contextmanager
def tinker_server(state_dir: Path, model_root: Path, **options: Any) -> Iterator[ServerHandle]:
    """A server with the Tinker front, both ports keyed by ``KEY``; the SDK clients made by
    ``service_client`` are closed before it stops."""
    handle = serve(
        listen="127.0.0.1:0",
        state_dir=state_dir,
        model_root=model_root,
        device="cpu",
        token=KEY,
        tinker_listen="127.0.0.1:0",
        tinker_token=KEY,
        **options,
    )
    _OPEN_CLIENTS[id(handle)] = []
    try:
        yield handle
    finally:
        for client in _OPEN_CLIENTS.pop(id(handle)):
            close_quietly(client)
        handle.stop(grace=10)


def service_client(handle: ServerHandle, key: str = KEY) -> tinker.ServiceClient:
    client = tinker.ServiceClient(base_url=handle.tinker.base_url, api_key=key)
    _OPEN_CLIENTS[id(handle)].append(client)
    return client


def close_quietly(client: tinker.ServiceClient) -> None:
    """Stop a ServiceClient's heartbeats and retries (closing twice is harmless). A client left
    open retries against a stopped server, and the SDK's retry jitter draws from Python's global
    ``random``, which an in-process TrainingSession's RNG owns: later tests would lose their
    bit-equality."""
    with contextlib.suppress(Exception):
        client.close("success").result(timeout=30)


@dataclasses.dataclass(frozen=True)
class SdkRun:
    """A server and a rank-4 LoRA training client on the tiny llama, from the real SDK."""

    handle: ServerHandle
    service: tinker.ServiceClient
    training: Any  # tinker.TrainingClient
    tokenizer: Any


@contextlib.contextmanager
def lora_training(state_dir: Path, model_root: Path, **options: Any) -> Iterator[SdkRun]:
    with tinker_server(state_dir, model_root, **options) as handle:
        service = service_client(handle)
        training = service.create_lora_training_client(base_model="llama", rank=4).result()
        yield SdkRun(handle, service, training, training.get_tokenizer())


def supervised_datum(tokenizer: Any, text: str) -> types.Datum:
    tokens = tokenizer.encode(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def train_step(run: SdkRun, text: str, learning_rate: float = 5e-2) -> None:
    """One supervised forward_backward + optim_step on ``text``, awaited (bounded: a held call
    fails the test instead of hanging it)."""
    datum = supervised_datum(run.tokenizer, text)
    run.training.forward_backward([datum], "cross_entropy").result(timeout=60)
    run.training.optim_step(types.AdamParams(learning_rate=learning_rate)).result(timeout=60)


def supervised_loop(service: tinker.ServiceClient, steps: int = 4) -> list[float]:
    """The docs' SL loop: build data, forward_backward, optim_step, await, log the loss."""
    training_client = service.create_lora_training_client(base_model="llama", rank=4).result()
    tokenizer = training_client.get_tokenizer()
    data = [supervised_datum(tokenizer, text) for text in SENTENCES]
    losses = []
    for _ in range(steps):
        fwd_bwd_future = training_client.forward_backward(data, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fwd_bwd_future.result().metrics["loss:sum"])
        optim_future.result()
    return losses


def rl_step(
    training_client: Any, tokenizer: Any, loss_fn: str, seed: int = 0, group: int = 4
) -> tuple[list[list[float]], list[list[float]], float]:
    """One RL iteration as the docs write it: snapshot, sample a group, score, train.

    Returns the sampler's logprobs of each completion, the trainer's logprobs of the same
    tokens in the forward_backward, and the mean reward.
    """
    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.encode("the cat")
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
    result = sampling_client.sample(types.ModelInput.from_ints(prompt), group, params).result()
    rewards = [sum(t % 2 == 0 for t in seq.tokens) / len(seq.tokens) for seq in result.sequences]
    mean = sum(rewards) / len(rewards)
    data = []
    for seq, reward in zip(result.sequences, rewards, strict=True):
        full = prompt + seq.tokens
        n_prompt = len(prompt) - 1
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={
                    "target_tokens": full[1:],
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                    "advantages": [0.0] * n_prompt + [reward - mean] * len(seq.tokens),
                },
            )
        )
    fwd_bwd = training_client.forward_backward(data, loss_fn).result()
    training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained = [out["logprobs"].tolist()[len(prompt) - 1 :] for out in fwd_bwd.loss_fn_outputs]
    return [list(seq.logprobs) for seq in result.sequences], trained, mean


def forward_backward_body(model_id: str, seq_id: int, tokens: tuple[int, ...]) -> bytes:
    """The protobuf body the SDK sends for a one-datum cross-entropy ``forward_backward``."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens[:-1])),
        loss_fn_inputs={"target_tokens": list(tokens[1:]), "weights": [1.0] * (len(tokens) - 1)},
    )
    data = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    request = types.ForwardBackwardRequest(data, model_id, seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


class RawFront:
    """Raw HTTP calls to a Tinker front at ``base_url``, as the SDK makes them, for what the SDK
    does only by accident: lose a response (poll and discard it), re-send under a used key."""

    def __init__(self, base_url: str) -> None:
        self.base = f"{base_url}/api/v1"

    def post(self, route: str, body: Any = None) -> httpx.Response:
        return httpx.post(f"{self.base}/{route}", json=body, headers={"X-API-Key": KEY}, timeout=60)

    def model(self) -> tuple[str, str]:
        """A new session and its model: (session id, model id)."""
        session_id = self.post("create_session", {}).json()["session_id"]
        created = self.post("create_model", {"session_id": session_id, "base_model": "llama"})
        return session_id, created.json()["model_id"]

    def forward_backward(
        self, model_id: str, seq_id: int, tokens: tuple[int, ...] = (1, 2, 3, 4, 5)
    ) -> httpx.Response:
        headers = {"X-API-Key": KEY, "Content-Type": "application/x-protobuf"}
        body = forward_backward_body(model_id, seq_id, tokens)
        return httpx.post(
            f"{self.base}/forward_backward", content=body, headers=headers, timeout=60
        )

    def poll(self, request_id: str, timeout_s: float = 60.0) -> httpx.Response:
        """``retrieve_future`` until it answers more than ``try_again``."""
        deadline = time.monotonic() + timeout_s
        while True:
            response = self.post("retrieve_future", {"request_id": request_id})
            waiting = response.headers.get("content-type", "").startswith("application/json") and (
                response.json().get("type") == "try_again"
            )
            if not waiting:
                return response
            assert time.monotonic() < deadline, f"{request_id} still pending after {timeout_s} s"
