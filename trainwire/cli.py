"""The ``trainwire`` command line: one subcommand per job, each a thin call into the package.

A user's mistake (a bad file, an unknown key, a refused setting) prints one line and exits with
status 2; it never prints a traceback. Server-side commands import torch lazily, so ``trainwire
plan`` and ``trainwire inspect MANIFEST`` stay torch-free.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwire import __version__
from trainwire.client.session.pipeline import DEFAULT_WINDOW
from trainwire.contract.config import InputExample, TrainingConfig
from trainwire.contract.planning.manifest import (
    check_numbered_examples,
    load_plan,
    read_config_file,
    read_numbered_examples,
    write_plan_manifest,
)
from trainwire.contract.planning.overrides import config_with_overrides
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.planning.token_lengths import TokenCounter
from trainwire.serve_command import add_serve_arguments, command_serve

if TYPE_CHECKING:
    import grpc

USAGE_ERROR = 2
# What ``trainwire --help`` says first: plain words (the module docstring is for readers of the
# code, and its markup would print as is).
DESCRIPTION = (
    "Train a model on a server you run, one keyed operation at a time: plan a run, serve a "
    "session, replay the plan against it (exactly once, through crashes), or try it all with "
    "trainwire demo."
)
logger = logging.getLogger(__name__)


class PrintConfigAction(argparse.Action):
    """``trainwire plan --print-config``: every config key with its default and meaning, then exit
    (as ``--help`` does, before the required options are asked for)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        sys.stdout.write(TrainingConfig.describe_keys())
        parser.exit()


class UsageError(Exception):
    """A mistake in what the user asked for: reported in one line, exit status 2."""


def server_refusal(error: BaseException, token_file: str | None = None) -> str | None:
    """The one line a server's refusal (a ``grpc.RpcError``) deserves, with its status; None
    for anything else. ``token_file``: the one the command was given, if any. grpc is looked
    up, not imported: ``plan`` never loads it."""
    grpc = sys.modules.get("grpc")
    if grpc is None or not isinstance(error, grpc.RpcError) or not hasattr(error, "code"):
        return None
    code, details = error.code(), " ".join((error.details() or "").split())
    if code == grpc.StatusCode.UNAUTHENTICATED:
        advice = (
            f"the token in --token-file {token_file} is not the one the server was started with"
            if token_file
            else "give --token-file, the file holding the token the server was started with"
        )
        return f"the server refused the token (UNAUTHENTICATED): {advice} ({details})"
    return f"{details} ({code.name})"


def command_plan(args: argparse.Namespace) -> int:
    config = config_with_overrides(read_config_file(args.config), args.set)
    if args.eval_examples and config.eval_strategy == "no":
        raise UsageError(
            "--eval-examples: the config's eval_strategy is 'no', so they would never be "
            "evaluated; set eval_strategy to epoch or steps, or leave them out"
        )
    counter = plan_token_counter(config, args.model_root)
    examples = checked_examples(args.examples, config, counter)
    eval_examples = (
        checked_examples(args.eval_examples, config, counter) if args.eval_examples else None
    )
    plan = ManagedTrainingPlan(examples, config, eval_examples=eval_examples)
    write_plan_manifest(args.output, plan)
    print(
        f"wrote {args.output}: {len(plan.examples)} examples, {plan.batch_count} microbatches, "
        f"{plan.max_steps} updates, {plan.fingerprint}"
    )
    if counter is None and not config.truncation:
        print(
            f"example lengths not checked against max_length {config.max_length}: model "
            f"{config.model!r} has no tokenizer.json here (give --model-root DIR, the folder "
            "that holds it, to check them now; the session checks each microbatch as it runs)",
            file=sys.stderr,
        )
    return 0


def checked_examples(
    path: str, config: TrainingConfig, counter: TokenCounter | None
) -> list[InputExample]:
    """The examples of a JSON-lines file, each checked against ``config`` (naming its line)."""
    numbered = read_numbered_examples(path)
    check_numbered_examples(path, numbered, config, counter)
    return [example for _, example in numbered]


