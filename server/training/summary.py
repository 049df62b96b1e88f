"""The seed's ``save_training_summary``, over the project's one summary writer.

The schema and the writing live in ``trainwire.contract.report.artifacts`` (torch-free, so the
controller writes the same summary without importing torch); this adds only what a local run
knows: the hardware it detected.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainwire.contract.config import TrainingConfig
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.report.artifacts import run_summary, write_summary
from trainwire.contract.run.results import TrainingResult
from trainwire.server.training.hardware import HardwareInfo


def save_training_summary(
    result: TrainingResult,
    config: TrainingConfig,
    hardware: HardwareInfo | None,
    output_dir: str | Path,
    format: str = "both",
    *,
    plan: ManagedTrainingPlan | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Write ``training_summary.json`` and/or ``.yaml`` into ``output_dir``.

    The summary records the final ``state_digest`` first, then the config's (and, given
    ``plan``, the manifest's) fingerprint, ``extra`` (JSON run details), the hardware (None
    allowed), the config and the result: the schema every runner writes. Files are written
    atomically.

    Args:
        result: the finished run's result.
        config: the configuration it trained with.
        hardware: the hardware it trained on, or None where unknown.
        output_dir: where the files go.
        format: ``json``, ``yaml`` or ``both``.

    Returns:
        Format (``json``, ``yaml``) to the path written.

    Example:
        >>> paths = save_training_summary(result, cfg, hw, Path("outputs"))
        >>> print(f"Summary saved to: {paths}")
    """
    summary = run_summary(
        result,
        config,
        plan=plan,
        hardware=None if hardware is None else hardware.to_dict(),
        **dict(extra or {}),
    )
    written = write_summary(output_dir, summary, format)
    return {kind: str(path) for kind, path in written.items()}
