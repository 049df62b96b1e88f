"""`trainwire serve --set`: server tunables from the command line, unknown ones refused."""

import subprocess
import sys

import pytest

from trainwire.cli import build_parser, main
from trainwire.serve_command import serve_settings
from trainwire.server.serve_defaults import DEFAULT_MAX_MESSAGE_BYTES


def parse(*extra):
    return build_parser().parse_args(
        ["serve", "--listen", "127.0.0.1:0", "--state-dir", "unused", *extra]
    )


def test_set_overrides_the_defaults():
    settings = serve_settings(parse("--set", "max_message_bytes=4096", "--set", "max_workers=4"))
    assert settings["max_message_bytes"] == 4096 and settings["max_workers"] == 4
    settings = serve_settings(parse("--set", "max_message_bytes=2048", "--set", "stop_grace_s=5"))
    assert settings["max_message_bytes"] == 2048 and settings["stop_grace_s"] == 5.0
    assert serve_settings(parse())["max_message_bytes"] == DEFAULT_MAX_MESSAGE_BYTES


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("bogus=1", "--set bogus: unknown; serve takes max_message_bytes"),
        ("max_workers=lots", "--set max_workers: must be a positive number"),
        ("max_workers=0", "must be a positive number"),
        ("max_workers", "--set takes key=value"),
    ],
)
def test_bad_settings_are_refused_in_one_line_before_serving(item, message, tmp_path, capsys):
    code = main(["serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path), "--set", item])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing was started or written"


def test_a_model_root_that_does_not_exist_is_refused_in_one_line(tmp_path, capsys):
    """Issue 24.7: serve started on a --model-root that did not exist, and every Open failed."""
    missing = tmp_path / "no-models-here"
    code = main(
        ["serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
         "--model-root", str(missing)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f"--model-root {missing}: no such directory" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-runs", "0"], "--max-runs must be at least 1, got 0"),
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
        (["--device", "tpu"], "--device 'tpu': use cpu, cuda or cuda:N"),
        (["--set", "nope=1"], "--set nope: unknown"),
        (["--tls-cert", "missing.pem"], "--tls-cert missing.pem: no such file"),
        (["--model-root", "missing"], "--model-root missing: no such directory"),
        # The resolver wraps a port past 65535: 99999 served on 34463, silently.
        (["--listen", "127.0.0.1:99999"], "--listen 127.0.0.1:99999: ports go from 0"),
        (["--listen", "localhost"], "--listen takes HOST:PORT (port 0 picks a free one)"),
        (["--tinker-listen", "127.0.0.1:70000"], "--tinker-listen 127.0.0.1:70000: ports go"),
        (["--state-dir", "a-file"], "--state-dir a-file: not a directory"),
        (["--state-dir", "a-file/state"], "--state-dir a-file/state: a file stands where"),
    ],
)
def test_every_argument_mistake_is_refused_before_torch_is_imported(tmp_path, extra, message):
    """Issue 46.9: serve's argument errors came after torch's import, 5-11 s after the command."""
    (tmp_path / "a-file").write_text("")
    script = (
        "import sys\nfrom trainwire.cli import main\n"
        f"code = main(['serve', '--listen', '127.0.0.1:0', '--state-dir', 'state', *{extra!r}])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert message in done.stderr and done.stderr.count("\n") == 1
