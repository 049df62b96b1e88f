"""What the device benchmarks (bench/tokens.py, bench/sampling.py) share: their options and main.

Imported as ``from common import ...``: run the scripts as ``python bench/<script>.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def run_on_device(
    description: str,
    quick_help: str,
    make_setup: Callable[[str, str | None, bool], Any],
    print_table: Callable[[Any, Path], None],
) -> None:
    """The main of bench/tokens.py and bench/sampling.py: options, setup, a header, the table."""
    args = device_arguments(description, quick_help)
    setup = make_setup(args.device, args.shape, args.quick)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
        + (f", {torch.cuda.get_device_name()}" if setup.device == "cuda" else "")
    )
    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        print_table(setup, Path(tmp))


def device_arguments(description: str, quick_help: str) -> argparse.Namespace:
    """The options bench/tokens.py and bench/sampling.py share, parsed and applied: the torch
    thread count, a clear refusal of ``--device cuda`` without CUDA, quiet transformers."""
    from transformers.utils import logging as transformers_logging

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--shape",
        choices=("tiny", "small", "qwen2-0.5b"),
        help="one model (default: tiny and small on cpu, qwen2-0.5b on cuda)",
    )
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's, one per core)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: CUDA is not available here (torch {torch.__version__}); "
            "run without --device for the CPU figures"
        )
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    return args
