"""``trainwire --help`` and each command's help read as plain words and name every option."""

from __future__ import annotations

import re

import pytest

from trainwire.cli import build_parser
from trainwire.serve_command import SERVE_SETTINGS, SERVE_SETTINGS_HELP

COMMANDS = ("plan", "inspect", "runs", "run", "close", "dispatch", "train", "serve", "demo")


def help_text(*argv: str) -> str:
    parser = build_parser()
    for name in argv:
        parser = parser._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]
    return parser.format_help()


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_prints_no_source_markup(command: str) -> None:
    text = help_text(*([command] if command else []))
    assert not re.search(r"``|:class:|:func:|\*\*", text), text


def test_serve_help_names_every_tunable() -> None:
    assert set(SERVE_SETTINGS_HELP) == set(SERVE_SETTINGS)
    text = " ".join(help_text("serve").split())  # argparse wraps lines
    for key in SERVE_SETTINGS:
        assert key in text
