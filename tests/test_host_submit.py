"""One entry point: ``SessionHost.submit(command)`` queues a request of either transport and
hands back its ticket. A gRPC-style command names the position its caller expects; a Tinker-
style command is numbered in its model's stream; the keyed job is the same for both, so they
order against each other on one run and one journal answers both."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from host_operations import BATCHES, op

from trainwire.server.errors import NotFound
from trainwire.server.service import operations as ops
from trainwire.server.service.active_run import wait_durable
from trainwire.server.service.commands import Applied, Command
from trainwire.server.service.host import SessionHost
from trainwire.server.service.journal import request_digest
from trainwire.server.service.requests import (
    ForwardBackwardRequest,
    ForwardRequest,
    OptimStepRequest,
)

BODY = "ab" * 32  # the digest a transport took of a request's body


def numbered(seq: int, request: object, **options: object) -> Command:
    """A Tinker-style command: ``seq`` of stream ``m``, keyed ``m/{seq}`` by its body digest."""
    operation = ops.OPTIM_STEP if isinstance(request, OptimStepRequest) else ops.FORWARD_BACKWARD
    return Command(
        operation, request, "run", op(f"m/{seq}"), stream="m", number=seq, digest=BODY, **options
    )


def accepting_numbered(host: SessionHost) -> None:
    """What a transport that numbers its requests does first: its stream, taking turns."""
    host.scheduler.start_stream("m", noun="model")
    host.scheduler.recovered()  # nothing to restore: numbered commands run when ready


def applied(ticket: Future[Applied | None]) -> Applied:
    result = ticket.result(timeout=60)
    assert isinstance(result, Applied)
    wait_durable(result.commit, "")
    return result


def test_a_ticket_resolves_with_the_outcome_and_the_commit_its_answer_waits_for(host):
    command = Command(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op=op("k0", 0))
    first = applied(host.submit(command))
    assert first.commit is not None and first.commit.done() and host.info().position == 1
    again = applied(host.submit(command))  # the same key: answered from the journal
    assert again.commit is None and again.outcome.replayed
    assert again.outcome.loss == first.outcome.loss and host.info().position == 1


def test_numbered_commands_run_in_their_streams_order_whatever_order_they_arrive_in(host):
    accepting_numbered(host)
    second = host.submit(numbered(2, OptimStepRequest()))
    assert not second.done()  # held: its predecessor has not come
    first = host.submit(numbered(1, ForwardBackwardRequest(BATCHES[0])))
    assert applied(first).outcome.position == 1
    assert applied(second).outcome.position == 2
    assert host.journal is not None
    entry = host.journal.lookup("m/2")
    assert entry is not None and entry.payload_sha256 == request_digest(BODY)


def test_a_grpc_call_pipelined_behind_a_numbered_one_waits_for_the_position_it_moves(
    make_host, host_config
):
    """Both transports' keyed jobs move one run: a call expecting position 1, sent before the
    numbered call that takes the run there, runs after it instead of being refused."""
    host = make_host()
    host.idle_release_s = 600.0  # held until its predecessor ran, however slow the machine
    host.open("run", host_config, 10, "sha256:plan")
    accepting_numbered(host)
    behind = host.submit(Command(ops.OPTIM_STEP, OptimStepRequest(), op=op("g1", 1)))
    assert not behind.done()
    first = host.submit(numbered(1, ForwardBackwardRequest(BATCHES[0])))
    assert applied(first).outcome.position == 1
    assert applied(behind).outcome.position == 2


def test_a_numbered_command_answered_before_its_turn_does_not_run(host):
    accepting_numbered(host)
    batch = ForwardBackwardRequest(BATCHES[0])
    skipped = host.submit(numbered(1, batch, runs_now=lambda: False))
    assert skipped.result(timeout=60) is None and host.info().position == 0
    assert host.journal is not None and host.journal.lookup("m/1") is None


def test_a_numbered_command_is_bound_to_its_run_at_its_turn(host):
    """Accepted already, it is not refused when submitted: its turn answers that its run is
    gone, and the next number still runs."""
    accepting_numbered(host)
    gone = Command(
        ops.OPTIM_STEP, OptimStepRequest(), "other", op("m/1"), stream="m", number=1, digest=BODY
    )
    with pytest.raises(NotFound, match="'other' is not open"):
        host.submit(gone).result(timeout=60)
    after = host.submit(numbered(2, ForwardBackwardRequest(BATCHES[0])))
    assert applied(after).outcome.position == 1


def test_a_read_is_never_numbered_by_position_and_needs_no_key(host):
    read = host.submit(Command(ops.FORWARD, ForwardRequest(BATCHES[0]))).result(timeout=60)
    assert isinstance(read, Applied) and read.commit is None and host.info().position == 0
    with pytest.raises(TypeError, match="give its key"):
        host.submit(Command(ops.OPTIM_STEP, OptimStepRequest()))
    with pytest.raises(NotFound, match="'nope' is not open"):
        host.submit(Command(ops.OPTIM_STEP, OptimStepRequest(), op=op("x", 0), run_id="nope"))
