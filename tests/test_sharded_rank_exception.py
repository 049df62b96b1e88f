"""A rank that fails by an exception inside an operation, in real processes.

The other served-group tests fail a rank by a signal (SIGKILL, SIGSTOP). Here rank 1 raises a
RuntimeError in the middle of a forward_backward, after the forward's collectives, as a bug
would (``failing_rank/sitecustomize.py`` injects it from the outside, once, into the process
whose RANK is 1). docs/SHARDING.md says what follows: that is no refusal every rank makes alike,
so the ranks may be at different collectives; rank 1 leaves the group, rank 0 exits at once with
code 75 rather than wait in a collective rank 1 has left, and the group is restarted whole; its
rank 0 recovers from the latest checkpoint and the journal, and the run ends with the bits of one
never interrupted, each key applied once.

Two launchers: the test itself, as torchrun's agents or a pod controller start one rank each and
see only their own rank exit (so rank 0 must exit by itself), and ``trainwire serve --nproc 2``,
whose supervisor restarts the group. The plan and its reference are test_sharded_serve's (LoRA
with dropout, so each rank's RNG takes part): run uninterrupted in-process on two ranks, both
sides on one CPU thread a rank.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from process_cluster import Cluster, wait_until
from test_sharded_serve import ONE_THREAD, _assert_equals_reference
from test_sharded_serve import served_plan as served_plan  # the fixture, and its reference run

from trainwire.server.group.leader import GROUP_LOST_EXIT
from trainwire.testing import free_port

HOOK = Path(__file__).parent / "failing_rank"
FAILING_RANK = 1
# The fifth training forward: the first microbatch of the second epoch, after the checkpoint the
# controller asks for at step 2, so the new group recovers from a checkpoint and the journal.
FAIL_AT = 5
# A bound on waits for a process that must end by itself: several times what the whole run takes
# on a loaded machine (about 30 s), so only a hang reaches it.
EXIT_BOUND_S = 180

# Every test here is a served run of test_sharded_serve's LoRA plan, a minute or less.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.parametrize("served_plan", ["lora"], indirect=True),
]


def _fault(marker: Path) -> dict[str, str]:
    """The environment that makes rank 1 raise once (and every process run one CPU thread)."""
    return {
        **ONE_THREAD,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")])),
        "TRAINWIRE_TEST_FAIL_RANK": str(FAILING_RANK),
        "TRAINWIRE_TEST_FAIL_AT": str(FAIL_AT),
        "TRAINWIRE_TEST_FAIL_MARKER": str(marker),
    }


def _finish(cluster: Cluster) -> None:
    assert cluster.controller is not None
    assert _exit_code(cluster.controller) == 0, cluster.logs_text()


def _start_ranks(cluster: Cluster, environment: dict[str, str]) -> list[subprocess.Popen]:
    """Both ranks as a launcher starts them (torchrun's variables), each a process of its own:
    no supervisor is there to take one down when the other exits."""
    serve = cluster.server_args
    port = str(free_port())
    ranks = []
    cluster.starts += 1
    for rank in range(2):
        launch = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        log = open(cluster.logs / f"rank-{rank}-{cluster.starts}.log", "wb")  # noqa: SIM115
        env = {**os.environ, **environment, **launch}
        ranks.append(subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, env=env))
    return ranks


def _exit_code(process: subprocess.Popen) -> int | None:
    try:
        return process.wait(EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        return None


def test_rank_0_exits_by_itself_when_rank_1_raises_and_a_new_group_ends_with_the_same_bits(
    served_plan, model_root, tmp_path
):
    manifest, reference = served_plan
    cluster = Cluster(tmp_path, model_root, manifest)
    marker = tmp_path / "fault"
    ranks = _start_ranks(cluster, _fault(marker))
    cluster.start_controller()
    try:
        codes = [_exit_code(rank) for rank in ranks]
        assert marker.is_file(), cluster.logs_text()
        # Neither waits in a collective the other has left: each exits by itself, saying why.
        assert codes == [GROUP_LOST_EXIT, GROUP_LOST_EXIT], cluster.logs_text()
        logs = {r: (cluster.logs / f"rank-{r}-1.log").read_text(errors="replace") for r in (0, 1)}
        assert "rank 1 left the group: injected failure on rank 1" in logs[1], logs[1]
        assert "the session's ranks are out of step" in logs[0], logs[0]
        # The launcher starts a new group (the fault fired once); it recovers and serves on.
        ranks += _start_ranks(cluster, _fault(marker))
        _finish(cluster)
    finally:
        cluster.kill(cluster.controller)
        for rank in ranks:
            cluster.kill(rank)
    _assert_equals_reference(cluster, reference)


def test_a_rank_raising_under_serve_nproc_restarts_the_group_once_with_the_same_bits(
    served_plan, model_root, tmp_path
):
    manifest, reference = served_plan
    marker = tmp_path / "fault"
    cluster = Cluster(
        tmp_path,
        model_root,
        manifest,
        server_options=["--nproc", "2"],
        server_environment=_fault(marker),
    )
    cluster.start_server()
    cluster.start_controller()
    try:
        assert wait_until(marker.is_file, EXIT_BOUND_S), cluster.logs_text()
        _finish(cluster)
    finally:
        cluster.kill(cluster.controller)
        cluster.kill(cluster.server)
    log = (cluster.logs / "server-1.log").read_text(errors="replace")
    assert "rank 1 left the group: injected failure on rank 1" in log, log
    assert "restarting the group (restart 1)" in log, log
    assert "restart 2" not in log, "the group was restarted once, for the one failure"
    _assert_equals_reference(cluster, reference)
