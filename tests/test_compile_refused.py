"""Graph compilation is refused (Hugging Face's ``torch_compile``): a compiled graph's kernels
give other bits than eager mode, so a run that asked for it could not keep trainwire's promise of
the same bits in-process, remote and resumed. Refused by name in the config and at Open; false
(what every run is) is accepted and changes nothing, the fingerprint included."""

from __future__ import annotations

import grpc
import pytest
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import TrainingConfig


@pytest.mark.parametrize("asked", [True, "yes", 1, None])
def test_asking_for_graph_compilation_is_refused_with_the_reason(asked, tiny_llama):
    with pytest.raises(ValueError, match="torch_compile: graph compilation is refused"):
        TrainingConfig.from_dict({"model": str(tiny_llama), "torch_compile": asked})


def test_torch_compile_false_is_the_config_without_it(tiny_llama):
    plain = TrainingConfig.from_dict({"model": str(tiny_llama)})
    said = TrainingConfig.from_dict({"model": str(tiny_llama), "torch_compile": False})
    assert said == plain and said.fingerprint() == plain.fingerprint()


def test_an_open_that_asks_for_graph_compilation_is_invalid_argument_and_opens_nothing(
    tmp_path, model_root, llama_config
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        config = {**llama_config().to_dict(), "torch_compile": True}
        with pytest.raises(grpc.RpcError) as refused:
            client.open("run", config)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "graph compilation is refused" in refused.value.details()
        assert client.info().state != "open"
        client.close_channel()
