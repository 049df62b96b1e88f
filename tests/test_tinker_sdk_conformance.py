"""Every public method of the Tinker SDK's clients (0.38), called once against a real
``trainwire serve --tinker-listen``: each is served (its answer checked for what it means),
refused with a 4xx whose detail says why, or answered inside the SDK without a request.

``TABLE`` holds one case per method, in the order they run (an ``X_async`` twin runs the case
of ``X`` through its own method). The methods are enumerated with ``inspect``, so a method a
new SDK adds fails ``test_every_public_method_has_a_case`` until its case is written.
docs/TINKER.md's table is this table, for readers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import torch
from tinker import types
from tinker.lib.public_interfaces.admin_client import AdminClient
from tinker_loops import KEY, close_quietly, service_client, supervised_datum, tinker_server

from trainwire.server.process import ServerHandle

CLIENTS = {
    "ServiceClient": tinker.ServiceClient,
    "TrainingClient": tinker.TrainingClient,
    "SamplingClient": tinker.SamplingClient,
    "RestClient": tinker.RestClient,
    "AdminClient": AdminClient,
}
SERVED, REFUSED, LOCAL = "served", "refused", "in the SDK"
ASYNC = "_async"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "TINKER.md"


@dataclasses.dataclass
class World:
    """One server and what the cases share: a training client with a checkpoint, sampler
    weights, external weights and a sampling client on them."""

    handle: ServerHandle
    service: tinker.ServiceClient
    training: Any
    sampler: Any
    rest: tinker.RestClient
    admin: AdminClient
    tokenizer: Any
    model_root: Path
    state_path: str
    sampler_path: str
    session_id: str
    counter: Iterator[int] = dataclasses.field(default_factory=lambda: iter(range(10**6)))

    @property
    def model_id(self) -> str:
        return self.training.model_id

    def datum(self) -> types.Datum:
        return supervised_datum(self.tokenizer, "the cat sat on the mat")

    def name(self, prefix: str) -> str:
        return f"{prefix}-{next(self.counter)}"

    def raw(self, method: str, route: str, **options: Any) -> httpx.Response:
        url = f"{self.handle.tinker.base_url}/api/v1/{route}"
        return httpx.request(method, url, headers={"X-API-Key": KEY}, timeout=30, **options)


def resolve(value: Any) -> Any:
    """A call's answer: awaited if a coroutine, waited for if a future (twice for an async
    method that answers a future)."""
    while True:
        if inspect.iscoroutine(value):
            value = asyncio.run(value)
        elif hasattr(value, "result") and callable(value.result):
            value = value.result(timeout=60)
        else:
            return value


Call = Callable[..., Any]  # call(client, *args, **kwargs): the method under test, resolved
Case = Callable[[World, Call], None]


def refused(call: Callable[[], Any], status: int, why: str) -> None:
    """``call`` fails with HTTP ``status`` whose detail says ``why``."""
    with pytest.raises(tinker.APIStatusError) as error:
        call()
    assert error.value.status_code == status, error.value
    assert why in str(error.value), error.value


# -- the cases ------------------------------------------------------------------------------------


def capabilities(w: World, call: Call) -> None:
    answer = call(w.service)
    listed = [m.model_name for m in answer.supported_models]  # other tests add their models
    assert "llama" in listed and set(listed) <= {p.name for p in w.model_root.iterdir()}


def rest_capabilities(w: World, call: Call) -> None:
    answer = call(w.rest)
    assert answer.supported_models[0].trainable
    raw = w.raw("GET", "get_server_capabilities").json()
    assert raw["custom_loss"] == "client" and "cross_entropy" in raw["loss_functions"]
    assert "stable_reinforce" not in raw["loss_functions"]
    assert "ppo" in raw["refused_loss_functions"]["stable_reinforce"]  # what to train with


def console_url(w: World, call: Call) -> None:
    assert call(w.service).endswith(w.session_id)  # the hosted console's address: no request


def telemetry(w: World, call: Call) -> None:
    call(w.service)  # the SDK's own telemetry object (it posts to /telemetry, which is served)


def holder(w: World, call: Call) -> None:
    assert w.service.holder.get_session_id() == w.session_id  # a property, no request


def rest_client(w: World, call: Call) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        rest = call(w.service)
    assert isinstance(rest, tinker.RestClient)


def info(w: World, call: Call) -> None:
    assert call(w.training).model_id == w.model_id


def tokenizer(w: World, call: Call) -> None:
    assert call(w.training).encode("the cat")  # loaded from the model's tokenizer_id


def forward(w: World, call: Call) -> None:
    out = call(w.training, [w.datum()], "cross_entropy")
    assert out.loss_fn_outputs[0]["logprobs"].tolist()


def forward_backward(w: World, call: Call) -> None:
    assert call(w.training, [w.datum()], "cross_entropy").metrics["loss:sum"] > 0


def forward_backward_custom(w: World, call: Call) -> None:
    def mean_nll(data: list[types.Datum], logprobs: list[torch.Tensor]) -> Any:
        loss = -torch.cat(logprobs).mean()
        return loss, {"nll:mean": loss.item()}

    assert call(w.training, [w.datum()], mean_nll).metrics["nll:mean"] > 0


def create_custom_loss(w: World, call: Call) -> None:
    """Traced and run by the SDK itself (client/config keeps it off the server, whose route
    refuses it with the reason): the loss then trains through forward_backward_custom."""

    def neg_ll(logprobs: torch.Tensor, weights: torch.Tensor) -> Any:
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = call(w.service, neg_ll, {"logprobs": 1, "weights": 1})
    output = w.training.forward_backward_custom([w.datum()], handle).result(timeout=60)
    assert output.metrics["custom/neg_ll:sum"] > 0
    refusal = w.raw("POST", "create_custom_loss", json={})
    assert refusal.status_code == 400 and "runs custom losses on the client" in refusal.text


def optim_step(w: World, call: Call) -> None:
    w.training.forward_backward([w.datum()], "cross_entropy").result(timeout=60)
    assert call(w.training, types.AdamParams(learning_rate=1e-3)).metrics is not None


def save_state(w: World, call: Call) -> None:
    name = w.name("state")
    assert call(w.training, name).path == f"tinker://{w.model_id}/weights/{name}"


def load_state(w: World, call: Call) -> None:
    assert call(w.training, w.state_path).path == w.state_path


def save_weights_for_sampler(w: World, call: Call) -> None:
    name = w.name("sampler")
    assert call(w.training, name).path.endswith(f"/sampler_weights/{name}")


def save_and_sample(w: World, call: Call) -> None:
    client = call(w.training)
    assert client.get_base_model() == "llama"


def training_sampling_client(w: World, call: Call) -> None:
    assert call(w.training, w.sampler_path).get_base_model() == "llama"


def save_external(w: World, call: Call) -> None:
    path = call(w.training, w.name("external")).path
    assert w.rest.get_external_weights_urls(path).result().urls


def sample(w: World, call: Call) -> None:
    prompt = types.ModelInput.from_ints(w.tokenizer.encode("the cat"))
    answer = call(w.sampler, prompt, 2, types.SamplingParams(max_tokens=3, seed=1))
    assert len(answer.sequences) == 2 and all(s.tokens for s in answer.sequences)


def compute_logprobs(w: World, call: Call) -> None:
    scored = call(w.sampler, types.ModelInput.from_ints(w.tokenizer.encode("the cat sat")))
    assert scored[0] is None and all(isinstance(x, float) for x in scored[1:])


def base_model(w: World, call: Call) -> None:
    assert call(w.sampler) == "llama"


def sampler_tokenizer(w: World, call: Call) -> None:
    with contextlib.chdir(w.model_root):  # the SDK loads it by the base model's name
        assert call(w.sampler).encode("the cat")


def sampler_telemetry(w: World, call: Call) -> None:
    call(w.sampler)


def queue_state(w: World, call: Call) -> None:
    from tinker.lib.queue_state_logger import QueueState

    call(w.sampler, QueueState.ACTIVE, None)  # a callback the SDK calls itself


def sampler_handle(w: World, call: Call) -> None:
    assert call(w.sampler)  # a string the SDK builds


def from_handle(w: World, call: Call) -> None:
    clone = call(tinker.SamplingClient, w.sampler.get_sampler_handle(), api_key=KEY)
    prompt = types.ModelInput.from_ints(w.tokenizer.encode("the cat"))
    params = types.SamplingParams(max_tokens=2, seed=3)
    assert clone.sample(prompt, 1, params).result(timeout=60).sequences[0].tokens


def sampling_create(w: World, call: Call) -> None:
    client = call(tinker.SamplingClient, w.service.holder, model_path=w.sampler_path)
    assert client.get_base_model() == "llama"


def service_sampling_client(w: World, call: Call) -> None:
    assert call(w.service, model_path=w.sampler_path).get_base_model() == "llama"
    assert call(w.service, base_model="llama").get_base_model() == "llama"
    with pytest.raises(tinker.NotFoundError, match="no model 'Qwen/Qwen3-8B' under"):
        call(w.service, base_model="Qwen/Qwen3-8B")


def get_session(w: World, call: Call) -> None:
    answer = call(w.rest, w.session_id)
    assert w.model_id in answer.training_run_ids and answer.sampler_ids


def list_sessions(w: World, call: Call) -> None:
    assert w.session_id in call(w.rest).sessions


def search_sessions(w: World, call: Call) -> None:
    page = call(w.rest, types.SessionSearchRequest(session_id=w.session_id))
    assert [s.session_id for s in page.sessions] == [w.session_id]
    assert page.sessions[0].checkpoints_count >= 3


def assign_project(w: World, call: Call) -> None:
    refused(lambda: call(w.rest, w.session_id, "p"), 400, "projects are a hosted-Tinker feature")


def export_trace(w: World, call: Call) -> None:
    url = call(w.rest, w.session_id)
    with urllib.request.urlopen(url) as opened:  # a data: URL, as the docs read it
        trace = json.loads(opened.read())
    assert w.model_id in {event["name"] for event in trace["traceEvents"]}


def whoami(w: World, call: Call) -> None:
    with pytest.raises(RuntimeError, match="requires JWT auth"):
        call(w.rest)
    assert w.raw("POST", "auth/token").status_code == 400
    assert w.raw("GET", "auth/apikey/me").json()["name"] == "default"


def get_sampler(w: World, call: Call) -> None:
    sampling_id = w.sampler._sampling_session_id
    assert call(w.rest, sampling_id).model_path == w.sampler_path


def training_run(w: World, call: Call) -> None:
    assert call(w.rest, w.model_id).training_run_id == w.model_id


def training_run_by_path(w: World, call: Call) -> None:
    assert call(w.rest, w.state_path).base_model == "llama"


def weights_info(w: World, call: Call) -> None:
    assert call(w.rest, w.state_path).lora_rank == 4


def list_runs(w: World, call: Call) -> None:
    assert w.model_id in [run.training_run_id for run in call(w.rest).training_runs]


def list_checkpoints(w: World, call: Call) -> None:
    assert w.state_path in [c.tinker_path for c in call(w.rest, w.model_id).checkpoints]


def list_user_checkpoints(w: World, call: Call) -> None:
    assert w.state_path in [c.tinker_path for c in call(w.rest).checkpoints]


def external_urls(w: World, call: Call) -> None:
    path = w.training.save_weights_external(w.name("urls")).result(timeout=60).path
    urls = call(w.rest, path).urls
    assert httpx.get(next(iter(urls.values())), timeout=30).content


def set_ttl(w: World, call: Call) -> None:
    call(w.rest, w.state_path, 7200)
    saved = w.rest.list_checkpoints(w.model_id).result().checkpoints
    assert next(c for c in saved if c.tinker_path == w.state_path).expires_at is not None
    call(w.rest, w.state_path, None)


def publish(w: World, call: Call) -> None:
    call(w.rest, w.state_path)
    saved = w.rest.list_checkpoints(w.model_id).result().checkpoints
    assert next(c for c in saved if c.tinker_path == w.state_path).public


def unpublish(w: World, call: Call) -> None:
    w.rest.publish_checkpoint_from_tinker_path(w.state_path).result()
    call(w.rest, w.state_path)
    saved = w.rest.list_checkpoints(w.model_id).result().checkpoints
    assert not next(c for c in saved if c.tinker_path == w.state_path).public


def delete_checkpoint(w: World, call: Call) -> None:
    path = w.training.save_state(w.name("gone")).result(timeout=60).path
    call(w.rest, w.model_id, path.split("/", 3)[3])
    assert path not in [
        c.tinker_path for c in w.rest.list_checkpoints(w.model_id).result().checkpoints
    ]


def delete_by_path(w: World, call: Call) -> None:
    path = w.training.save_state(w.name("gone")).result(timeout=60).path
    call(w.rest, path)
    assert path not in [
        c.tinker_path for c in w.rest.list_checkpoints(w.model_id).result().checkpoints
    ]


def audit_log(w: World, call: Call) -> None:
    events = call(w.admin).entries
    assert w.state_path in {entry.tinker_path for entry in events}


def billing(w: World, call: Call) -> None:
    assert call(w.admin, "2025-01-01T00:00:00Z", "2025-01-02T00:00:00Z").data == []


def storage(w: World, call: Call) -> None:
    (usage,) = call(w.admin).data
    assert usage.checkpoint_count >= 3 and usage.size_bytes > 0
    refused(lambda: call(w.admin, "p"), 400, "this server has no projects")


def deprecated_admin(case: Case) -> Case:
    """The RestClient's deprecated admin methods: the same routes, through the RestClient."""

    def run(w: World, call: Call) -> None:
        case(dataclasses.replace(w, admin=w.rest), call)  # type: ignore[arg-type]

    return run


