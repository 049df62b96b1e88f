"""The rules a served group's ranks follow, checked without processes: what rank 0 announces,
which failures take the group down, how a rank reads its launcher, and what a follower does with
each message. (The served group itself, with real processes, is tests/test_sharded_serve.py.)"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
import torch

from trainwire.cli import main
from trainwire.server.engine.sharded.lockstep import (
    Announcer,
    Call,
    collective,
    raised_alike_on_every_rank,
)
from trainwire.server.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from trainwire.server.group import follower
from trainwire.server.group.messages import Stop
from trainwire.server.group.ranks import Launch


class ListChannel:
    """An in-process channel: what rank 0 sends, in order, for the other side to receive."""

    def __init__(self, messages: list[Any] | None = None) -> None:
        self.sent: list[Any] = []
        self._incoming = deque(messages or [])

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def receive(self) -> Any:
        return self._incoming.popleft()


class BrokenChannel:
    def send(self, message: Any) -> None:
        raise RuntimeError("Connection closed by peer")


class Engine:
    """A session-shaped object whose marked methods record what ran."""

    def __init__(self, announcer: Announcer | None) -> None:
        self.announcer = announcer
        self.ran: list[str] = []

    @collective
    def save_state(self, path: str, *, extra: dict | None = None) -> str:
        self.ran.append("save_state")
        return self.state_digest()  # nested: the other ranks make it inside their save_state

    @collective
    def state_digest(self) -> str:
        self.ran.append("state_digest")
        return "sha256:x"

    @collective
    def fail_with(self, error: BaseException) -> None:
        raise error


def failures() -> tuple[list[BaseException], Announcer, ListChannel]:
    seen: list[BaseException] = []
    channel = ListChannel()
    return seen, Announcer(channel, on_failure=seen.append), channel


def test_a_call_is_announced_once_with_its_arguments_and_nested_calls_are_not():
    _, announcer, channel = failures()
    engine = Engine(announcer)
    assert engine.save_state("c1", extra={"k": 1}) == "sha256:x"
    engine.state_digest()
    assert channel.sent == [
        Call("save_state", ("c1",), {"extra": {"k": 1}}),
        Call("state_digest", (), {}),
    ]
    assert engine.ran == ["save_state", "state_digest", "state_digest"]


def test_without_an_announcer_a_marked_method_is_a_plain_call():
    engine = Engine(None)
    assert engine.save_state("c1") == "sha256:x"
    assert engine.ran == ["save_state", "state_digest"]


@pytest.mark.parametrize(
    "error",
    [InvalidArgument("bad token id"), FailedPrecondition("no microbatch accumulated")],
)
def test_a_refusal_every_rank_makes_keeps_the_group(error):
    seen, announcer, _ = failures()
    with pytest.raises(type(error)):
        Engine(announcer).fail_with(error)
    assert seen == [] and raised_alike_on_every_rank(error)


def out_of_memory() -> ResourceExhausted:
    try:
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB")
    except RuntimeError as cause:
        try:
            raise ResourceExhausted("forward ran out of memory; nothing changed") from cause
        except ResourceExhausted as error:
            return error


@pytest.mark.parametrize(
    "error",
    [RuntimeError("Connection closed by peer"), KeyError("a bug"), out_of_memory()],
    ids=["lost-rank", "bug", "one-rank-out-of-memory"],
)
def test_anything_else_takes_the_group_down(error):
    seen, announcer, _ = failures()
    with pytest.raises(type(error)):
        Engine(announcer).fail_with(error)
    assert seen == [error] and not raised_alike_on_every_rank(error)


def refused_after_a_real_allocation_failure(message: str) -> ResourceExhausted:
    """What the engine's guard raises (``refuse_out_of_memory``: ``from None``), worded anew."""
    try:
        torch.empty(2**60, dtype=torch.uint8)  # the CPU allocator refuses at once
    except RuntimeError:
        try:
            raise ResourceExhausted(message) from None
        except ResourceExhausted as error:
            return error
    raise AssertionError("an exbibyte was allocated")


