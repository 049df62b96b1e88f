"""``trainwire serve``: one server process until SIGTERM or SIGINT, then a graceful stop.

The tunables ``--set KEY=VALUE`` may change, checked here (their defaults live beside the
server); the tokens are read from their files; the server itself is ``trainwire.server.serve``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import types
from pathlib import Path
from typing import Any

from trainwire.client.overrides import checked_config_overrides

logger = logging.getLogger(__name__)


# The server tunables ``trainwire serve --set KEY=VALUE`` may change, with their types: the one
# way to set them (their defaults live beside the server: trainwire.server.process and
# trainwire.server.grpc.listener).
SERVE_SETTINGS = {
    "max_message_bytes": int,
    "max_workers": int,
    "stop_grace_s": float,
    "keep_checkpoints": int,  # retention: a run's K newest checkpoints (and best); default all
}


def serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The server tunables: the defaults, then ``--set`` overrides (unknown keys are refused)."""
    from trainwire.server.grpc.listener import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_WORKERS
    from trainwire.server.process import DEFAULT_STOP_GRACE_S

    settings: dict[str, Any] = {
        "max_message_bytes": DEFAULT_MAX_MESSAGE_BYTES,
        "max_workers": DEFAULT_MAX_WORKERS,
        "stop_grace_s": DEFAULT_STOP_GRACE_S,
        "keep_checkpoints": None,
    }
    for key, value in checked_config_overrides(args.set).items():
        kind = SERVE_SETTINGS.get(key)
        if kind is None:
            raise ValueError(f"--set {key}: unknown; serve takes {', '.join(SERVE_SETTINGS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"--set {key}: must be a positive number, got {value!r}")
        settings[key] = kind(value)
    return settings


def command_serve(args: argparse.Namespace) -> int:
    """``trainwire serve``: serve until SIGTERM or SIGINT, then stop gracefully and exit 0."""
    from trainwire.client.files import write_text_atomic
    from trainwire.server.process import serve

    settings = serve_settings(args)
    token = _read_token(args.token_file) if args.token_file else None
    # Signal handlers first: a SIGTERM that arrives while the server starts still stops it cleanly.
    stop_requested = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop_requested.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    handle = serve(
        listen=args.listen,
        state_dir=args.state_dir,
        model_root=args.model_root,
        device=args.device,
        token=token,
        tls_cert=args.tls_cert and Path(args.tls_cert),
        tls_key=args.tls_key and Path(args.tls_key),
        tls_client_ca=args.tls_client_ca and Path(args.tls_client_ca),
        max_message_bytes=settings["max_message_bytes"],
        max_workers=settings["max_workers"],
        keep_checkpoints=settings["keep_checkpoints"],
        tinker_listen=args.tinker_listen,
        tinker_token=_read_token(args.tinker_token_file) if args.tinker_token_file else None,
        tinker_tokenizer_id=args.tinker_tokenizer_id,
    )
    if args.port_file:
        write_text_atomic(args.port_file, f"{handle.port}\n")
    while not stop_requested.wait(0.5):
        pass
    logger.info("%s received: finishing the operation in flight, then stopping", received[0])
    handle.stop(grace=settings["stop_grace_s"])
    return 0


def _read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token