def close(w: World, call: Call) -> None:
    call(w.service, "success")
    session = w.raw("GET", f"sessions/{w.session_id}").json()
    assert session["status"] != "active" and session["open_model_ids"] == []
    assert session["training_run_ids"] == [w.model_id]  # the catalog keeps its run


def fresh(create: Callable[[tinker.ServiceClient, World, Call], Any]) -> Case:
    """A case that creates a model: on a ServiceClient of its own, closed after (one server
    trains one model at a time)."""

    def run(w: World, call: Call) -> None:
        service = service_client(w.handle)
        try:
            training = create(service, w, call)
            assert training.get_info().model_data.model_name == "llama"
        finally:
            close_quietly(service)

    return run


@fresh
def lora_client(service: tinker.ServiceClient, w: World, call: Call) -> Any:
    return call(service, base_model="llama", rank=4)


def load_with_optimizer(w: World, call: Call) -> None:
    service = service_client(w.handle)
    try:  # a run that has applied nothing yet: loading a whole state is its start
        training = service.create_lora_training_client(base_model="llama", rank=4).result()
        assert call(training, w.state_path).path == w.state_path
    finally:
        close_quietly(service)


@fresh
def from_state(service: tinker.ServiceClient, w: World, call: Call) -> Any:
    return call(service, w.state_path)


