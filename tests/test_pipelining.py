"""Pipelined operations: futures on the client, out-of-order arrival, a window in the controller."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from service_fixtures import (
    NO_RETRY,
    TEXTS,
    DropFirstResponse,
    connect,
    microbatches,
    running_server,
    wait_for,
)
from test_queue_bounds import hold_forward_backward

from trainwire.client import LoraSettings, ManagedTrainingPlan
from trainwire.client.control.controller import Controller
from trainwire.client.session.pipeline import OperationPipeline
from trainwire.server.engine.managed import ManagedTraining
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import tiny_sentiment_examples, tiny_token_examples

NO_DROPOUT_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


def test_the_pipeline_numbers_in_issue_order_and_asks_again_after_a_failure_or_out_of_band():
    server_positions = iter([10, 20, 30])  # what each Info would answer
    pipeline = OperationPipeline(2, lambda: next(server_positions))

    def fails(position: int) -> int:
        raise ValueError(position)

    try:
        assert [pipeline.submit(lambda p: p).result() for _ in range(3)] == [10, 11, 12]
        assert pipeline.submit(lambda p: p, expected_position=5).result() == 5
        assert pipeline.submit(lambda p: p).result() == 6
        with pytest.raises(ValueError):
            pipeline.submit(fails).result()
        assert pipeline.submit(lambda p: p).result() == 20  # asked the server again
        assert pipeline.out_of_band(lambda: "direct") == "direct"
        assert pipeline.submit(lambda p: p).result() == 30
    finally:
        pipeline.close()


def test_the_pipeline_bounds_calls_in_flight_and_an_owner_numbered_one_never_guesses():
    pipeline = OperationPipeline(2)
    release = threading.Event()
    try:
        with pytest.raises(RuntimeError):
            pipeline.submit(lambda p: p)  # no position known, none to ask for
        pipeline.start_at(7)
        held = [pipeline.submit(lambda p: release.wait(10) and p) for _ in range(2)]
        assert pipeline.try_submit(lambda p: p) is None  # both slots taken
        release.set()
        assert [future.result() for future in held] == [7, 8]
        failed = pipeline.submit(lambda p: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result()
        assert pipeline.try_submit(lambda p: p) is None  # nothing after a failure would apply
        pipeline.start_at(9)
        assert pipeline.try_submit(lambda p: p).result() == 9
    finally:
        pipeline.close()


def mixed_ops() -> list[tuple[str, object]]:
    """Text and token microbatches, an update after every second one."""
    ops: list[tuple[str, object]] = []
    for index, batch in enumerate(microbatches(TEXTS[:9])):
        ops.append(("fb", batch))
        ops.append(("fb", tiny_token_examples(2, seed=index)))
        ops.append(("step", None))
    return ops


def run_pipelined(client, ops, prefix: str, *, first: int = 0) -> list:
    """``ops[first:]``, pipelined, keys ``{prefix}/{index}``; their outcomes."""
    pending = []
    for index, (kind, batch) in enumerate(ops[first:], start=first):
        key = f"{prefix}/{index}"
        if kind == "fb":
            pending.append(client.forward_backward_async(batch, operation_key=key))
        else:
            pending.append(client.optim_step_async(operation_key=key))
    return [future.result(timeout=120) for future in pending]


@pytest.mark.parametrize("lora", [None, NO_DROPOUT_LORA], ids=["full", "lora"])
def test_pipelined_calls_end_with_the_blocking_runs_digest(
    tmp_path, model_root, llama_config, lora
):
    config = llama_config(lora=lora, lr_scheduler="constant")
    ops = mixed_ops()
    local = TrainingSession(config, device="cpu")
    expected = []
    for kind, batch in ops:
        expected.append(local.forward_backward(batch) if kind == "fb" else local.optim_step())
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, max_in_flight=4)
        client.open("run", config)
        outcomes = run_pipelined(client, ops, "run")
        assert [o.position for o in outcomes] == list(range(1, len(ops) + 1))
        assert client.info().state_digest == local.state_digest()
        for outcome, want in zip(outcomes, expected, strict=True):
            if isinstance(want, float):
                assert outcome.loss == want
            elif hasattr(want, "logprobs"):
                assert [list(row) for row in outcome.logprobs] == want.logprobs
            else:
                assert outcome.step == want.step
        client.close_channel()


def test_an_operation_that_arrives_before_its_predecessor_waits_and_applies_in_order(
    tmp_path, model_root, llama_config
):
    config = llama_config(lr_scheduler="constant")
    first, second = microbatches(TEXTS[:6])
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        host = handle.session_host
        host.idle_release_s = 120.0  # held however long this machine takes to send "a"
        client.open("run", config)
        results: dict[str, object] = {}

        def send_second() -> None:
            results["second"] = client.forward_backward(
                second, operation_key="b", expected_position=1
            )

        thread = threading.Thread(target=send_second)
        thread.start()  # position 1 goes first; the session is at 0
        wait_for(lambda: host.scheduler.waiting == 1, 60)  # admitted: held for position 0
        assert "second" not in results and host.position == 0  # held, not refused nor run
        results["first"] = client.forward_backward(first, operation_key="a", expected_position=0)
        thread.join(timeout=30)
        entries = handle.session_host.journal.entries()
        digest = client.info().state_digest
    local = TrainingSession(config, device="cpu")
    local.forward_backward(first)
    local.forward_backward(second)
    assert [(e.operation_key, e.position) for e in entries] == [("a", 1), ("b", 2)]
    assert results["second"].position == 2
    assert digest == local.state_digest()


def test_a_held_operation_waits_while_a_call_without_a_position_runs(
    tmp_path, model_root, llama_config
):
    """A call sent without a position runs outside the order; what is held for a position waits
    for it as for any running call, past the idle bound, instead of being let go to be refused
    while its predecessor is still on its way."""
    config = llama_config(lr_scheduler="constant")
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        host = handle.session_host
        host.idle_release_s = 0.5
        client.open("run", config)
        release = hold_forward_backward(host.session)
        results: dict[str, object] = {}

        def send(name: str, **position: int) -> None:
            try:
                results[name] = client.forward_backward(TEXTS[:2], operation_key=name, **position)
            except grpc.RpcError as error:
                results[name] = error.code()

        unnumbered = threading.Thread(target=send, args=("u",))
        unnumbered.start()
        wait_for(lambda: host.scheduler.busy, 60)  # "u" runs, held in the engine
        second = threading.Thread(target=send, args=("b",), kwargs={"expected_position": 2})
        second.start()
        wait_for(lambda: host.scheduler.waiting == 2, 60)  # "b" admitted, held for position 2
        # Several idle bounds pass while "u" runs: "b" must still be held, not let go.
        time.sleep(6 * host.idle_release_s)
        assert "b" not in results
        first = threading.Thread(target=send, args=("a",), kwargs={"expected_position": 1})
        first.start()
        wait_for(lambda: host.scheduler.waiting == 3, 60)
        release.set()
        for thread in (unnumbered, first, second):
            thread.join(timeout=60)
        entries = host.journal.entries()
    assert [(e.operation_key, e.position) for e in entries] == [("u", 1), ("a", 2), ("b", 3)]
    assert results["b"].position == 3, results["b"]


def test_a_server_stopping_refuses_an_operation_held_for_its_position_and_leaves_no_thread(
    tmp_path, model_root, llama_config
):
    """Stopping the server answers a call held for a predecessor that will not come with
    UNAVAILABLE at once, whatever the idle bound, and no handler thread is left waiting."""
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        host = handle.session_host
        host.idle_release_s = 3600.0  # only the shutdown lets it go
        client.open("run", llama_config())
        codes: list[grpc.StatusCode] = []

        def send() -> None:
            try:
                client.forward_backward(TEXTS[:2], operation_key="x", expected_position=5)
            except grpc.RpcError as error:
                codes.append(error.code())

        sender = threading.Thread(target=send)
        sender.start()
        wait_for(lambda: host.scheduler.waiting == 1, 60)  # admitted, held for position 5
        handle.stop()
        sender.join(timeout=60)
        assert codes == [grpc.StatusCode.UNAVAILABLE]
        wait_for(lambda: host.scheduler.waiting == 0, 60)  # the handler's wait has ended
        client.close_channel()


def test_an_operation_whose_predecessor_never_comes_is_refused_with_the_real_position(
    tmp_path, model_root, llama_config
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("run", llama_config())
        # Bounded by the idle release (2 s), well inside the client's deadline (60 s),
        # which would answer DEADLINE_EXCEEDED instead.
        with pytest.raises(grpc.RpcError) as refused:
            client.forward_backward(TEXTS[:2], operation_key="x", expected_position=3)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "session is at position 0" in refused.value.details()
        assert client.info().position == 0


def test_lost_responses_with_a_window_of_four_apply_each_key_once(
    tmp_path, model_root, llama_config
):
    config = llama_config(lr_scheduler="constant")
    ops = mixed_ops()
    dropper = DropFirstResponse()
    local = TrainingSession(config, device="cpu")
    for kind, batch in ops:
        local.forward_backward(batch) if kind == "fb" else local.optim_step()
    with running_server(tmp_path / "state", model_root, interceptors=[dropper]) as handle:
        client = connect(handle, max_in_flight=4)
        client.open("run", config)
        outcomes = run_pipelined(client, ops, "run")
        entries = handle.session_host.journal.entries(include_rolled_back=True)
        assert client.info().state_digest == local.state_digest()
        client.close_channel()
    keys = [f"run/{i}" for i in range(len(ops))]
    assert dropper.dropped == set(keys)
    assert all(outcome.replayed for outcome in outcomes)
    assert [(e.operation_key, e.position) for e in entries] == [
        (key, position) for position, key in enumerate(keys, start=1)
    ]


def test_a_failed_call_stops_the_ones_behind_it_and_nothing_after_it_applies(
    tmp_path, model_root, llama_config
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY, max_in_flight=3)
        client.open("run", llama_config(lr_scheduler="constant"))
        ok = client.forward_backward_async(TEXTS[:2], operation_key="ok")
        bad = client.forward_backward_async(
            tiny_token_examples(1), operation_key="bad", loss_fn="mse"
        )
        behind = client.optim_step_async(operation_key="behind")
        assert ok.result(timeout=60).position == 1
        with pytest.raises(grpc.RpcError) as refused:
            bad.result(timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as stopped:
            behind.result(timeout=60)
        assert stopped.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert client.info().position == 1
        # The next call learns the real position again and applies.
        assert client.optim_step_async(operation_key="next").result(timeout=60).position == 2


def test_pipelined_requests_carry_consecutive_positions_from_the_session(
    tmp_path, model_root, llama_config
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle)
        client.open("run", llama_config(lr_scheduler="constant"))
        client.forward_backward(TEXTS[:2], operation_key="blocking")  # position 1
        futures = [
            client.forward_backward_async(TEXTS[2:4], operation_key="p1"),
            client.optim_step_async(operation_key="p2"),
        ]
        sent = [future.result(timeout=60).position for future in futures]
    assert sent == [2, 3]  # numbered after the blocking call, which they waited for


def sentiment_plan(bert_classifier_config, **overrides) -> ManagedTrainingPlan:
    config = bert_classifier_config(
        gradient_accumulation_steps=2, num_epochs=2, eval_strategy="epoch", **overrides
    )
    examples = tiny_sentiment_examples(18, seed=1)
    return ManagedTrainingPlan(examples, config, eval_examples=tiny_sentiment_examples(6, seed=2))


@pytest.mark.parametrize("window", [2, 4])
def test_a_controller_window_ends_with_window_ones_bits(
    tmp_path, model_root, bert_classifier_config, window
):
    plan = sentiment_plan(bert_classifier_config)
    reference = ManagedTraining(
        TrainingSession(plan.config, device="cpu", max_steps=plan.max_steps), plan
    ).run()
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, max_in_flight=window)
        controller = Controller(
            client, plan, run_id="run", work_dir=tmp_path / "work", checkpoint_every=2,
            window=window,
        )  # fmt: skip
        result = controller.run()
        client.close_channel()
    assert result.state_digest == reference.state_digest
    assert result.history == reference.history
    assert result.best_step == reference.best_step
