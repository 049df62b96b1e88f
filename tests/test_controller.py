"""The Controller through a real loopback server: equal to the in-process run, resumable, strict."""

import json
import logging

import grpc
import pytest
from plans import sentiment_plan
from service_fixtures import connect, running_server

from trainwire.client import LoraSettings
from trainwire.client.control.controller import Controller
from trainwire.server import serve
from trainwire.server.engine.managed import ManagedTraining
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import free_port


def in_process(plan, tmp_path):
    session = TrainingSession(plan.config, max_steps=plan.max_steps)
    training = ManagedTraining(session, plan, checkpoint_dir=tmp_path / "in-process")
    return training.run()


class Interrupt(Exception):
    """Stands for the controller dying between two microbatches."""


def stop_at(index):
    """An on_step callback that kills the controller once microbatch ``index`` is done."""

    def on_step(progress):
        if progress.microbatch == index:
            raise Interrupt

    return on_step


def start_and_interrupt(client, plan, work_dir, run_id="r"):
    """Leave a run behind after its first microbatch."""
    with pytest.raises(Interrupt):
        Controller(client, plan, run_id=run_id, work_dir=work_dir).run(on_step=stop_at(0))


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, dropout=0.1)], ids=["full", "lora"])
def test_controller_equals_managed_training_in_process(
    bert_classifier_config, model_root, tmp_path, lora
):
    plan = sentiment_plan(bert_classifier_config, lora=lora)
    expected = in_process(plan, tmp_path)
    with running_server(tmp_path / "state", model_root) as handle, connect(handle) as client:
        controller = Controller(
            client,
            plan.to_manifest(),
            run_id="eq",
            work_dir=tmp_path / "work",
            checkpoint_every=2,
        )
        result = controller.run()
    assert result.state_digest == expected.state_digest
    assert result.history == expected.history
    assert (result.best_step, result.best_epoch, result.best_score) == (
        expected.best_step,
        expected.best_epoch,
        expected.best_score,
    )
    summary = json.loads((tmp_path / "work" / "training_summary.json").read_text())
    assert summary["state_digest"] == expected.state_digest
    for name in ("training_summary.yaml", "metrics.jsonl", "loss_curve.png"):
        assert (tmp_path / "work" / name).stat().st_size > 0
    weights_file = "adapter_config.json" if lora else "config.json"
    assert (tmp_path / "work" / "export" / weights_file).is_file()


def test_a_killed_controller_and_a_restarted_server_still_end_bit_identical(
    bert_classifier_config, model_root, tmp_path
):
    plan = sentiment_plan(bert_classifier_config)
    expected = in_process(plan, tmp_path)
    manifest = plan.to_manifest()
    state, work = tmp_path / "state", tmp_path / "work"

    with running_server(state, model_root) as handle, connect(handle) as client:
        with pytest.raises(Interrupt):
            Controller(client, manifest, run_id="r", work_dir=work, checkpoint_every=2).run(
                on_step=stop_at(5)
            )
        # A second controller picks the run up from its cursor.
        with pytest.raises(Interrupt):
            Controller(client, manifest, run_id="r", work_dir=work, checkpoint_every=2).run(
                on_step=stop_at(8)
            )
        position_before_restart = client.info().position
    # The server goes down; the new one restores its latest checkpoint, behind the cursor.
    with running_server(state, model_root) as handle, connect(handle) as client:
        info = client.info()
        assert 0 < info.position < position_before_restart
        result = Controller(client, manifest, run_id="r", work_dir=work, checkpoint_every=2).run()
    assert result.state_digest == expected.state_digest
    assert result.history == expected.history


