"""``trainwire serve``: one server process until SIGTERM or SIGINT, then a graceful stop.

The tunables ``--set KEY=VALUE`` may change, checked here (their defaults live beside the
server); the tokens are read from their files; the server itself is ``trainwire.server.serve``.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import logging
import re
import signal
import socket
import sys
import threading
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwire.contract.planning.overrides import checked_config_overrides
from trainwire.server.group.heartbeat import DEFAULT_RANK_STALL_TIMEOUT_S, start_rank_watch
from trainwire.server.group.launch import Launch
from trainwire.server.listen_address import split_listen
from trainwire.server.memory_release import release_freed_memory
from trainwire.server.port_keys import PortKeys, port_keys
from trainwire.server.serve_defaults import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_WORKERS,
    DEFAULT_STOP_GRACE_S,
)
from trainwire.server.service.tenants import Tenants, read_keys

DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")

if TYPE_CHECKING:  # torch behind them: imported where a command needs them
    from trainwire.server.group.board import GroupBoard
    from trainwire.server.group.leader import GroupLeader
    from trainwire.server.group.ranks import RankGroup

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
# What ``trainwire serve --help`` says of each: every tunable, so none is a secret.
SERVE_SETTINGS_HELP = {
    "max_message_bytes": "the largest request accepted (default 64 MiB)",
    "max_workers": "RPC threads",
    "stop_grace_s": "on SIGTERM, the time the operation in flight may take",
    "keep_checkpoints": "retention: after every save, each run keeps its K newest checkpoints "
    "and the one named best (default: all)",
}


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """``trainwire serve``'s options."""
    serve.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: any)")
    serve.add_argument("--state-dir", required=True, help="runs, journals, checkpoints, exports")
    serve.add_argument("--model-root", help="model paths resolve under this directory")
    serve.add_argument("--device", help="cpu, cuda or cuda:N (default: CUDA where there is one)")
    serve.add_argument(
        "--token-file",
        help="a file holding the bearer token clients must send, or a tenants map as --tenants "
        "takes (then for the gRPC port only). Beside --tinker-listen the front needs a key too "
        "(--tinker-token-file; it may be the same file): a keyed port never stands beside an "
        "open one",
    )
    serve.add_argument(
        "--tenants",
        metavar="FILE",
        help="YAML 'tenants: [{name, key, max_runs?, weight?}]': each key is a tenant that sees "
        "and touches only its own runs, checkpoints, futures and downloads (another tenant's "
        "answer 404), on both ports; a Tinker SDK key must start with 'tml-' (a tenant whose key "
        "does not uses gRPC only). Not with --token-file or --tinker-token-file",
    )
    serve.add_argument(
        "--max-runs",
        type=int,
        default=1,
        help="runs open at once (default 1). Beyond one: LoRA runs of one base model share its "
        "weights in memory, each with its own adapter, optimizer, position and files, served in "
        "turn; a full-weights run trains alone (gRPC only in this version)",
    )
    serve.add_argument("--tls-cert", help="PEM server certificate (enables TLS)")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument("--tls-client-ca", help="PEM CA that must sign client certificates (mTLS)")
    tunables = "; ".join(f"{key}: {text}" for key, text in SERVE_SETTINGS_HELP.items())
    serve.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a server tunable (repeatable). {tunables}",
    )
    serve.add_argument("--port-file", help="write the bound port here once listening")
    serve.add_argument(
        "--tinker-listen",
        help="HOST:PORT for the Tinker SDK front on the same session (needs trainwire[tinker])",
    )
    serve.add_argument(
        "--tinker-token-file",
        help="a file holding the key Tinker SDK clients must send (it must start with 'tml-'), "
        "or a tenants map as --tenants takes (then for the front only). Goes with "
        "--token-file, and is required with it or beyond loopback: the two keys guard the same "
        "runs, each on its own port (they may differ), and a keyed port never stands beside "
        "an open one (one map for both: --tenants)",
    )
    serve.add_argument(
        "--no-sample-batching",
        action="store_true",
        help="decode each sample request alone instead of batching concurrent ones (for a "
        "device whose kernels change a row's bits with the batch size; see docs/BENCHMARKS.md)",
    )
    serve.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="run the session across N processes on this node, one per device, each holding a "
        "shard of the model (FSDP2; rank 0 serves). Under torchrun, leave it out: the ranks "
        "come from torchrun (see docs/SHARDING.md)",
    )
    serve.add_argument(
        "--rank-stall-timeout-s",
        type=float,
        default=DEFAULT_RANK_STALL_TIMEOUT_S,
        help="with --nproc: a rank not heard of for this many seconds (stopped, or wedged so "
        "that it runs no code) is taken for failed and the group restarts from its latest "
        "checkpoint and journal, as for a rank that died; health is NOT_SERVING from half of it "
        f"(default {DEFAULT_RANK_STALL_TIMEOUT_S:g})",
    )
    serve.add_argument(
        "--tinker-tokenizer-id",
        help="what the SDK's get_tokenizer() loads on the client's side: a hub id or a path the "
        "client can read (default: the model's directory on this host)",
    )


def serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The server tunables: the defaults, then ``--set`` overrides (unknown keys are refused)."""
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
    """``trainwire serve``: serve until SIGTERM or SIGINT, then stop gracefully and exit 0.

    With ``--nproc N`` this process supervises N rank processes (``server/group``); under a
    launcher (torchrun, or that supervisor) it is one rank: rank 0 serves, the others follow.
    """
    release_freed_memory()  # before any thread allocates: the heaps are bounded from the first
    if not args.rank_stall_timeout_s > 0:
        raise ValueError(
            f"--rank-stall-timeout-s must be positive, got {args.rank_stall_timeout_s}"
        )
    # Every argument is checked before torch is imported (seconds): a mistake is one line at once.
    split_listen(args.listen, "--listen")
    if args.tinker_listen is not None:
        split_listen(args.tinker_listen, "--tinker-listen")
    keys = read_port_keys(args)  # a keyed port beside an open one is refused here too
    settings = serve_settings(args)
    check_device_name(args.device)
    check_files(args)
    launch = Launch.from_environment()
    check_nproc(args.nproc, launch)
    if args.max_runs < 1:
        raise ValueError(f"--max-runs must be at least 1, got {args.max_runs}")
    if args.max_runs > 1 and (args.nproc > 1 or launch is not None):
        raise ValueError(
            f"--max-runs {args.max_runs} with --nproc: a sharded group runs one session across "
            "its ranks; leave --max-runs out there"
        )
    board = start_rank_watch(args.rank_stall_timeout_s)  # before torch is imported
    from trainwire.server.group.ranks import join_group, leave_group, leave_group_and_exit

    if launch is None and args.nproc > 1:
        from trainwire.server.group.supervisor import supervise

        return supervise(args.argv, args.nproc, settings["stop_grace_s"], args.rank_stall_timeout_s)
    if launch is None:
        return _serve_until_stopped(args, settings, keys, None)
    group = join_group(launch, args.device)
    try:
        if not launch.leads:
            from trainwire.server.library_warnings import quiet_library_warnings

            quiet_library_warnings()  # as rank 0's serve() does: the same engine calls
            code = _follow_until_stopped(group)
        else:
            from trainwire.server.group.leader import GroupLeader

            code = _serve_until_stopped(args, settings, keys, GroupLeader(group), board)
    except BaseException:
        leave_group()
        raise
    leave_group_and_exit(code)


def read_port_keys(args: argparse.Namespace) -> PortKeys:
    """The keys of both ports from ``--tenants``, ``--token-file`` and ``--tinker-token-file``:
    read and checked before anything starts (``port_keys``: one map keys both ports, and a
    keyed port never stands beside an open one)."""
    tenants = Tenants.load(args.tenants) if args.tenants else None
    token = read_keys(args.token_file, "--token-file") if args.token_file else None
    tinker_token = (
        read_keys(args.tinker_token_file, "--tinker-token-file") if args.tinker_token_file else None
    )
    return port_keys(args.tinker_listen, tenants, token, tinker_token)


def _follow_until_stopped(group: RankGroup) -> int:
    """A rank other than 0: follow until rank 0 stops (0) or the group is lost (one line, and
    the code that tells the supervisor or torchrun to restart the group)."""
    from trainwire.server.group.follower import follow
    from trainwire.server.group.leader import GROUP_LOST_EXIT

    try:
        follow(group)
    except RuntimeError as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        logger.error("rank %d left the group: %s", group.launch.rank, reason)
        return GROUP_LOST_EXIT
    return 0


def check_device_name(device: str | None) -> None:
    """``--device`` names a device trainwire runs on (whether it is there is the session's to
    say, once torch is loaded)."""
    if device is not None and not DEVICE_NAME.fullmatch(device):
        raise ValueError(f"--device {device!r}: use cpu, cuda or cuda:N")


def check_files(args: argparse.Namespace) -> None:
    """The files serve reads at start exist and are files (read later, after torch loads), and
    the state directory is one, or can be made."""
    for option in ("tls_cert", "tls_key", "tls_client_ca"):
        value = getattr(args, option)
        if value is not None and not Path(value).is_file():
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} {value}: no such file")
    if args.model_root is not None and not Path(args.model_root).is_dir():
        raise ValueError(f"--model-root {args.model_root}: no such directory")
    state_dir = Path(args.state_dir)
    if state_dir.exists() and not state_dir.is_dir():
        raise ValueError(
            f"--state-dir {args.state_dir}: not a directory (serve keeps its runs there)"
        )
    if not state_dir.exists() and not _nearest_existing(state_dir).is_dir():
        raise ValueError(
            f"--state-dir {args.state_dir}: a file stands where its parent directory would be"
        )


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists (serve creates the rest of a state directory;
    the root always exists)."""
    return next(candidate for candidate in (path, *path.absolute().parents) if candidate.exists())


