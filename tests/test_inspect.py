"""`trainwire inspect` on a session checkpoint and on an export."""

from trainwire.cli import main
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import tiny_text_examples


def test_inspect_describes_a_checkpoint_and_an_export(llama_config, tmp_path, capsys):
    session = TrainingSession(llama_config(), max_steps=4)
    session.forward_backward(tiny_text_examples(2))
    session.optim_step()
    session.forward_backward(tiny_text_examples(2, seed=1))
    session.save_state(tmp_path / "ckpt")
    session.export_weights(tmp_path / "export")

    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    text = capsys.readouterr().out
    assert "step         1 of 4, 1 microbatch(es) accumulated" in text
    assert session.state_digest() in text and "model.safetensors" in text

    assert main(["inspect", str(tmp_path / "export")]) == 0
    text = capsys.readouterr().out
    assert "kind         full (loads with transformers)" in text
    assert llama_config().fingerprint() in text


def test_inspect_refuses_what_it_does_not_know(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "neither a manifest" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
