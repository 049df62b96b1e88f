"""The Tinker SDK against ``trainwire serve --nproc 2``: the same bits as the in-process two-rank
session given the same engine calls.

The SDK runs the docs' supervised loop (a cross-entropy ``forward_backward`` on three sentences,
an ``optim_step``, three times) against a real two-rank server. The reference replays those
calls in-process on two ranks (``sharded_runs``' ``token_steps``): the run's config as the
server recorded it, each datum as the token example it is, each ``AdamParams`` as the front's
own ``adam_settings`` reads it, gradients added over microbatches as Tinker does. The losses and
the final state digest must be equal, exactly. Both sides run each rank on one CPU thread.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import sharded_workers as workers
import tinker
from tinker import types
from tinker_loops import KEY, SENTENCES, close_quietly, supervised_datum, supervised_loop
from transformers import AutoTokenizer

from trainwire.client import SessionClient
from trainwire.contract.tokens import TokenExample
from trainwire.server.service.state_dir import RunDirectory
from trainwire.server.tinker.model import adam_settings
from trainwire.testing import free_port

STEPS = 3
LEARNING_RATE = 1e-2  # supervised_loop's


def _sdk_loop(base_url: str) -> list[float]:
    """The docs' loop (``tinker_loops.supervised_loop``, learning rate 1e-2); its losses."""
    service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
    try:
        return supervised_loop(service, steps=STEPS)
    finally:
        close_quietly(service)


def _token_example(datum: types.Datum) -> TokenExample:
    inputs = datum.loss_fn_inputs
    return TokenExample(
        datum.model_input.to_ints(),
        inputs["target_tokens"].tolist(),
        weights=inputs["weights"].tolist(),
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_sdk_on_two_ranks_gives_the_in_process_two_rank_bits(tmp_path, model_root, tiny_llama):
    key_file = tmp_path / "tinker.key"
    key_file.write_text(KEY)
    grpc_target, tinker_port = f"127.0.0.1:{free_port()}", free_port()
    state = tmp_path / "state"
    server = subprocess.Popen(
        [sys.executable, "-m", "trainwire", "serve", "--listen", grpc_target,
         "--state-dir", str(state), "--model-root", str(model_root), "--device", "cpu",
         "--tinker-listen", f"127.0.0.1:{tinker_port}", "--tinker-token-file", str(key_file),
         "--token-file", str(key_file), "--nproc", "2"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        client = SessionClient(grpc_target, token=KEY)
        client.wait_until_serving(timeout_s=120)
        losses = _sdk_loop(f"http://127.0.0.1:{tinker_port}")
        info = client.info()
        client.close_channel()
    finally:
        server.terminate()
        stopped = server.wait(60)
    assert stopped == 0, "a SIGTERM stops the group cleanly"
    spec = RunDirectory(state / "runs" / info.run_id).read_spec()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)  # what get_tokenizer() loads
    examples = [_token_example(supervised_datum(tokenizer, text)) for text in SENTENCES]
    update = adam_settings({"adam_params": {"learning_rate": LEARNING_RATE}})
    reference = workers.launch(
        2,
        "token_steps",
        {
            "config": spec.config,
            "max_steps": spec.max_steps,
            "model_root": str(model_root),
            "steps": [{"examples": [e.to_dict() for e in examples], "update": update}] * STEPS,
            "out": str(tmp_path / "reference"),
        },
    )[0]
    assert losses == reference["losses"]
    assert info.state_digest == reference["state_digest"]