def check_nproc(nproc: int, launch: Launch | None) -> None:
    """``--nproc`` is at least 1, and under a launcher it agrees with the launcher's world."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    if launch is not None and nproc not in (1, launch.world_size):
        raise ValueError(
            f"--nproc {nproc}, but the launcher started WORLD_SIZE={launch.world_size} ranks; "
            "under torchrun leave --nproc out"
        )


def _serve_until_stopped(
    args: argparse.Namespace,
    settings: dict[str, Any],
    keys: PortKeys,
    leader: GroupLeader | None,
    board: GroupBoard | None = None,
) -> int:
    """One server (a single process, or rank 0 of a group led by ``leader``; a supervisor's
    group also has its ``board``) until a signal."""
    from trainwire.contract.files import write_text_atomic
    from trainwire.server.group.health import GroupHealth
    from trainwire.server.process import serve

    # Signal handlers first: a SIGTERM that arrives while the server starts still stops it cleanly.
    stop_requested = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop_requested.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    # SIGUSR1 writes every thread's stack to stderr and the server serves on: a server that
    # seems stuck can be read where it waits, without stopping it. The process's own stderr
    # (a descriptor; ``sys.stderr`` may be a stream without one where serve runs in a caller).
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    for option, listen in (("--listen", args.listen), ("--tinker-listen", args.tinker_listen)):
        check_address_free(option, listen)
    handle = serve(
        listen=args.listen,
        state_dir=args.state_dir,
        model_root=args.model_root,
        device=args.device if leader is None else str(leader.group.device),
        token=keys.grpc,
        tls_cert=args.tls_cert and Path(args.tls_cert),
        tls_key=args.tls_key and Path(args.tls_key),
        tls_client_ca=args.tls_client_ca and Path(args.tls_client_ca),
        max_message_bytes=settings["max_message_bytes"],
        max_workers=settings["max_workers"],
        keep_checkpoints=settings["keep_checkpoints"],
        tinker_listen=args.tinker_listen,
        tinker_token=keys.tinker,
        tinker_tokenizer_id=args.tinker_tokenizer_id,
        sample_batching=not args.no_sample_batching,
        session_factory=None if leader is None else leader.open_session,
        max_runs=args.max_runs,
        health_gate=None if board is None else GroupHealth(board, args.rank_stall_timeout_s).gate,
    )
    if args.port_file:
        write_text_atomic(args.port_file, f"{handle.port}\n")
    while not stop_requested.wait(0.5):
        pass
    logger.info("%s received: finishing the operation in flight, then stopping", received[0])
    handle.stop(grace=settings["stop_grace_s"])
    if leader is not None:
        leader.stop()
    return 0


def check_address_free(option: str, listen: str | None) -> None:
    """Refuse an address something already listens on, in one line, before the server binds
    it (gRPC would log its own multi-part error line first). ``command_serve`` refused an
    address that is not ``HOST:PORT`` already; port 0 and hosts this check cannot resolve are
    left to the server, which says what is wrong with them."""
    if listen is None:
        return
    host, port = split_listen(listen, option)
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise OSError(
                        f"{option} {listen}: the address is in use (another trainwire serve, or "
                        "another program, listens there); stop it or choose another port"
                    ) from None
                if error.errno == errno.EADDRNOTAVAIL:
                    raise OSError(
                        f"{option} {listen}: {host} is not an address of this machine"
                    ) from None
                raise
