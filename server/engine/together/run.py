"""``run_together``: one pass over a shared base for several sessions' forward_backward (or
forward) requests, each session ending exactly as it ends running its request alone."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from trainwire.contract.config import InputExample
from trainwire.contract.tokens import DEFAULT_LOSS, TokenExample
from trainwire.server.engine.loss.chunked_logprobs import final_hidden_states, logit_transform
from trainwire.server.engine.loss.microbatches import Microbatch
from trainwire.server.engine.session.operation_guard import refuse_out_of_memory
from trainwire.server.engine.session.results import ForwardResult, TokenOutput
from trainwire.server.engine.session.rng import preserved_global_rng
from trainwire.server.engine.session.session import TrainingSession
from trainwire.server.engine.together.compatibility import session_problem, shape_problem
from trainwire.server.engine.together.row_blocks import adapters_by_row_block, base_layer
from trainwire.server.engine.together.row_invariance import RowInvariance
from trainwire.server.engine.together.stacked_head import HeadRows, stacked_logprobs
from trainwire.server.errors import FailedPrecondition


@dataclass(frozen=True)
class Request:
    """One session's ``forward_backward`` (or ``forward``) call, as its arguments. One request
    runs in at most one pass (its ``microbatch`` carries that pass's loss and outputs)."""

    session: TrainingSession
    examples: Sequence[InputExample | TokenExample]
    loss_fn: str = DEFAULT_LOSS
    loss_fn_config: Mapping[str, float] | None = field(default=None)

    @functools.cached_property
    def microbatch(self) -> Microbatch:
        """The request as its session encodes it (InvalidArgument where it refuses it), once:
        grouping reads its width, the pass its tensors (tokenizing is a large part of a small
        model's step)."""
        return self.session.encode(self.examples, self.loss_fn, self.loss_fn_config)


Result = float | ForwardResult | TokenOutput


def run_together(
    requests: Sequence[Request], invariance: RowInvariance, *, backward: bool = True
) -> list[Result]:
    """Run every request in one pass over the base the sessions share; each its result.

    With ``backward`` every request is a ``forward_backward``, else a ``forward``. The base
    runs once over every request's rows stacked, each session's adapter on its own rows
    (``row_blocks``), then the base's head once over stacks of every row's chunks, each chunk
    under its own session's head adapter where it has one (``stacked_head``);
    each session's loss comes from its own rows' logprobs as the default ``LossHook`` computes
    it (``compatible`` refuses other hooks: they may run forwards of their own), and one
    backward of the sum of the losses (whose gradient to each loss is exactly 1) leaves each
    adapter the gradients of its own rows only. Each session ends with the state and returns the
    result it gets running its request alone, bit for bit, where ``compatible`` allows the
    requests together under ``invariance`` (the device's ``row_invariance``): callers ask it
    first and otherwise run the requests in turns.

    Validation comes first: requests ``compatible`` would refuse (FailedPrecondition, with its
    reason) and a request its session refuses (InvalidArgument, a broken session) raise before
    any session changes. Out of memory before the backward changes nothing
    (ResourceExhausted); a failure during the backward leaves every session of the pass broken
    until a ``load_state``, as it leaves a session alone.
    """
    what = "forward_backward" if backward else "forward"
    sessions = [request.session for request in requests]
    _refuse(session_problem(sessions))
    with contextlib.ExitStack() as held:
        # One lock order for every pass: two passes over overlapping sessions never deadlock.
        order = sorted(range(len(requests)), key=lambda i: id(requests[i].session))
        microbatches = [request.microbatch for request in requests]  # InvalidArgument first
        _refuse(shape_problem([mb.model_inputs()[0].shape for mb in microbatches], invariance))
        for index in order:
            held.enter_context(
                requests[index].session.shared_pass(microbatches[index], training=backward)
            )
        with preserved_global_rng(), torch.set_grad_enabled(backward):
            drawn_from = torch.get_rng_state()
            models = [session.model for session in sessions]
            rows = [microbatch.model_inputs()[0].shape[0] for microbatch in microbatches]
            with adapters_by_row_block(models, rows):
                with refuse_out_of_memory(what):
                    losses = _losses(sessions, microbatches, invariance)
                if backward:
                    with contextlib.ExitStack() as breaks:
                        for session in sessions:
                            breaks.enter_context(session.breaks_on_failure(what))
                        torch.stack(losses).sum().backward()
                        _refuse_draws(drawn_from)
            if not backward:
                _refuse_draws(drawn_from)
        if backward:
            return [mb.backward_result(loss) for mb, loss in zip(microbatches, losses, strict=True)]
        return [mb.forward_result(loss) for mb, loss in zip(microbatches, losses, strict=True)]


def _losses(
    sessions: Sequence[TrainingSession],
    microbatches: Sequence[Microbatch],
    invariance: RowInvariance,
) -> list[torch.Tensor]:
    """Each session's loss from its own rows of one forward of the leader over all of them,
    through the base's head over all their chunks, each with its own head adapter
    (``stacked_head``)."""
    inputs = [microbatch.model_inputs() for microbatch in microbatches]
    input_ids = torch.cat([ids for ids, _ in inputs])
    attention_mask = torch.cat([mask for _, mask in inputs])
    leader = sessions[0].model
    hidden, head = final_hidden_states(leader, input_ids, attention_mask)
    parts = [
        HeadRows(session.model.get_output_embeddings(), states, *microbatch.head_targets())
        for session, states, microbatch in zip(
            sessions, hidden.split([ids.shape[0] for ids, _ in inputs]), microbatches, strict=True
        )
    ]
    logprobs = stacked_logprobs(
        base_layer(head),
        logit_transform(leader.config),
        parts,
        budget_bytes=sessions[0].encoder.logits_chunk_bytes,
        min_rows=invariance.min_rows,
        max_rows=invariance.head_rows,
    )
    return [
        microbatch.loss_of_logprobs(logp)
        for microbatch, logp in zip(microbatches, logprobs, strict=True)
    ]


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise FailedPrecondition(f"these requests cannot run together: {problem}")


def _refuse_draws(before: torch.Tensor) -> None:
    if not torch.equal(before, torch.get_rng_state()):
        raise RuntimeError(
            "a shared pass drew from the torch generator: each session would draw other "
            "numbers than alone"
        )
