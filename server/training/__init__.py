"""Local runs through Lightning, and the run-management utilities that guard every resume.

``trainwire train`` runs a manifest on this machine: a LightningModule drives the one engine
(``TrainingSession``) through the plan's microbatches, so a local run ends with the same bits as
the remote replay. Importing this package imports torch and Lightning; the CLI imports it lazily.

The run-management utilities keep the seed's API (docs/DESIGN.md, "Local runs"):
its signatures, parameter names, dataclass fields and return shapes, so code written against
the seed runs unchanged; only the domain is this project's (``TrainingConfig``, LoRA settings).
Where this is deliberately stricter than the seed, the function's docstring says so.
"""

from trainwire.contract.planning.overrides import parse_config_overrides
from trainwire.contract.run.results import TrainingResult
from trainwire.server.training.callbacks import outcome_checkpoint, outcome_early_stopping
from trainwire.server.training.checkpoints import (
    CheckpointInfo,
    TrainCheckpointRecord,
    read_checkpoint,
    resolve_checkpoint,
)
from trainwire.server.training.guards import (
    refuse_a_fresh_start_into_a_used_directory,
    refuse_a_resume_from_another_directory,
    refuse_a_resume_of_a_stopped_run,
    refuse_a_resume_under_other_settings,
    refuse_other_constructor_settings,
)
from trainwire.server.training.hardware import (
    HardwareInfo,
    detect_hardware,
    effective_precision,
    get_gpu_memory_info,
)
from trainwire.server.training.module import ManifestModule
from trainwire.server.training.settings import constructor_settings, run_settings
from trainwire.server.training.summary import save_training_summary
from trainwire.server.training.trainer import create_trainer

__all__ = [
    "CheckpointInfo",
    "HardwareInfo",
    "ManifestModule",
    "TrainCheckpointRecord",
    "TrainingResult",
    "constructor_settings",
    "create_trainer",
    "detect_hardware",
    "effective_precision",
    "get_gpu_memory_info",
    "outcome_checkpoint",
    "outcome_early_stopping",
    "parse_config_overrides",
    "read_checkpoint",
    "refuse_a_fresh_start_into_a_used_directory",
    "refuse_a_resume_from_another_directory",
    "refuse_a_resume_of_a_stopped_run",
    "refuse_a_resume_under_other_settings",
    "refuse_other_constructor_settings",
    "resolve_checkpoint",
    "run_settings",
    "save_training_summary",
]
