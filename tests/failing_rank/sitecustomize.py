"""One rank of a served group that fails by an exception inside an operation, injected from the
outside.

``trainwire serve --nproc N`` starts each rank as ``python -m trainwire serve ...`` with the
supervisor's environment, and so does a launcher such as torchrun; a test that puts this folder
on ``PYTHONPATH`` reaches every one of them, since Python imports ``sitecustomize`` at startup,
before the CLI runs. In the process whose ``RANK`` is ``FAIL_RANK`` (no other: not the
supervisor, not the other ranks) it wraps the sharded microbatch's loss so that the ``FAIL_AT``-th
training forward raises a RuntimeError once that forward's collectives have run: the rank fails
inside forward_backward, as a bug would, while rank 0 has gone on into the same call's backward.

It fires once per test, however many groups are started: the rank that fires first creates
``FAIL_MARKER`` (exclusively) and writes what it did there, and no rank fires once it exists, so
the restarted group runs the rest clean.

The failing rank imports the engine (and torch) here, before the CLI's first lines arm its
parent-death signal; a rank checks that its supervisor is still there once it does, so nothing
outlives a test. Any other ``sitecustomize`` is shadowed, in the test's server processes only.
"""

from __future__ import annotations

import os
from typing import Any

FAIL_RANK, FAIL_AT, FAIL_MARKER = (
    "TRAINWIRE_TEST_FAIL_RANK",
    "TRAINWIRE_TEST_FAIL_AT",
    "TRAINWIRE_TEST_FAIL_MARKER",
)
MESSAGE = "injected failure"


def _fail_inside_forward_backward(at: int, marker: str) -> None:
    from trainwire.server.engine.sharded.sharding import ShardedMicrobatch

    real_loss = ShardedMicrobatch.loss
    forwards = 0

    def loss(self: ShardedMicrobatch, model: Any, hook: Any, *, training: bool) -> Any:
        nonlocal forwards
        value = real_loss(self, model, hook, training=training)
        forwards += training
        if training and forwards == at:
            try:
                fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                return value  # fired already, in an earlier group
            what = f"{MESSAGE} on rank {os.environ['RANK']} in training forward {forwards}"
            os.write(fd, f"{what} (pid {os.getpid()})\n".encode())
            os.close(fd)
            raise RuntimeError(what)
        return value

    ShardedMicrobatch.loss = loss  # type: ignore[method-assign]


if os.environ.get(FAIL_MARKER) and os.environ.get("RANK") == os.environ.get(FAIL_RANK):
    _fail_inside_forward_backward(int(os.environ[FAIL_AT]), os.environ[FAIL_MARKER])