@pytest.mark.parametrize(
    "message",
    ["forward ran out of memory; nothing changed", "forward: the allocator refused 1 EiB"],
)
def test_a_refusal_raised_from_the_allocators_failure_is_one_ranks_own_whatever_its_words(
    message,
):
    error = refused_after_a_real_allocation_failure(message)
    seen, announcer, _ = failures()
    with pytest.raises(ResourceExhausted):
        Engine(announcer).fail_with(error)
    assert seen == [error] and not raised_alike_on_every_rank(error)


def test_a_refusal_that_quotes_out_of_memory_keeps_the_group():
    """The words are a user's (a model path): every rank refuses it alike."""
    error = FailedPrecondition("load_weights: 'models/out of memory' was saved for another task")
    seen, announcer, _ = failures()
    with pytest.raises(FailedPrecondition):
        Engine(announcer).fail_with(error)
    assert seen == [] and raised_alike_on_every_rank(error)


def test_an_announcement_that_cannot_be_sent_takes_the_group_down():
    seen: list[BaseException] = []
    engine = Engine(Announcer(BrokenChannel(), on_failure=seen.append))
    with pytest.raises(RuntimeError, match="closed by peer"):
        engine.state_digest()
    assert engine.ran == [] and len(seen) == 1


# -- a rank's launcher ---------------------------------------------------------------------------

LAUNCHED = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_a_launch_is_read_from_torchruns_variables_and_absent_without_them():
    assert Launch.from_environment({}) is None
    assert Launch.from_environment({"WORLD_SIZE": "1"}) is None
    launch = Launch.from_environment(LAUNCHED)
    assert launch == Launch(rank=1, world_size=2, local_rank=1) and not launch.leads


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"MASTER_PORT": ""}, "not MASTER_PORT"),
        ({"RANK": ""}, "not RANK"),
        ({"RANK": "two"}, "must be integers"),
        ({"RANK": "2"}, "RANK 2 is outside WORLD_SIZE 2"),
    ],
)
def test_a_half_set_launch_is_refused_naming_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        Launch.from_environment({**LAUNCHED, **change})


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--nproc", "0"], {}, "--nproc must be at least 1"),
        (["--nproc", "3"], LAUNCHED, "--nproc 3, but the launcher started WORLD_SIZE=2"),
        (["--rank-stall-timeout-s", "0"], {}, "--rank-stall-timeout-s must be positive"),
    ],
)
def test_a_wrong_nproc_is_refused_in_one_line_before_anything_starts(
    argv, environ, message, tmp_path, capsys, monkeypatch
):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    state = tmp_path / "state"
    code = main(["serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not state.exists()


# -- what a follower does with each message -----------------------------------------------------


class Group:
    """What ``follow`` reads of a joined group: its channel (and nothing else here)."""

    def __init__(self, messages: list[Any]) -> None:
        self.channel = ListChannel(messages)


def test_a_follower_stops_cleanly_when_rank_0_stops():
    follower.follow(Group([Stop()]))  # type: ignore[arg-type]


def test_a_follower_refuses_a_call_on_a_session_it_does_not_hold():
    with pytest.raises(RuntimeError, match="does not hold"):
        follower.follow(Group([Call("state_digest")]))  # type: ignore[arg-type]


def test_a_follower_refuses_a_message_no_rank_knows():
    with pytest.raises(RuntimeError, match="which no rank knows"):
        follower.follow(Group(["hello", Stop()]))  # type: ignore[arg-type]


def test_a_replaced_sessions_calls_are_refused_and_never_reach_the_other_ranks():
    _, announcer, channel = failures()
    replaced = Engine(announcer)
    announcer.retire("the session was replaced by another on this group")
    with pytest.raises(FailedPrecondition, match="state_digest: the session was replaced"):
        replaced.state_digest()
    assert channel.sent == [] and replaced.ran == []