def plan_token_counter(config: TrainingConfig, model_root: str | None) -> TokenCounter | None:
    """The counter of the config's model where the planning machine has it: under
    ``--model-root`` (which must then hold it), else as a path from the working directory."""
    directory = Path(model_root or ".") / config.model
    if model_root and not directory.is_dir():
        raise UsageError(f"--model-root {model_root}: no model {config.model!r} in it")
    return TokenCounter.from_model_directory(directory, config.task) if directory.is_dir() else None


def command_inspect(args: argparse.Namespace) -> int:
    from trainwire.inspection import describe_path

    print(describe_path(Path(args.path)))
    return 0


def command_runs(args: argparse.Namespace) -> int:
    from trainwire.open_runs import describe_open_runs

    print(describe_open_runs(Path(args.state_dir)))
    return 0


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """How a command reaches its server(s): token, TLS, mutual TLS."""
    parser.add_argument("--token-file", help="a file holding the server's bearer token")
    parser.add_argument("--tls-ca", help="PEM root certificates to verify a TLS server")
    parser.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="the name to verify in the server certificate")


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """SessionClient keyword arguments from add_client_arguments' flags."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    return {
        "token": Path(args.token_file).read_text().strip() if args.token_file else None,
        "root_certificates": Path(args.tls_ca).read_bytes() if args.tls_ca else None,
        "certificate_chain": Path(args.tls_cert).read_bytes() if args.tls_cert else None,
        "private_key": Path(args.tls_key).read_bytes() if args.tls_key else None,
        "server_name": args.tls_server_name,
    }


def add_window_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help=f"operations kept in flight, pipelined (default {DEFAULT_WINDOW}); same bits",
    )


def add_tensorboard_option(parser: argparse.ArgumentParser, directory: str) -> None:
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help=f"also write TensorBoard event files as it trains, in {directory}'s tensorboard/ "
        "(tensorboard --logdir there; needs trainwire[tensorboard])",
    )


def command_run(args: argparse.Namespace) -> int:
    import grpc

    from trainwire.client.control.controller import Controller
    from trainwire.client.control.progress_bar import ProgressReporter
    from trainwire.client.session.session_client import SessionClient
    from trainwire.contract.report.progress_text import best_text

    plan = load_plan(args.manifest)
    client = SessionClient(args.server, **client_options(args))
    metric = plan.config.metric_for_best
    reporter = ProgressReporter(quiet=args.quiet, log_every=args.log_every, metric=metric)
    try:
        controller = Controller(
            client,
            plan,
            run_id=args.run_id,
            work_dir=args.work_dir,
            checkpoint_every=args.checkpoint_every,
            window=args.window,
            tensorboard=args.tensorboard,
        )
        result = controller.run(on_step=reporter)
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        raise UsageError(closed_on_bad_data(client, args.run_id, error)) from None
    except KeyboardInterrupt:
        reporter.close()
        # The cursor on disk covers only what committed, so the same command takes up there.
        print(
            "trainwire run: interrupted; run the same command again to resume where it "
            f"stopped: trainwire {shlex.join(args.argv)}",
            file=sys.stderr,
        )
        return 130
    finally:
        reporter.close()
        client.close_channel()
    print(
        f"run {args.run_id} done at step {result.stopped_step}: "
        f"{best_text(metric, result.best_score, result.best_step)}\n"
        f"final state digest {result.state_digest}\n"
        f"summary in {Path(args.work_dir) / 'training_summary.json'}"
    )
    return 0


def closed_on_bad_data(client: Any, run_id: str, error: grpc.RpcError) -> str:
    """Close a run that its manifest's data failed (the same manifest fails there again, and an
    open run would hold a one-run server) and say how to go on."""
    try:
        client.close(run_id=run_id)
    except grpc.RpcError as closing:
        return (
            f"{error.details()}; the run could not be closed ({closing.details()}): end it with "
            f"trainwire close --run-id {run_id}, fix the data, plan again and run it under a new "
            "--run-id"
        )
    return (
        f"{error.details()}; run {run_id} is closed on the server (this manifest fails there "
        "again): fix the data, plan again, and run the new manifest under a new --run-id"
    )


def command_close(args: argparse.Namespace) -> int:
    """``trainwire close``: end a run on the server (a finished ``trainwire run`` does it itself),
    so the server takes the next one; the run's files stay in the state directory. ``--run-id``
    may be a Tinker model id as the SDK printed it: its run is closed, for both ports."""
    from trainwire.client.session.session_client import SessionClient
    from trainwire.contract.model_ids import run_id_for

    client = SessionClient(args.server, **client_options(args))
    try:
        info = client.close(run_id=run_id_for(args.run_id) if args.run_id else None)
    finally:
        client.close_channel()
    closed = info.run_id or "no run"
    print(f"{closed}: {info.state} at position {info.position}, step {info.step}")
    return 0


def command_dispatch(args: argparse.Namespace) -> int:
    from trainwire.client.control.dispatch import Dispatcher, dispatch_with_live_table
    from trainwire.client.session.session_client import SessionClient

    options = client_options(args)
    servers = [server.strip() for server in args.servers.split(",") if server.strip()]
    dispatcher = Dispatcher(
        servers,
        args.manifests,
        work_dir=args.work_dir,
        client_factory=lambda target: SessionClient(target, **options),
        checkpoint_every=args.checkpoint_every,
        window=args.window,
        runs_per_server=args.runs_per_server,
    )
    statuses = dispatch_with_live_table(dispatcher, live=not args.quiet)
    failed = [status.run_id for status in statuses if status.state != "done"]
    if failed:
        print(f"trainwire dispatch: {len(failed)} run(s) failed: {', '.join(failed)}")
        return 1
    return 0


def command_train(args: argparse.Namespace) -> int:
    from trainwire.server.training.run import load_run_plan, run_train_command

    if args.model_root is None:
        check_local_model(load_run_plan(args.manifest, args.set).config.model)
    return run_train_command(args)


def check_local_model(model: str) -> None:
    """Without ``--model-root``, ``train`` reads the config's model as a path from the working
    directory; a config planned for a server names it under that server's model root, so a
    missing directory most likely wants the option, and the message names it."""
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise UsageError(
            f"model {model!r}: no model directory at {path.resolve()}; give --model-root DIR, "
            "the folder that holds it (as trainwire serve's --model-root)"
        )


def command_demo(args: argparse.Namespace) -> int:
    from trainwire.demo import RUN_ID, DemoSettings, demo_run_id, run_demo
    from trainwire.rl_demo import RUN_ID as RL_RUN_ID
    from trainwire.rl_demo import RlDemoSettings, run_rl_demo

    # Each demo gets its own directory, so a second demo trains again instead of resuming.
    work_dir = Path(args.work_dir or Path("trainwire-demo") / time.strftime("%Y%m%d-%H%M%S"))
    fixed = RL_RUN_ID if args.rl else RUN_ID
    run_id = args.run_id or demo_run_id(fixed, work_dir, server=args.server)
    if args.rl:
        rl_settings = RlDemoSettings.fast() if args.fast else RlDemoSettings()
        run_rl_demo(
            work_dir, server=args.server, settings=rl_settings, quiet=args.quiet, run_id=run_id
        )
        return 0
    settings = DemoSettings.fast() if args.fast else DemoSettings()
    run_demo(work_dir, server=args.server, settings=settings, quiet=args.quiet, run_id=run_id)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainwire", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser.add_argument("--version", action="version", version=f"trainwire {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = commands.add_parser("plan", help="plan a run and write its manifest")
    plan.add_argument("--examples", required=True, help="training examples, one JSON per line")
    plan.add_argument("--eval-examples", help="evaluation examples, one JSON per line")
    plan.add_argument("--config", required=True, help="training config (.json or .yaml)")
    plan.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    plan.add_argument("--output", required=True, help="where to write the manifest")
    plan.add_argument(
        "--model-root",
        help="the folder that holds the config's model (as serve's): checks every example's "
        "length in tokens now, naming its line",
    )
    plan.add_argument(
        "--print-config",
        action=PrintConfigAction,
        help="print every config key with its default and meaning (a YAML to start from), and exit",
    )
    plan.set_defaults(handler=command_plan)

    inspect = commands.add_parser(
        "inspect", help="describe a manifest, a session checkpoint or an export"
    )
    inspect.add_argument("path")
    inspect.set_defaults(handler=command_inspect)

    runs = commands.add_parser(
        "runs",
        help="list a server's open runs (owner, age, last operation) from its state directory",
    )
    runs.add_argument("state_dir", metavar="STATE_DIR", help="the server's --state-dir")
    runs.set_defaults(handler=command_runs)

    run = commands.add_parser("run", help="replay a manifest against a server, crash-proof")
    run.add_argument("--server", required=True, help="the server's HOST:PORT")
    run.add_argument("--manifest", required=True, help="the manifest from trainwire plan")
    run.add_argument("--run-id", required=True, help="names the run in every operation key")
    run.add_argument("--work-dir", required=True, help="cursor, export and summary go here")
    run.add_argument("--checkpoint-every", type=int, default=10, help="updates per checkpoint")
    add_window_option(run)
    add_client_arguments(run)
    run.add_argument("--quiet", action="store_true", help="no progress output")
    run.add_argument("--log-every", type=int, default=10, help="updates per log line (no tty)")
    add_tensorboard_option(run, "--work-dir")
    run.set_defaults(handler=command_run)

    close = commands.add_parser(
        "close", help="end the open run on a server (or one by --run-id), keeping its files"
    )
    close.add_argument("--server", required=True, help="the server's HOST:PORT")
    close.add_argument(
        "--run-id",
        help="close only this run (or a Tinker model, by the id the SDK printed): a no-op if it "
        "is closed, refused if another is open",
    )
    add_client_arguments(close)
    close.set_defaults(handler=command_close)

    dispatch = commands.add_parser("dispatch", help="run many manifests over a pool of servers")
    dispatch.add_argument("--servers", required=True, help="comma-separated HOST:PORT list")
    dispatch.add_argument("--manifests", required=True, nargs="+", help="manifest files")
    dispatch.add_argument("--work-dir", required=True, help="one subdirectory per run")
    dispatch.add_argument("--checkpoint-every", type=int, default=10, help="updates per checkpoint")
    dispatch.add_argument(
        "--runs-per-server",
        type=int,
        default=1,
        help="runs a server takes at once: its trainwire serve --max-runs (LoRA runs of one base "
        "model fill a server before another loads that base; default 1)",
    )
    add_window_option(dispatch)
    add_client_arguments(dispatch)
    dispatch.add_argument("--quiet", action="store_true", help="no live table, summary only")
    dispatch.set_defaults(handler=command_dispatch)

    train = commands.add_parser("train", help="run a manifest locally through Lightning")
    train.add_argument("--manifest", required=True, help="the manifest from trainwire plan")
    train.add_argument("--output", required=True, help="checkpoints, logs, export and summary")
    train.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA where there is one")
    train.add_argument("--ckpt-path", help="resume: 'last', or a checkpoint file of this run")
    train.add_argument(
        "--model-root",
        help="the config's model resolves under this directory (default: from the working "
        "directory, as a path)",
    )
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    add_tensorboard_option(train, "--output")
    train.set_defaults(handler=command_train)

    serve = commands.add_parser("serve", help="serve one training session over gRPC")
    add_serve_arguments(serve)
    serve.set_defaults(handler=command_serve)

    demo = commands.add_parser("demo", help="the end-to-end demo on a bundled dataset")
    demo.add_argument("--work-dir", help="where it writes (default: trainwire-demo/<time>)")
    demo.add_argument(
        "--server",
        help="drive this server (HOST:PORT) instead of starting a local one; the demo writes "
        "its model under --work-dir, so give a --work-dir under that server's --model-root",
    )
    demo.add_argument(
        "--run-id",
        help="the run's id on the server (default: 'demo' on the local server; with --server, "
        "one of the work directory's name, so each demo is a new run there)",
    )
    demo.add_argument("--rl", action="store_true", help="the RL loop: sample, score, update")
    demo.add_argument("--fast", action="store_true", help="a shorter run (for tests)")
    demo.add_argument(
        "--quiet", action="store_true", help="no progress output, only where the results are"
    )
    demo.set_defaults(handler=command_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a rank of --nproc runs
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except BrokenPipeError:
        # The reader of our output left (``trainwire inspect ... | head``): nothing went wrong.
        # Point stdout at /dev/null so the interpreter's own flush at exit stays quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UsageError, ValueError, OSError) as error:
        print(f"trainwire {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except Exception as error:
        refusal = server_refusal(error, getattr(args, "token_file", None))
        if refusal is None:
            raise
        print(f"trainwire {args.command}: error: {refusal}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"trainwire {args.command}: interrupted", file=sys.stderr)
        return 130
