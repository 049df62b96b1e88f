"""``--tensorboard`` on ``trainwire run`` and ``trainwire train``: event files that TensorBoard's
own reader, and ``tensorboard --logdir`` itself, read back to what ``metrics.jsonl`` holds (every
update's loss, learning rate and gradient norm, every evaluation's metrics, at the update count),
each value the float32 nearest the log's, compared exactly; a run killed and resumed appends to
them and writes no step twice; without the package the flag is one line naming the extra, before
anything starts."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from plans import sentiment_plan
from process_cluster import Cluster, wait_for_controller, wait_until
from service_fixtures import running_server
from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
from tensorboard.util import tensor_util
from training_runs import write_manifest

from trainwire.cli import main
from trainwire.server.training import TrainCheckpointRecord
from trainwire.testing import free_port

# metrics.jsonl's keys by record kind, and the tag each is shown under (Hugging Face's names).
TAGS = {
    "update": {"loss": "train/loss", "learning_rate": "train/learning_rate",
               "grad_norm": "train/grad_norm"},
    "evaluation": {"eval_loss": "eval/loss", "eval_accuracy": "eval/accuracy"},
}  # fmt: skip


def board(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every tag's (step, value) pairs, in the order TensorBoard's reader gives them (its files
    in order, each file's events in order)."""
    reader = EventAccumulator(str(directory), size_guidance={TENSORS: 0})
    reader.Reload()
    return {
        tag: [
            (event.step, tensor_util.make_ndarray(event.tensor_proto).item())
            for event in reader.Tensors(tag)
        ]
        for tag in reader.Tags()["tensors"]
    }


def metrics_by_tag(path: Path) -> dict[str, list[tuple[int, float]]]:
    """What ``metrics.jsonl`` holds, as ``board`` reads the event files: TensorBoard keeps a
    scalar as a float32, so each value is the float32 nearest the log's."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for key, tag in TAGS[record["kind"]].items():
            expected.setdefault(tag, []).append((record["step"], float(np.float32(record[key]))))
    return expected


def served_by_tensorboard(logdir: Path, tags: list[str]) -> dict[str, list[tuple[int, float]]]:
    """The scalars ``tensorboard --logdir`` serves its web page (its default loader: the data
    server where it is installed), once it has read them all."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    served: dict[str, list[tuple[int, float]]] = {}

    def read_all() -> bool:
        for tag in tags:
            query = urllib.parse.urlencode({"run": ".", "tag": tag})
            url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"
            try:
                with urllib.request.urlopen(url, timeout=10) as answer:
                    points = json.loads(answer.read())
            except OSError:  # not listening yet, or the tag not loaded yet (404)
                return False
            served[tag] = [(step, value) for _, step, value in points]
        return all(served.values())

    try:
        assert wait_until(read_all, timeout_s=300), "tensorboard served no scalars"
    finally:
        server.kill()
        server.wait()
    return served


def event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*"))


@pytest.fixture(scope="module")
def plan(bert_classifier_config):
    # Two epochs of 12 microbatches: 6 updates each, an evaluation at each epoch's end.
    return sentiment_plan(bert_classifier_config, examples=60, num_epochs=2)