# method → (outcome, what it does here, case), in the order the cases run.
def copy_into_project(w: World, call: Call) -> None:
    """A ServiceClient made for a project copies into a new run of its own: the copy's
    checkpoint is then found as any checkpoint is."""
    archive = tinker.ServiceClient(
        project_id="archive", base_url=w.handle.tinker.base_url, api_key=KEY
    )
    try:
        copied = call(archive, w.state_path)
    finally:
        close_quietly(archive)
    assert copied.endswith("/weights/base") and copied != w.state_path
    assert w.raw("POST", "weights_info", json={"tinker_path": copied}).status_code == 200


def rest_copy(w: World, call: Call) -> None:
    copied = call(w.rest, w.sampler_path, "archive")
    assert copied.endswith("/sampler_weights/weights") and copied != w.sampler_path
    runs = w.raw("GET", "training_runs", params={"limit": 100}).json()["training_runs"]
    assert copied.split("/")[2] in [run["training_run_id"] for run in runs]


TABLE: dict[str, tuple[str, str, Case]] = {
    "ServiceClient.get_server_capabilities": (
        SERVED,
        "the models under --model-root",
        capabilities,
    ),
    "ServiceClient.get_console_url": (LOCAL, "the hosted console's address", console_url),
    "ServiceClient.get_telemetry": (LOCAL, "the SDK's telemetry; /telemetry is served", telemetry),
    "ServiceClient.holder": (LOCAL, "a property", holder),
    "ServiceClient.create_rest_client": (LOCAL, "a RestClient (deprecated)", rest_client),
    "TrainingClient.get_info": (SERVED, "the model's id, base model and rank", info),
    "TrainingClient.get_tokenizer": (LOCAL, "loads the model's tokenizer", tokenizer),
    "TrainingClient.get_console_url": (LOCAL, "the hosted console's address", console_url),
    "TrainingClient.get_telemetry": (LOCAL, "the SDK's telemetry", telemetry),
    "TrainingClient.forward": (SERVED, "logprobs, no state change", forward),
    "TrainingClient.forward_backward": (SERVED, "loss and gradients", forward_backward),
    "TrainingClient.forward_backward_custom": (
        SERVED,
        "the loss runs on the client over served logprobs",
        forward_backward_custom,
    ),
    "TrainingClient.optim_step": (SERVED, "one AdamW update", optim_step),
    "TrainingClient.save_state": (SERVED, "a named training checkpoint", save_state),
    "TrainingClient.load_state": (SERVED, "weights of a checkpoint", load_state),
    "TrainingClient.save_weights_for_sampler": (
        SERVED,
        "named sampler weights",
        save_weights_for_sampler,
    ),
    "TrainingClient.save_weights_and_get_sampling_client": (
        SERVED,
        "a snapshot and its sampling client",
        save_and_sample,
    ),
    "TrainingClient.create_sampling_client": (
        SERVED,
        "samples saved weights",
        training_sampling_client,
    ),
    "TrainingClient.save_weights_external": (SERVED, "a downloadable export", save_external),
    "SamplingClient.sample": (SERVED, "completions of a prompt", sample),
    "SamplingClient.compute_logprobs": (SERVED, "a prompt's logprobs", compute_logprobs),
    "SamplingClient.get_base_model": (SERVED, "the sampler's base model", base_model),
    "SamplingClient.get_tokenizer": (
        LOCAL,
        "loads the tokenizer by the base model's name (a hub repo, or a folder where it runs)",
        sampler_tokenizer,
    ),
    "SamplingClient.get_telemetry": (LOCAL, "the SDK's telemetry", sampler_telemetry),
    "SamplingClient.on_queue_state_change": (LOCAL, "a callback of the SDK's", queue_state),
    "SamplingClient.get_sampler_handle": (LOCAL, "a handle string", sampler_handle),
    "SamplingClient.from_sampler_handle": (
        SERVED,
        "a second client samples the same sampler",
        from_handle,
    ),
    "SamplingClient.create": (SERVED, "a sampling session", sampling_create),
    "ServiceClient.create_sampling_client": (
        SERVED,
        "samples saved weights, or the base model it names (one no model under `--model-root` "
        "is a 404; one no open model trains is refused at the sample)",
        service_sampling_client,
    ),
    "RestClient.get_server_capabilities": (
        SERVED,
        "models, losses, custom losses on the client",
        rest_capabilities,
    ),
    "RestClient.get_telemetry": (LOCAL, "the SDK's telemetry", telemetry),
    "RestClient.get_session": (SERVED, "the session's runs and sampling sessions", get_session),
    "RestClient.list_sessions": (SERVED, "the caller's sessions, newest first", list_sessions),
    "RestClient.search_sessions": (
        SERVED,
        "by id, owner, status (no names, metadata or projects)",
        search_sessions,
    ),
    "RestClient.assign_session_project": (
        REFUSED,
        "400: no projects on this server",
        assign_project,
    ),
    "RestClient.export_session_trace": (
        SERVED,
        "a trace of its runs and checkpoints, as a data: URL",
        export_trace,
    ),
    "RestClient.whoami": (
        REFUSED,
        "the SDK refuses: it needs a JWT, which this server does not issue",
        whoami,
    ),
    "RestClient.get_sampler": (SERVED, "a sampling session's weights", get_sampler),
    "RestClient.get_training_run": (SERVED, "a run and its metadata", training_run),
    "RestClient.get_training_run_by_tinker_path": (
        SERVED,
        "the run of a checkpoint",
        training_run_by_path,
    ),
    "RestClient.get_weights_info_by_tinker_path": (
        SERVED,
        "what a checkpoint would start",
        weights_info,
    ),
    "RestClient.list_training_runs": (SERVED, "the caller's runs", list_runs),
    "RestClient.list_checkpoints": (SERVED, "a run's checkpoints", list_checkpoints),
    "RestClient.list_user_checkpoints": (SERVED, "every run's checkpoints", list_user_checkpoints),
    "RestClient.get_external_weights_urls": (SERVED, "signed download URLs", external_urls),
    "RestClient.set_checkpoint_ttl_from_tinker_path": (SERVED, "a checkpoint's expiry", set_ttl),
    "RestClient.publish_checkpoint_from_tinker_path": (
        SERVED,
        "readable by every tenant of this server",
        publish,
    ),
    "RestClient.unpublish_checkpoint_from_tinker_path": (
        SERVED,
        "its owner's alone again",
        unpublish,
    ),
    "RestClient.delete_checkpoint": (SERVED, "removes it and its files", delete_checkpoint),
    "RestClient.delete_checkpoint_from_tinker_path": (
        SERVED,
        "removes it and its files",
        delete_by_path,
    ),
    "AdminClient.get_audit_log": (
        SERVED,
        "a local record: each live checkpoint's creation",
        audit_log,
    ),
    "AdminClient.get_billing_usage": (SERVED, "an empty list: nothing is billed", billing),
    "AdminClient.get_current_checkpoint_storage_usage": (
        SERVED,
        "bytes on disk of the caller's runs",
        storage,
    ),
    "AdminClient.get_telemetry": (LOCAL, "the SDK's telemetry", telemetry),
    "RestClient.get_audit_log": (
        SERVED,
        "as AdminClient's (deprecated)",
        deprecated_admin(audit_log),
    ),
    "RestClient.get_billing_usage": (
        SERVED,
        "as AdminClient's (deprecated)",
        deprecated_admin(billing),
    ),
    "RestClient.get_current_checkpoint_storage_usage": (
        SERVED,
        "as AdminClient's (deprecated)",
        deprecated_admin(storage),
    ),
    "ServiceClient.create_custom_loss": (
        LOCAL,
        "traced and run by the SDK (the server's route refuses it with why)",
        create_custom_loss,
    ),
    "ServiceClient.copy_weights": (
        SERVED,
        "a new closed run holding the copy (its files shared), once per idempotency key",
        copy_into_project,
    ),
    "RestClient.copy_weights": (
        SERVED,
        "as ServiceClient's; the project is kept as the copy's metadata",
        rest_copy,
    ),
    "ServiceClient.close": (SERVED, "closes its model's run; the session is finished", close),
    "ServiceClient.create_lora_training_client": (
        SERVED,
        "a LoRA run on a base model",
        lora_client,
    ),
    "TrainingClient.load_state_with_optimizer": (
        SERVED,
        "the whole state, into a run that has applied nothing yet",
        load_with_optimizer,
    ),
    "ServiceClient.create_training_client_from_state": (
        SERVED,
        "a run from a checkpoint's weights",
        from_state,
    ),
    "ServiceClient.create_training_client_from_state_with_optimizer": (
        SERVED,
        "a run continuing a checkpoint",
        from_state,
    ),
}