def test_a_server_restarted_under_a_running_controller_is_caught_by_the_position_check(
    bert_classifier_config, model_root, tmp_path, caplog
):
    plan = sentiment_plan(bert_classifier_config)
    expected = in_process(plan, tmp_path)
    listen = f"127.0.0.1:{free_port()}"
    options = {"state_dir": tmp_path / "state", "model_root": model_root, "device": "cpu"}
    servers = [serve(listen=listen, **options)]
    client = connect(servers[0])

    def restart_once(progress):
        # Between two microbatches, with nothing in flight: the new server restores its latest
        # checkpoint, behind the controller, and is SERVING before the next operation is sent.
        if progress.microbatch == 5 and len(servers) == 1:
            servers[0].stop(grace=10)
            servers.append(serve(listen=listen, **options))
            client.wait_until_serving(timeout_s=60)

    try:
        with caplog.at_level(logging.WARNING, logger="trainwire.client.control.controller"):
            # Window 1: "nothing in flight" holds only without pipelining (with a window, calls
            # issued ahead meet the stopped server and take the outage path instead).
            result = Controller(
                client, plan, run_id="r", work_dir=tmp_path / "work", checkpoint_every=2, window=1
            ).run(on_step=restart_once)
    finally:
        client.close_channel()
        servers[-1].stop(grace=10)

    assert len(servers) == 2, "the restart happened"
    # The next keyed call met the restored position (FAILED_PRECONDITION with the server's
    # trainwire-position metadata) and nothing ran; the controller resynchronized from there.
    resynchronized = [r.getMessage() for r in caplog.records if "resynchronizing" in r.message]
    assert len(resynchronized) == 1 and "the session is at position" in resynchronized[0]
    assert result.state_digest == expected.state_digest
    assert result.history == expected.history


def test_a_work_directory_of_another_manifest_is_refused(
    bert_classifier_config, model_root, tmp_path
):
    plan = sentiment_plan(bert_classifier_config)
    other = sentiment_plan(bert_classifier_config, seed=7)
    with running_server(tmp_path / "state", model_root) as handle, connect(handle) as client:
        start_and_interrupt(client, plan, tmp_path / "work")
        with pytest.raises(ValueError, match="use another work directory"):
            Controller(client, other, run_id="r", work_dir=tmp_path / "work")
        with pytest.raises(ValueError, match="resume it with its own run id"):
            Controller(client, plan, run_id="other", work_dir=tmp_path / "work")


def test_a_run_id_bound_to_another_manifest_on_the_server_is_refused(
    bert_classifier_config, model_root, tmp_path
):
    plan = sentiment_plan(bert_classifier_config)
    other = sentiment_plan(bert_classifier_config, seed=7)
    with running_server(tmp_path / "state", model_root) as handle, connect(handle) as client:
        start_and_interrupt(client, plan, tmp_path / "a")
        with pytest.raises(grpc.RpcError) as caught:
            Controller(client, other, run_id="r", work_dir=tmp_path / "b").run()
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_server_restored_from_the_best_checkpoint_still_exports_the_best(
    bert_classifier_config, model_root, tmp_path
):
    plan = sentiment_plan(bert_classifier_config)
    session = TrainingSession(plan.config, max_steps=plan.max_steps)
    training = ManagedTraining(session, plan, checkpoint_dir=tmp_path / "in-process")
    expected = training.run()
    training.export_weights(tmp_path / "expected-export")
    first_evaluation = next(r["microbatch"] for r in expected.history if r["kind"] == "evaluation")
    state, work = tmp_path / "state", tmp_path / "work"

    # No periodic checkpoints: the best, saved at the first evaluation, is the latest one.
    with (
        running_server(state, model_root) as handle,
        connect(handle) as client,
        pytest.raises(Interrupt),
    ):
        Controller(client, plan, run_id="r", work_dir=work, checkpoint_every=1000).run(
            on_step=stop_at(first_evaluation)
        )
    with running_server(state, model_root) as handle, connect(handle) as client:
        assert client.info().restored_checkpoint == "best"
        result = Controller(client, plan, run_id="r", work_dir=work, checkpoint_every=1000).run()
    assert result.best_checkpoint_path == "best"
    assert result.state_digest == expected.state_digest
    exported = (work / "export" / "model.safetensors").read_bytes()
    assert exported == (tmp_path / "expected-export" / "model.safetensors").read_bytes()


def test_trainwire_run_replays_a_manifest_file_against_a_token_server(
    bert_classifier_config, model_root, tmp_path, capsys
):
    from trainwire.cli import main
    from trainwire.client import write_manifest

    plan = sentiment_plan(bert_classifier_config, num_epochs=1)
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, plan.to_manifest())
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with running_server(tmp_path / "state", model_root, token="s3cret") as handle:
        args = ["run", "--server", f"127.0.0.1:{handle.port}", "--manifest", str(manifest),
                "--run-id", "cli", "--work-dir", str(tmp_path / "work"), "--quiet"]  # fmt: skip
        assert main([*args, "--token-file", str(token_file)]) == 0
    expected = in_process(plan, tmp_path)
    summary = json.loads((tmp_path / "work" / "training_summary.json").read_text())
    assert summary["state_digest"] == expected.state_digest
    assert f"digest {expected.state_digest}" in capsys.readouterr().out