def test_run_writes_event_files_holding_what_metrics_jsonl_holds(
    plan, model_root, tmp_path, capsys
):
    manifest = write_manifest(tmp_path, plan)
    work = tmp_path / "work"
    with running_server(tmp_path / "state", model_root) as handle:
        code = main(["run", "--server", handle.target, "--manifest", str(manifest), "--quiet",
                     "--run-id", "board", "--work-dir", str(work), "--tensorboard"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    expected = metrics_by_tag(work / "metrics.jsonl")
    assert len(expected["train/loss"]) == plan.max_steps and len(expected["eval/loss"]) == 2
    assert board(work / "tensorboard") == expected
    assert len(event_files(work / "tensorboard")) == 1
    # What people look at: the values TensorBoard's own page is served.
    assert served_by_tensorboard(work / "tensorboard", sorted(expected)) == expected


@pytest.mark.slow
def test_a_run_killed_with_its_server_resumes_appending_and_writes_no_step_twice(
    plan, model_root, tmp_path
):
    manifest = write_manifest(tmp_path, plan)
    cluster = Cluster(tmp_path, model_root, manifest)
    # No checkpoint before the kill: the restarted server starts the run from its beginning,
    # so the resumed controller runs again every step the event files already hold.
    cluster.controller_args += ["--tensorboard", "--checkpoint-every", "1000"]
    events = cluster.work / "tensorboard"
    cluster.start_server()
    cluster.start_controller()
    try:
        held = lambda: board(events).get("train/loss", []) if events.is_dir() else []  # noqa: E731
        assert wait_until(lambda: len(held()) >= 3), cluster.logs_text()
        cluster.kill(cluster.controller)
        cluster.kill(cluster.server)
        before = held()  # the dead controller's files
        assert before and cluster.controller.returncode == -signal.SIGKILL
        cluster.start_server()
        cluster.start_controller()
        wait_for_controller(cluster, "the resumed run")
        assert cluster.controller.returncode == 0, cluster.logs_text()
    finally:
        cluster.kill(cluster.controller)
        cluster.kill(cluster.server)
    # With no checkpoint the server restarts at position 0, and the controller with it (whether it
    # logs that as a resume or a start depends on what its cursor held when it was killed).
    expected = metrics_by_tag(cluster.work / "metrics.jsonl")
    assert board(events) == expected
    assert expected["train/loss"][: len(before)] == before
    assert len(event_files(events)) == 2  # the resumed run appended a file of its own


def test_tensorboard_given_only_when_a_finished_run_is_run_again_writes_its_whole_history(
    plan, model_root, tmp_path, capsys, caplog
):
    manifest = write_manifest(tmp_path, plan)
    work = tmp_path / "work"
    with running_server(tmp_path / "state", model_root) as handle:
        args = ["run", "--server", handle.target, "--manifest", str(manifest),
                "--run-id", "later", "--work-dir", str(work), "--quiet"]  # fmt: skip
        assert main(args) == 0
        assert not (work / "tensorboard").exists()
        assert main([*args, "--tensorboard"]) == 0, capsys.readouterr().err
        written = board(work / "tensorboard")
        # Once more: the files are read back to nothing new, and their reader's INFO lines
        # (where each file ended) stay off the terminal.
        caplog.set_level(logging.DEBUG)
        assert main([*args, "--tensorboard"]) == 0
        logged = [r.getMessage() for r in caplog.records if r.name.startswith("tensorboard")]
    assert logged == []
    assert written == metrics_by_tag(work / "metrics.jsonl")
    assert board(work / "tensorboard") == written
    assert len(event_files(work / "tensorboard")) == 1


def test_train_writes_event_files_holding_what_metrics_jsonl_holds(plan, tmp_path, capsys):
    manifest = write_manifest(tmp_path, plan)
    output = tmp_path / "out"
    code = main(["train", "--manifest", str(manifest), "--output", str(output),
                 "--device", "cpu", "--tensorboard"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    expected = metrics_by_tag(output / "metrics.jsonl")
    assert len(expected["train/loss"]) == plan.max_steps and len(expected["eval/loss"]) == 2
    assert board(output / "tensorboard") == expected


# A ``trainwire train --tensorboard`` that stops for good (SIGKILL awaits it) once microbatch
# ``hold`` is done and its event files are written: past the checkpoint at the first epoch's end.
HELD_TRAIN = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import lightning.pytorch as pl
    from trainwire.server.training.run import train

    manifest, output, hold, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])

    class Hold(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            if module.run_state.next_microbatch == hold + 1:
                marker.write_text("held")
                while True:
                    time.sleep(1)

    train(manifest, output, device="cpu", callbacks=[Hold()], tensorboard=True)
    """
)


@pytest.mark.slow
def test_train_killed_past_its_checkpoint_resumes_appending_and_writes_no_step_twice(
    plan, tmp_path, capsys
):
    manifest = write_manifest(tmp_path, plan)
    output, marker = tmp_path / "out", tmp_path / "held"
    hold = 12 + 7  # the second epoch's 8th microbatch: 4 updates past the first epoch's end
    held = subprocess.Popen(
        [sys.executable, "-c", HELD_TRAIN, str(manifest), str(output), str(hold), str(marker)]
    )
    try:
        assert wait_until(lambda: marker.exists() or held.poll() is not None, timeout_s=600)
        assert held.poll() is None, "the held run exited"
    finally:
        held.send_signal(signal.SIGKILL)
        held.wait()
    before = board(output / "tensorboard")
    assert [step for step, _ in before["train/loss"]] == list(range(1, plan.steps_after(hold) + 1))
    # Its last checkpoint is the first epoch's end (step 6): the resume runs steps 7 to 10 again.
    assert TrainCheckpointRecord.read(output / "checkpoints" / "last.ckpt").cursor == 12
    assert plan.steps_after(11) == 6
    code = main(["train", "--manifest", str(manifest), "--output", str(output),
                 "--device", "cpu", "--ckpt-path", "last", "--tensorboard"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert board(output / "tensorboard") == metrics_by_tag(output / "metrics.jsonl")
    assert len(event_files(output / "tensorboard")) == 2


def test_a_fresh_train_into_an_output_holding_event_files_is_refused(plan, tmp_path, capsys):
    manifest = write_manifest(tmp_path, plan)
    events = tmp_path / "out" / "tensorboard"
    events.mkdir(parents=True)
    (events / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    code = main(["train", "--manifest", str(manifest), "--output", str(tmp_path / "out"),
                 "--device", "cpu", "--tensorboard"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "tensorboard already holds other files" in err and "new --output" in err
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == [
        "events.out.tfevents.1.host.1.0",
        "tensorboard",
    ]


# The CLI on an installation without the tensorboard package.
WITHOUT_TENSORBOARD = (
    "import sys; sys.modules['tensorboard'] = None\n"
    "from trainwire.cli import main\n"
    "sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize("command", ["run", "train"])
def test_without_the_package_the_flag_is_one_line_naming_the_extra(
    command, plan, model_root, tmp_path
):
    manifest = write_manifest(tmp_path, plan)
    work = tmp_path / "work"
    args = {
        # An address nobody serves: the flag is refused before the server is tried.
        "run": ["--server", "127.0.0.1:9", "--run-id", "none", "--work-dir", str(work)],
        "train": ["--output", str(work), "--device", "cpu", "--model-root", str(model_root)],
    }[command]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TENSORBOARD, command, "--manifest", str(manifest),
         *args, "--tensorboard"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"trainwire {command}: error: --tensorboard needs the tensorboard package: "
        "pip install 'trainwire[tensorboard]'"
    )
    assert not work.exists()


def test_the_flag_keeps_the_client_free_of_torch(tmp_path):
    """``trainwire run --tensorboard`` imports the tensorboard package, never torch."""
    script = (
        "import sys\n"
        "from trainwire.client.control.controller import Controller\n"
        "from trainwire.contract.report.tensorboard_log import TensorBoardLog\n"
        f"with TensorBoardLog({str(tmp_path)!r}) as log:\n"
        "    log.follow([{'kind': 'update', 'microbatch': 0, 'epoch': 0, 'step': 1,\n"
        "                 'loss': 0.5, 'learning_rate': 0.1, 'grad_norm': 1.0}])\n"
        "print('torch' in sys.modules, 'tensorboard' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
    assert board(tmp_path) == {
        "train/loss": [(1, 0.5)],
        "train/learning_rate": [(1, float(np.float32(0.1)))],  # a float32, as TensorBoard keeps
        "train/grad_norm": [(1, 1.0)],
    }


def update(step: int, loss: float) -> dict[str, object]:
    return {"kind": "update", "microbatch": step - 1, "epoch": 0, "step": step,
            "loss": loss, "learning_rate": 0.1, "grad_norm": 1.0}  # fmt: skip


def test_a_resume_in_the_second_its_killed_run_opened_its_file_writes_a_file_read_after_it(
    tmp_path,
):
    """TensorBoard reads a directory's event files by name, the second they were opened first:
    here the killed run's file is named for the coming second on a host whose name sorts after
    this one's, so a file the resume opened in that second would be read first."""
    from trainwire.contract.report.tensorboard_log import TensorBoardLog

    with TensorBoardLog(tmp_path) as killed:
        killed.follow([update(1, 0.5)])
    (first,) = event_files(tmp_path)
    second = int(time.time()) + 1
    first.rename(tmp_path / f"events.out.tfevents.{second:010d}.~later-host.1.0")
    with TensorBoardLog(tmp_path) as resumed:
        resumed.follow([update(1, 0.5), update(2, 0.25)])
    assert [step for step, _ in board(tmp_path)["train/loss"]] == [1, 2]
    assert int(event_files(tmp_path)[-1].name.split(".")[3]) > second
