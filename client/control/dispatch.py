"""Many runs over a pool of servers: one session per server, one run per server at a time.

Each server gets a worker thread that takes the next waiting run, drives it through the
Controller (so every exactly-once and resume guarantee holds), closes the session when the run
ends, and takes the next. A server that dies keeps its run: the controller waits for it to come
back and resumes from the checkpoint it restored. Kubernetes (or any supervisor) restarts
servers; this module schedules nothing of its own beyond that queue.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from trainwire.client.control.controller import DEFAULT_RECOVERY_TIMEOUT_S
from trainwire.contract.planning.manifest import load_plan
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.run.progress import Progress
from trainwire.contract.run.results import TrainingResult

logger = logging.getLogger(__name__)


@dataclass
class RunStatus:
    """One run's row in the live table."""

    run_id: str
    manifest: str
    batch_count: int
    server: str = ""
    state: str = "waiting"  # waiting, running, done, failed
    microbatch: int = 0
    step: int = 0
    loss: float | None = None
    eval_metric: str = ""
    result: TrainingResult | None = None
    error: str = ""


@dataclass
class DispatchJob:
    run_id: str
    manifest_path: Path
    plan: ManagedTrainingPlan
    status: RunStatus = field(init=False)

    def __post_init__(self) -> None:
        self.status = RunStatus(self.run_id, str(self.manifest_path), self.plan.batch_count)


def run_id_for(manifest_path: Path, plan: ManagedTrainingPlan) -> str:
    """A run id that names the manifest and its content: ``<stem>-<12 hex of fingerprint>``."""
    return f"{manifest_path.stem}-{plan.fingerprint.removeprefix('sha256:')[:12]}"


class Dispatcher:
    """Runs ``manifests`` over ``servers``; ``client_factory(target)`` makes a SessionClient."""

    def __init__(
        self,
        servers: Sequence[str],
        manifests: Sequence[str | Path],
        *,
        work_dir: str | Path,
        client_factory: Callable[[str], Any],
        checkpoint_every: int = 10,
        window: int = 1,
        recovery_timeout_s: float = DEFAULT_RECOVERY_TIMEOUT_S,
    ) -> None:
        if not servers:
            raise ValueError("dispatch needs at least one server")
        if not manifests:
            raise ValueError("dispatch needs at least one manifest")
        self.servers = list(servers)
        self.work_dir = Path(work_dir)
        self.client_factory = client_factory
        self.checkpoint_every = checkpoint_every
        self.window = window
        self.recovery_timeout_s = recovery_timeout_s
        self.jobs: list[DispatchJob] = []
        for manifest in manifests:
            path = Path(manifest)
            plan = load_plan(path)
            self.jobs.append(DispatchJob(run_id_for(path, plan), path, plan))
        ids = [job.run_id for job in self.jobs]
        if len(set(ids)) != len(ids):
            raise ValueError("the same manifest is listed twice")
        self._waiting: queue.Queue[DispatchJob] = queue.Queue()
        for job in self.jobs:
            self._waiting.put(job)
        self.lock = threading.Lock()

    def statuses(self) -> list[RunStatus]:
        with self.lock:
            return [RunStatus(**vars(job.status)) for job in self.jobs]

    def run(self) -> list[RunStatus]:
        """Drive every run to its end; returns the final statuses."""
        workers = [
            threading.Thread(target=self._serve_runs, args=(server,), name=f"dispatch-{server}")
            for server in self.servers
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return self.statuses()

    def _serve_runs(self, server: str) -> None:
        while True:
            try:
                job = self._waiting.get_nowait()
            except queue.Empty:
                return
            if not self._drive(server, job):
                # The failed run's session may still be open there: this server takes no more
                # runs, so one bad run does not fail the rest of the queue.
                logger.error("server %s takes no more runs after %s failed", server, job.run_id)
                return

    def _drive(self, server: str, job: DispatchJob) -> bool:
        """Drive one run to its end on ``server``; False when it failed."""
        from trainwire.client.control.controller import Controller

        with self.lock:
            job.status.server, job.status.state = server, "running"
        client = self.client_factory(server)
        try:
            controller = Controller(
                client,
                job.plan,
                run_id=job.run_id,
                work_dir=self.work_dir / job.run_id,
                checkpoint_every=self.checkpoint_every,
                window=self.window,
                recovery_timeout_s=self.recovery_timeout_s,
            )
            result = controller.run(on_step=lambda progress: self._record(job, progress))
        except Exception as error:  # one failed run must not stop the others
            logger.exception("run %s on %s failed", job.run_id, server)
            with self.lock:
                job.status.state, job.status.error = "failed", f"{type(error).__name__}: {error}"
            client.close_channel()
            return False
        with self.lock:
            job.status.state, job.status.result = "done", result
        try:
            client.close()  # ends the session: the server is free for the next run
        except grpc.RpcError as error:
            logger.error("run %s done, but closing its session on %s failed: %s",
                         job.run_id, server, error.details())  # fmt: skip
            return False
        finally:
            client.close_channel()
        return True

    def _record(self, job: DispatchJob, progress: Progress) -> None:
        with self.lock:
            status = job.status
            status.microbatch, status.step = progress.microbatch + 1, progress.step
            if progress.update is not None:
                status.loss = progress.update["loss"]
            if progress.evaluation is not None:
                metrics = {k: v for k, v in progress.evaluation.items() if k.startswith("eval_")}
                status.eval_metric = " ".join(f"{k}={v:.3f}" for k, v in metrics.items())


def status_table(statuses: Sequence[RunStatus], title: str = "trainwire dispatch") -> Any:
    """A rich table of the runs: server, progress, loss, eval, state."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("run", "server", "progress", "step", "loss", "eval", "state"):
        table.add_column(column)
    for s in statuses:
        state = s.state if not s.error else f"{s.state}: {s.error[:60]}"
        table.add_row(
            s.run_id,
            s.server or "-",
            f"{s.microbatch}/{s.batch_count}",
            str(s.step),
            "-" if s.loss is None else f"{s.loss:.4f}",
            s.eval_metric or "-",
            state,
        )
    return table


def dispatch_with_live_table(dispatcher: Dispatcher, *, live: bool = True) -> list[RunStatus]:
    """Run the dispatcher while a live table refreshes; print the summary table at the end."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    thread = threading.Thread(target=dispatcher.run, name="dispatch")
    thread.start()
    if live and console.is_terminal:
        with Live(
            status_table(dispatcher.statuses()), console=console, refresh_per_second=4
        ) as view:
            while thread.is_alive():
                thread.join(timeout=0.25)
                view.update(status_table(dispatcher.statuses()))
    thread.join()
    statuses = dispatcher.statuses()
    console.print(status_table(statuses, title="trainwire dispatch: summary"))
    return statuses