# What the lead still builds: each check says it is still missing or refused today.
def public_methods() -> set[str]:
    """Every public method (and property) of the SDK's clients, ``X_async`` twins included."""
    return {
        f"{name}.{member}"
        for name, cls in CLIENTS.items()
        for member, _ in inspect.getmembers(cls)
        if not member.startswith("_")
    }


def ordered_calls() -> list[tuple[str, str]]:
    """(method, the case's key) for every method in ``TABLE``, each twin after its case."""
    every = public_methods()
    calls = []
    for key in TABLE:
        calls.append((key, key))
        if f"{key}{ASYNC}" in every:
            calls.append((f"{key}{ASYNC}", key))
    return calls


def test_every_public_method_has_a_case() -> None:
    covered = {method for method, _ in ordered_calls()}
    missing = public_methods() - covered
    assert not missing, f"SDK methods without a case in TABLE: {sorted(missing)}"


def test_the_docs_table_names_every_case() -> None:
    text = DOCS.read_text()
    for key, (outcome, what, _) in TABLE.items():
        assert f"| `{key}` | {outcome} | {what} |" in text, key


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama: Path) -> Any:
    state_dir = tmp_path_factory.mktemp("conformance") / "state"
    with tinker_server(state_dir, model_root) as handle:
        service = service_client(handle)
        training = service.create_lora_training_client(base_model="llama", rank=4).result()
        state_path = training.save_state("base").result(timeout=60).path
        sampler_path = training.save_weights_for_sampler("weights").result(timeout=60).path
        base_url = handle.tinker.base_url
        yield World(
            handle,
            service,
            training,
            training.create_sampling_client(sampler_path).result(),
            tinker.RestClient(base_url=base_url, api_key=KEY),
            AdminClient(base_url=base_url, api_key=KEY),
            training.get_tokenizer(),
            model_root,
            state_path,
            sampler_path,
            service.holder.get_session_id(),
        )


