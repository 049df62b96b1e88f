"""Issue 15, item 7: running out of memory on the CPU or out of disk during SaveState is
RESOURCE_EXHAUSTED with a message that says what to do; the state does not move, the previous
checkpoint stays intact, and the server keeps serving.

The failures are the exact exceptions torch and safetensors raise, injected where they arise
(the model's forward, the checkpoint's tensor files).
"""

from __future__ import annotations

import errno

import grpc
import pytest
from fresh_state import fresh_server_info
from safetensors import SafetensorError
from service_fixtures import NO_RETRY, TEXTS, connect, running_server

from trainwire.server.engine.session import checkpoint as session_checkpoint

CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
    "you tried to allocate 40000000000 bytes."
)
CPU_OOM_OLD = "[enforce fail at CPUAllocator.cpp:68] . DefaultCPUAllocator: can't allocate memory"
DISK_FULL = (
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
    'left on device" })'
)


@pytest.fixture
def served(tmp_path, model_root, llama_config):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("run", llama_config(), max_steps=4)
        client.forward_backward(TEXTS[:3], operation_key="fb0")
        client.save_state("latest", operation_key="save0")
        yield handle, client
        client.close_channel()


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("message", [CPU_OOM, CPU_OOM_OLD], ids=["not-enough", "cant-allocate"])
def test_a_cpu_allocation_failure_is_resource_exhausted_and_changes_nothing(served, message):
    handle, client = served
    before = fresh_server_info(handle)
    model = handle.session_host.session.model

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(message)

    model.forward = out_of_memory
    try:
        for call in (
            lambda: client.forward(TEXTS[:3]),
            lambda: client.forward_backward(TEXTS[3:6], operation_key="fb1"),
        ):
            error = _refused(call)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            assert "out of memory" in error.details()
            assert "smaller" in error.details()  # says what to do
    finally:
        del model.forward
    assert fresh_server_info(handle) == before
    assert client.forward_backward(TEXTS[3:6], operation_key="fb1").position == before.position + 1


@pytest.mark.parametrize(
    "error",
    [SafetensorError(DISK_FULL), OSError(errno.ENOSPC, "No space left on device")],
    ids=["safetensors", "oserror"],
)
def test_a_full_disk_during_save_state_is_resource_exhausted_and_keeps_the_last_checkpoint(
    served, monkeypatch, error
):
    handle, client = served
    client.forward_backward(TEXTS[3:6], operation_key="fb1")
    before = fresh_server_info(handle)
    checkpoint = handle.session_host.state_dir.run("run").checkpoint("latest")
    saved = {p.name: p.read_bytes() for p in checkpoint.iterdir()}

    def disk_full(*args, **kwargs):
        raise error

    monkeypatch.setattr(session_checkpoint, "save_tensors", disk_full)
    refused = _refused(lambda: client.save_state("latest", operation_key="save1"))

    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert "disk space" in refused.details() and "free space" in refused.details().lower()
    assert fresh_server_info(handle) == before
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == saved
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["latest"]
    monkeypatch.undo()
    assert client.save_state("latest", operation_key="save1").position == before.position + 1
