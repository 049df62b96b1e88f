"""Retention: a server told to keep K checkpoints keeps each run's K newest and its best."""

from __future__ import annotations

from host_operations import BATCHES, op

from trainwire.cli import build_parser
from trainwire.serve_command import serve_settings
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import CheckpointRequest, ForwardBackwardRequest


def names(host) -> list[str]:
    return sorted(path.name for path in host.state_dir.run("run").checkpoint_paths())


def test_a_run_keeps_its_newest_checkpoints_and_its_best(make_host, host_config):
    host = make_host(keep_checkpoints=2)
    host.open("run", host_config, 10, "sha256:plan")
    position = 0
    for name in ("step-1", "best", "step-2", "step-3", "step-4"):
        host.apply(
            ops.FORWARD_BACKWARD,
            ForwardBackwardRequest(BATCHES[position % len(BATCHES)]),
            op(f"fb-{name}", position),
        )
        saved = host.apply(
            ops.SAVE_STATE, CheckpointRequest(name), op(f"save-{name}", position + 1)
        )
        position = saved.position
    assert names(host) == ["best", "step-3", "step-4"]
    final = host.info()
    host.release()

    restarted = make_host(keep_checkpoints=2)
    info = restarted.info()
    assert (info.restored_checkpoint, info.position) == ("step-4", final.position)
    assert info.state_digest == final.state_digest


def test_without_retention_every_checkpoint_stays(host):
    for index in range(3):
        host.apply(ops.SAVE_STATE, CheckpointRequest(f"c{index}"), op(f"save-{index}", index))
    assert names(host) == ["c0", "c1", "c2"]


def test_keep_checkpoints_is_a_serve_setting():
    args = build_parser().parse_args(
        ["serve", "--listen", "127.0.0.1:0", "--state-dir", "s", "--set", "keep_checkpoints=3"]
    )
    assert serve_settings(args)["keep_checkpoints"] == 3
    default = build_parser().parse_args(["serve", "--listen", "127.0.0.1:0", "--state-dir", "s"])
    assert serve_settings(default)["keep_checkpoints"] is None
