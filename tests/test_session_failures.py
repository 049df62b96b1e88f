"""A failure midway through an operation: one that leaves half-applied gradients (a fault in
backward) breaks the session, refusing every operation until load_state restores it, and the run
then resumes to the uninterrupted bits; an out-of-memory error in forward changes nothing.
"""

from __future__ import annotations

import pytest
import torch
from fresh_state import fresh_digest
from plans import drive_plan

from trainwire.client import ManagedTrainingPlan
from trainwire.server.engine.session import LossHook, TrainingSession
from trainwire.server.errors import FailedPrecondition, ResourceExhausted
from trainwire.testing import tiny_text_examples


class InjectedFault(RuntimeError):
    pass


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        raise InjectedFault("injected failure in backward")


class FaultyTrainer(LossHook):
    """Fails once, in the backward of the first decoder layer, when armed.

    Backward reaches layer 0 last, so by then the later layers' gradients have accumulated:
    the failure leaves half-applied gradients behind, as an OOM in backward would.
    """

    armed = False

    def compute_loss(self, model, batch, *, training):
        if not (training and self.armed):
            return super().compute_loss(model, batch, training=training)
        self.armed = False
        layer = next(m for name, m in model.named_modules() if name.endswith("layers.0"))

        def fail_in_backward(module, args, output):
            if isinstance(output, tuple):
                return (_FailInBackward.apply(output[0]), *output[1:])
            return _FailInBackward.apply(output)

        handle = layer.register_forward_hook(fail_in_backward)
        try:
            return super().compute_loss(model, batch, training=training)
        finally:
            handle.remove()


def test_a_failure_in_backward_refuses_everything_until_load_state(
    llama_config, small_lora, tmp_path
) -> None:
    config = llama_config(lora=small_lora, gradient_accumulation_steps=2)
    plan = ManagedTrainingPlan(tiny_text_examples(9), config)
    reference = TrainingSession(config, max_steps=plan.max_steps)
    drive_plan(reference, plan)

    session = TrainingSession(config, max_steps=plan.max_steps, loss_hook=FaultyTrainer)
    drive_plan(session, plan, 0, 1)  # mid-accumulation
    session.save_state(tmp_path / "checkpoint")
    digest = fresh_digest(session)
    gradients = {name: g.clone() for name, g in session.pending_gradients().items()}
    session.loss_hook.armed = True
    with pytest.raises(InjectedFault):
        session.forward_backward(plan.batch(1))
    pending = session.pending_gradients()
    changed = [name for name, grad in pending.items() if not torch.equal(grad, gradients[name])]
    assert changed, "the injected failure should leave half-applied gradients"

    refused = [
        lambda: session.forward(plan.batch(1)),
        lambda: session.forward_backward(plan.batch(1)),
        session.optim_step,
        lambda: session.save_state(tmp_path / "after-failure"),
        lambda: session.load_weights(tmp_path / "checkpoint"),
        lambda: session.export_weights(tmp_path / "export"),
    ]
    for operation in refused:
        with pytest.raises(FailedPrecondition, match=r"unusable.*InjectedFault"):
            operation()
    assert not (tmp_path / "after-failure").exists() and not (tmp_path / "export").exists()

    session.load_state(tmp_path / "checkpoint")
    assert fresh_digest(session) == digest
    drive_plan(session, plan, 1)
    assert session.state_digest() == reference.state_digest()


def test_out_of_memory_in_forward_changes_nothing(llama_config, small_lora) -> None:
    config = llama_config(lora=small_lora, gradient_accumulation_steps=2)
    plan = ManagedTrainingPlan(tiny_text_examples(9), config)
    reference = TrainingSession(config, max_steps=plan.max_steps)
    drive_plan(reference, plan)

    class OutOfMemoryOnce(LossHook):
        fail = False

        def compute_loss(self, model, batch, *, training):
            output = super().compute_loss(model, batch, training=training)  # draws dropout
            if self.fail:
                self.fail = False
                raise torch.OutOfMemoryError("pretend the device is full")
            return output

    session = TrainingSession(config, max_steps=plan.max_steps, loss_hook=OutOfMemoryOnce)
    drive_plan(session, plan, 0, 1)
    digest = fresh_digest(session)
    session.loss_hook.fail = True
    with pytest.raises(ResourceExhausted, match="forward_backward ran out of memory"):
        session.forward_backward(plan.batch(1))
    assert fresh_digest(session) == digest
    drive_plan(session, plan, 1)
    assert session.state_digest() == reference.state_digest()
