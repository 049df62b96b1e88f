"""A run that fails on its own data does not hold the server: it closes itself and says how to go
on; a server held by another run says how to end it."""

from __future__ import annotations

import grpc
import pytest
from service_fixtures import connect, running_server

from trainwire.cli import main
from trainwire.client import InputExample, ManagedTrainingPlan, TrainingConfig, write_manifest
from trainwire.testing import tiny_text_examples


def run_args(target: str, manifest, run_id: str, work) -> list[str]:
    return ["run", "--server", target, "--manifest", str(manifest), "--run-id", run_id,
            "--work-dir", str(work), "--quiet"]  # fmt: skip


@pytest.mark.slow
def test_a_run_that_fails_on_its_data_closes_itself_and_the_next_run_opens(
    tiny_llama, model_root, tmp_path, capsys
):
    config = TrainingConfig(model=tiny_llama.name, batch_size=2, max_length=32)
    examples = tiny_text_examples(6)
    examples[4] = InputExample("a text far too long for thirty-two tokens " * 8)
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    write_manifest(bad, ManagedTrainingPlan(examples, config).to_manifest())
    write_manifest(good, ManagedTrainingPlan(tiny_text_examples(4), config).to_manifest())
    with running_server(tmp_path / "state", model_root) as handle:
        assert main(run_args(handle.target, bad, "first", tmp_path / "w1")) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("trainwire run: error: ")
        assert "tokens is over max_length 32" in err
        assert "run first is closed on the server" in err
        assert "run the new manifest under a new --run-id" in err
        assert main(run_args(handle.target, good, "second", tmp_path / "w2")) == 0


def test_a_server_held_by_another_run_names_the_command_that_ends_it(
    llama_config, model_root, tmp_path
):
    with running_server(tmp_path / "state", model_root) as handle:
        holder = connect(handle)
        holder.open("holder", llama_config())
        other = connect(handle)
        with pytest.raises(grpc.RpcError) as refused:
            other.open("newcomer", llama_config())
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "trainwire close --server HOST:PORT --run-id holder" in refused.value.details()
