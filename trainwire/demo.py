"""``trainwire demo``: the whole product on an embedded default, end to end.

It builds a tiny BERT sentiment classifier offline, plans the bundled sentiment dataset, starts a
local server on a free port (or uses ``--server``), trains through the controller with a
progress bar, and prints where the summary, the loss curve and the exported model are.
Accuracy starts at chance (0.5) and rises well above it within a few epochs.

What ``trainwire demo --rl`` (:mod:`trainwire.rl_demo`) shares with it lives here too: where a
demo writes (:class:`DemoDirs`) and the server it drives (:func:`demo_client`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainwire.contract.config import TrainingConfig
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.run.results import TrainingResult

if TYPE_CHECKING:
    from trainwire.client.session.session_client import SessionClient

MODEL_NAME = "tiny-bert-sentiment"
RUN_ID = "demo"


@dataclass(frozen=True)
class DemoSettings:
    """The demo's defaults; ``fast`` trims them for the test suite."""

    train_examples: int = 256
    eval_examples: int = 64
    num_epochs: int = 6
    batch_size: int = 16
    learning_rate: float = 1e-3

    @classmethod
    def fast(cls) -> DemoSettings:
        return cls(train_examples=128, eval_examples=32, num_epochs=3, learning_rate=2e-2)


def demo_plan(model_root: Path, settings: DemoSettings) -> ManagedTrainingPlan:
    """Build the tiny model under ``model_root`` and plan the bundled dataset on it."""
    from trainwire.testing import SENTIMENT_LABELS, make_tiny_model, tiny_sentiment_examples

    make_tiny_model(
        model_root / MODEL_NAME,
        task="sequence-classification",
        arch="bert",
        labels=SENTIMENT_LABELS,
    )
    config = TrainingConfig(
        model=MODEL_NAME,
        task="sequence-classification",
        labels=SENTIMENT_LABELS,
        learning_rate=settings.learning_rate,
        warmup_steps=5,
        batch_size=settings.batch_size,
        num_epochs=settings.num_epochs,
        max_length=64,
        eval_strategy="epoch",
        metric_for_best="eval_accuracy",
    )
    return ManagedTrainingPlan(
        tiny_sentiment_examples(settings.train_examples, seed=0),
        config,
        eval_examples=tiny_sentiment_examples(settings.eval_examples, seed=1),
    )


@dataclass(frozen=True)
class DemoDirs:
    """Where a demo writes: everything under one work directory, so a demo in a fresh directory
    starts afresh and one directory holds all a run left (model, server state, outputs)."""

    root: Path

    @classmethod
    def at(cls, work_dir: str | Path) -> DemoDirs:
        return cls(Path(work_dir).resolve())

    @property
    def models(self) -> Path:
        """The tiny model's parent: a local server's model root."""
        return self.root / "models"

    def model_reference(self, server: str | None, name: str) -> str:
        """The model as a config names it: relative to a local server's model root; absolute for
        a remote ``server``, which resolves it under its own root."""
        return name if server is None else str(self.models / name)


@contextlib.contextmanager
def local_server(state_dir: Path, model_root: Path) -> Iterator[str]:
    """A server on a free loopback port for the length of the block."""
    from trainwire.server import serve

    handle = serve(listen="127.0.0.1:0", state_dir=state_dir, model_root=model_root, device="cpu")
    try:
        yield f"127.0.0.1:{handle.port}"
    finally:
        handle.stop()


@contextlib.contextmanager
def demo_client(dirs: DemoDirs, server: str | None) -> Iterator[SessionClient]:
    """A client of ``server``, or of a local server on a free port for the length of the block.

    A local server logs a line per operation; a demo tells the story itself, so the server's
    log is quieted to warnings.
    """
    from trainwire.client.session.session_client import SessionClient

    logging.getLogger("trainwire.server").setLevel(logging.WARNING)
    with contextlib.ExitStack() as stack:
        target = server or stack.enter_context(local_server(dirs.root / "server", dirs.models))
        yield stack.enter_context(SessionClient(target))


@contextlib.contextmanager
def model_found_by(server: str | None, dirs: DemoDirs) -> Iterator[None]:
    """Around the Open on ``server``: a model it cannot find or may not read says why. The demo
    writes its model under the work directory, and a server reads models under its own
    ``--model-root`` only, so the work directory must lie there."""
    import grpc

    try:
        yield
    except grpc.RpcError as error:
        refused = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        if server is None or error.code() not in refused:
            raise
        raise ValueError(
            f"{error.details()} ({error.code().name}): the demo wrote its model to "
            f"{dirs.models}, and {server} reads models under its --model-root only; give "
            "--work-dir a directory under that root (on a filesystem both share)"
        ) from None


def run_demo(
    work_dir: Path,
    *,
    server: str | None = None,
    settings: DemoSettings | None = None,
    quiet: bool = False,
    run_id: str = RUN_ID,
) -> TrainingResult:
    """Plan, serve (unless ``server`` is given), train through the controller, report (with
    ``quiet``, no progress: only where the results are)."""
    from trainwire.client.control.controller import Controller
    from trainwire.client.control.progress_bar import ProgressReporter

    settings = settings or DemoSettings()
    dirs = DemoDirs.at(work_dir)
    plan = demo_plan(dirs.models, settings)
    if server is not None:
        plan = ManagedTrainingPlan(
            plan.examples,
            plan.config.replace(model=dirs.model_reference(server, MODEL_NAME)),
            eval_examples=plan.eval_examples,
        )
    run_dir = dirs.root / "run"
    with demo_client(dirs, server) as client:
        reporter = ProgressReporter(quiet=quiet, metric=plan.config.metric_for_best)
        controller = Controller(client, plan, run_id=run_id, work_dir=run_dir, checkpoint_every=10)
        try:
            with model_found_by(server, dirs):  # the run's Open is the Controller's
                result = controller.run(on_step=reporter)
        finally:
            reporter.close()
    print(describe_result(result, run_dir))
    return result


def demo_run_id(fixed: str, work_dir: Path, *, server: str | None) -> str:
    """A demo's run id: ``fixed`` on its own local server (a fresh state directory each time),
    and on a ``--server`` one made of the work directory's name, since a closed run id stays
    closed there and each demo writes a new work directory."""
    if server is None:
        return fixed
    name = re.sub(r"[^A-Za-z0-9._-]", "-", work_dir.resolve().name)[:100]
    return f"{fixed}-{name}"


def describe_result(result: TrainingResult, run_dir: Path) -> str:
    evaluations = [r for r in result.history if r["kind"] == "evaluation"]
    accuracy = " → ".join(f"{r['eval_accuracy']:.2f}" for r in evaluations)
    return "\n".join(
        [
            "",
            f"eval accuracy by epoch  {accuracy}",
            f"best eval accuracy      {result.best_score:.3f} at step {result.best_step} "
            f"(epoch {result.best_epoch})",
            f"final state digest      {result.state_digest}",
            f"summary                 {run_dir / 'training_summary.json'}",
            f"loss curve              {run_dir / 'loss_curve.png'}",
            f"exported model          {run_dir / 'export'}",
            f"metrics log             {run_dir / 'metrics.jsonl'}",
        ]
    )


def summary_shows_learning(run_dir: Path, *, above: float = 0.75) -> bool:
    """True when the summary's best accuracy is well above chance."""
    summary = json.loads((run_dir / "training_summary.json").read_text())
    return summary["result"]["best_score"] >= above
