"""A model name that is not there is answered with the names that are."""

from __future__ import annotations

import pytest

from trainwire.server.errors import NotFound


def test_an_unknown_model_lists_the_models_under_the_model_root(make_host, llama_config):
    host = make_host()
    with pytest.raises(NotFound) as refused:
        host.open("run", llama_config().replace(model="lama"), 10, "sha256:plan")
    message = str(refused.value)
    assert "model 'lama': no config.json there; name a model directory under the model root" in (
        message
    )
    assert "it holds " in message and "llama" in message
    assert "server" not in message  # train has no server, and says nothing of one
