"""Many runs over a pool of servers, each server taking ``runs_per_server`` runs at a time.

Each server gets that many worker threads (its run slots). A free slot takes the next waiting run
that fits its server, drives it through the Controller (so every exactly-once and resume
guarantee holds), closes the run when it ends, and takes the next. A server of many runs
(``trainwire serve --max-runs K``) holds LoRA runs of one base model: a slot takes a run of the
base its server holds, a full-weights run only on an idle server (where it trains alone), and a
run of a base some other server holds with a slot free is left to that server, so runs of one
base fill a pod before another pod loads the base again (``_fits``). A server that dies keeps its
runs: each controller waits for it to come back and resumes from the checkpoint it restored.
Kubernetes (or any supervisor) restarts servers; this module schedules nothing of its own beyond
that placement.
"""

from __future__ import annotations

import logging
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

    @property
    def base(self) -> str:
        """The base model the run trains on (its config's ``model``)."""
        return self.plan.config.model

    @property
    def alone(self) -> bool:
        """A full-weights run changes its base: it trains alone on its server."""
        return self.plan.config.lora is None


@dataclass
class ServerSlots:
    """What a server holds now: its runs' base model and how many run there; ``broken`` once a
    run failed on it (it takes no more)."""

    base: str | None = None
    running: int = 0
    alone: bool = False
    broken: bool = False


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
        runs_per_server: int = 1,
    ) -> None:
        if not servers:
            raise ValueError("dispatch needs at least one server")
        if runs_per_server < 1:
            raise ValueError(f"runs per server must be at least 1, got {runs_per_server}")
        if not manifests:
            raise ValueError("dispatch needs at least one manifest")
        self.servers = list(servers)
        self.work_dir = Path(work_dir)
        self.client_factory = client_factory
        self.checkpoint_every = checkpoint_every
        self.window = window
        self.recovery_timeout_s = recovery_timeout_s
        self.runs_per_server = runs_per_server
        self.jobs: list[DispatchJob] = []
        for manifest in manifests:
            path = Path(manifest)
            plan = load_plan(path)
            self.jobs.append(DispatchJob(run_id_for(path, plan), path, plan))
        ids = [job.run_id for job in self.jobs]
        if len(set(ids)) != len(ids):
            raise ValueError("the same manifest is listed twice")
        self._waiting: list[DispatchJob] = list(self.jobs)  # in the order given
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)  # a run was taken or ended
        self._slots = {server: ServerSlots() for server in self.servers}

    def statuses(self) -> list[RunStatus]:
        with self.lock:
            return [RunStatus(**vars(job.status)) for job in self.jobs]

    def run(self) -> list[RunStatus]:
        """Drive every run to its end; returns the final statuses."""
        workers = [
            threading.Thread(
                target=self._serve_runs, args=(server,), name=f"dispatch-{server}-{slot}"
            )
            for server in self.servers
            for slot in range(self.runs_per_server)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return self.statuses()

    def _serve_runs(self, server: str) -> None:
        """One run slot of ``server``: the next run that fits it, until none is left for it."""
        while True:
            job = self._take(server)
            if job is None:
                return
            ok = self._drive(server, job)
            with self._changed:
                slots = self._slots[server]
                slots.running -= 1
                if slots.running == 0:
                    slots.base, slots.alone = None, False
                if not ok:
                    # The failed run's session may still be open there: this server takes no
                    # more runs, so one bad run does not fail the rest of the queue.
                    logger.error("server %s takes no more runs after %s failed", server, job.run_id)
                    slots.broken = True
                self._changed.notify_all()
            if not ok:
                return

    def _take(self, server: str) -> DispatchJob | None:
        """The first waiting run that fits ``server`` now (waiting while runs are left that may
        fit it once another ends); None when none is left for it."""
        with self._changed:
            while True:
                slots = self._slots[server]
                if slots.broken or not self._waiting:
                    return None
                job = next((j for j in self._waiting if self._fits(server, j)), None)
                if job is not None:
                    self._waiting.remove(job)
                    slots.base, slots.alone = job.base, job.alone
                    slots.running += 1
                    return job
                if not any(s.running for s in self._slots.values()):
                    return None  # nothing runs anywhere: nothing will change what fits
                self._changed.wait()

    def _fits(self, server: str, job: DispatchJob) -> bool:
        """Whether ``job`` may start on ``server`` now (under the lock): a free slot; the base
        it holds (a full-weights run alone, on an idle server); on an idle server, only a base
        no other server holds with a slot free (runs of one base fill one pod first)."""
        slots = self._slots[server]
        if slots.running >= self.runs_per_server or slots.alone:
            return False
        if slots.running:
            return not job.alone and slots.base == job.base
        return not any(
            other != server
            and not state.broken
            and state.running
            and not state.alone
            and state.base == job.base
            and state.running < self.runs_per_server
            and not job.alone
            for other, state in self._slots.items()
        )

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