def test_retrieve_futures_reports_a_clones_samples_once(world: World) -> None:
    """The sampling poller's queue: a joined clone's sample is reported once, after its
    cursor, and a poll past the bound of acknowledged ids is refused with the bound."""
    sampler = world.service.create_sampling_client(model_path=world.sampler_path).result()
    sampling_id = sampler._sampling_session_id
    clone = world.raw("POST", "join_sampling_session", json={"sampling_session_id": sampling_id})
    counter = clone.json()["client_counter"]
    assert counter > 0
    request = {
        "sampling_session_id": sampling_id,
        "seq_id": counter * 1_000_000_000,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 2, "seed": 5},
    }
    request_id = world.raw("POST", "asample", json=request).json()["request_id"]
    target = {"sampling_session_id": sampling_id, "cloned_sampler_id": counter}
    first = world.raw("POST", "retrieve_futures", json={"target": target}).json()
    assert [c["request_id"] for c in first["completions"]] == [request_id]
    assert first["completions"][0]["state"] == "finished"
    lost = {"target": target, "prev_cursor": 0, "timeout": 0}  # the first answer lost
    assert world.raw("POST", "retrieve_futures", json=lost).json() == first
    again = {"target": target, "prev_cursor": first["cursor"], "timeout": 0}
    assert world.raw("POST", "retrieve_futures", json=again).json()["completions"] == []
    other = {**target, "cloned_sampler_id": 0}
    assert (
        world.raw("POST", "retrieve_futures", json={"target": other, "timeout": 0}).json()[
            "completions"
        ]
        == []
    )
    too_many = {"target": target, "retrieved_request_ids": ["x"] * 5000}
    answer = world.raw("POST", "retrieve_futures", json=too_many)
    assert answer.status_code == 400 and "at most 4096" in answer.text


@pytest.mark.parametrize(("method", "key"), ordered_calls(), ids=[m for m, _ in ordered_calls()])
def test_each_method_is_served_or_refused_with_why(world: World, method: str, key: str) -> None:
    name = method.split(".")[1]

    def call(target: Any, *args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return resolve(getattr(target, name)(*args, **kwargs))

    TABLE[key][2](world, call)
