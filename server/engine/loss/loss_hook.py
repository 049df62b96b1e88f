"""The loss hook: the per-batch math a session runs, the one place to customize the loss.

Not a trainer: the session keeps the one optimizer loop (and Lightning's ``Trainer`` drives the
session in local runs). A hook only turns a batch into the output whose ``.loss`` backward runs
on, and may keep state that must resume exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainwire.contract.config import TrainingConfig
from trainwire.server.engine.loss.batching import Batch
from trainwire.server.engine.loss.losses import LossOutput, LossSpec
from trainwire.server.engine.loss.token_batches import TokenBatch, token_logprobs
from trainwire.server.errors import InvalidArgument


class LossHook:
    """The per-batch math of a session; subclass it for a custom loss or extra state.

    A subclass's ``session_state_dict()`` rides in the session checkpoint and the state digest,
    so state it keeps (a recovery buffer, say) resumes exactly.
    """

    def __init__(self, config: TrainingConfig) -> None:
        self.config = config

    def compute_loss(self, model: torch.nn.Module, batch: Batch, *, training: bool) -> Any:
        """The model's output for ``batch``; its ``.loss`` is what backward runs on.

        ``training`` is False under ``forward``, which must leave the hook's state alone.
        """
        return model(**batch.inputs)

    def compute_token_loss(
        self,
        model: torch.nn.Module,
        batch: TokenBatch,
        loss: LossSpec,
        config: Mapping[str, float],
        *,
        training: bool,
    ) -> tuple[LossOutput, torch.Tensor]:
        """A token batch's loss and the flat logprobs of its targets (``batch.mask`` order).

        The default runs the named loss function (``trainwire.server.engine.loss.losses``) on the
        model's logprobs; a subclass may add terms or state, as ``compute_loss`` may for text.
        """
        logp = token_logprobs(model, batch)
        return loss.fn(logp, batch.inputs, config), logp

    def session_state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_session_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise InvalidArgument(
                f"the checkpoint holds trainer state ({', '.join(sorted(state))}) that "
                f"{type(self).__name__} does not keep"
            )


LossHookFactory = Callable[[TrainingConfig], LossHook]
