"""A run whose session broke midway (an operation half applied) fails alone where other runs are
open: they go on serving, health stays up, and a restart restores it from its latest checkpoint.
The server's only run fails the server instead (health NOT_SERVING: a supervisor restarts it)."""

from __future__ import annotations

import pytest

from trainwire.client import LoraSettings
from trainwire.contract import outcomes
from trainwire.contract.outcomes import OperationSpec
from trainwire.server.errors import FailedPrecondition
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    CheckpointRequest,
    ForwardBackwardRequest,
    OptimStepRequest,
)
from trainwire.testing import tiny_text_examples

TEXTS = tiny_text_examples(3)


def _step(host, name: str, key: str) -> int:
    """A forward_backward and an update of run ``name``; the position after them."""
    host.apply(
        ops.FORWARD_BACKWARD, ForwardBackwardRequest(TEXTS), OperationSpec(f"{key}/fb"), run_id=name
    )
    return host.apply(
        ops.OPTIM_STEP, OptimStepRequest(), OperationSpec(f"{key}/step"), run_id=name
    ).position


def _break(host, name: str) -> None:
    """What a failure after an operation began to change tensors leaves: the session unusable."""
    with pytest.raises(RuntimeError), host._runs[name].session.breaks_on_failure("optim_step"):
        raise RuntimeError("a kernel failed midway")


def test_a_broken_run_fails_alone_the_others_serve_and_a_restart_restores_it(
    make_host, llama_config
):
    configs = {
        name: llama_config(lora=LoraSettings(r=4, alpha=8), seed=seed)
        for name, seed in (("a", 1), ("b", 2))
    }
    host = make_host(max_runs=2)
    for name, config in configs.items():
        host.open(name, config)
        _step(host, name, f"{name}/0")
        host.apply(
            ops.SAVE_STATE, CheckpointRequest("c"), OperationSpec(f"{name}/save"), run_id=name
        )
    saved = host.info("b")
    serving: list[bool] = []  # what health hears from here on
    host.lifecycle._on_serving = serving.append
    _break(host, "b")

    with pytest.raises(FailedPrecondition, match="unusable"):
        _step(host, "b", "b/1")
    assert host.info("b").state == outcomes.FAILED
    with pytest.raises(
        FailedPrecondition, match="restart the server to restore; the other runs serve"
    ):
        _step(host, "b", "b/2")
    assert _step(host, "a", "a/1") == 5  # the other run serves on
    with pytest.raises(FailedPrecondition, match="2 runs are open on this server: name the run"):
        _step(host, "", "unnamed")  # the failed run holds its slot: "" is not the other one
    assert host.phase == outcomes.OPEN and False not in serving  # health never went down
    host.release()

    restarted = make_host(max_runs=2)
    restored = restarted.info("b")
    assert restored.state == outcomes.OPEN
    assert (restored.position, restored.state_digest) == (saved.position, saved.state_digest)
    assert restarted.info("a").position == 3  # its checkpoint too: its client replays from it
    assert _step(restarted, "b", "b/1") == saved.position + 2


def test_the_servers_only_run_breaking_fails_the_server(make_host, llama_config):
    host = make_host()
    host.open("only", llama_config(lora=LoraSettings(r=4, alpha=8)))
    _step(host, "only", "only/0")
    _break(host, "only")
    with pytest.raises(FailedPrecondition, match="unusable"):
        _step(host, "only", "only/1")
    assert host.phase == outcomes.FAILED
    assert host.info().state == outcomes.FAILED
