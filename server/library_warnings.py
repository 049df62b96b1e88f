"""Warnings that libraries print on every run and that no user of trainwire can act on.

Each is matched exactly (category, message, the library module that warns), so any other
warning still shows. They come from calls the engine makes: the right fix is at that call
(passing the argument the library now wants, or a newer library), and then the entry goes.
Until then a server installs these filters once, when it starts (``trainwire.server.serve``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

# (category, message regex, module regex)
QUIET_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # PEFT's get_peft_model reads transformers' deprecated is_gradient_checkpointing property
    # (engine.model_loading.apply_lora); transformers v6 removes it and PEFT follows.
    (
        FutureWarning,
        r"`is_gradient_checkpointing` is deprecated",
        r"transformers\.modeling_utils",
    ),
    # PEFT's save_pretrained says it saves the embedding layers of an adapter that targets
    # them (the Tinker front's train_unembed): what the export wants anyway.
    (
        UserWarning,
        r"Setting `save_embedding_layers` to `True`",
        r"peft\.utils\.save_and_load",
    ),
)

# Around Trainer.fit: Lightning's CombinedLoader builds torch's deprecated LeafSpec (torch >=
# 2.10), Lightning's to fix; and its ModelCheckpoint notes a used checkpoint directory, which a
# resume uses by design (a fresh start into a used directory is refused before fit).
LIGHTNING_FIT_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    (UserWarning, r"Checkpoint directory .* exists and is not empty"),
)


def quiet_library_warnings() -> None:
    """Install the filters process-wide (the engine's calls run on the server's threads,
    where ``warnings.catch_warnings`` would not reach)."""
    for category, message, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


@contextlib.contextmanager
def lightning_fit_quieted() -> Iterator[None]:
    """Around ``Trainer.fit`` only: Lightning's notes no user acts on, silenced."""
    with warnings.catch_warnings():
        for category, message in LIGHTNING_FIT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
