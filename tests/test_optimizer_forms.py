"""The engine's AdamW runs in its multi-tensor (``foreach``) form: one kernel call per step for
every tensor of an adapter, rather than several per tensor, which is most of an update's cost on
a CPU shared with other threads. On the CPU it must give the per-tensor loop's bits exactly, or
a run's weights would depend on which form a server used: both forms are run here on the same
gradients and compared bit for bit (weights and moments)."""

from __future__ import annotations

import pytest
import torch

from trainwire.client import LoraSettings
from trainwire.server.engine.optimization import build_optimizer
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import tiny_text_examples


def per_tensor(session: TrainingSession) -> TrainingSession:
    """``session`` with its optimizer switched to the per-tensor loop (torch's CPU default)."""
    for group in session.optimizer.param_groups:
        group["foreach"] = False
    return session


def test_the_engine_builds_the_multi_tensor_form(llama_config) -> None:
    session = TrainingSession(llama_config(lora=LoraSettings(r=4, alpha=8)))
    assert all(group["foreach"] for group in session.optimizer.param_groups)
    model = torch.nn.Linear(3, 2)
    assert all(group["foreach"] for group in build_optimizer(model, llama_config()).param_groups)


@pytest.mark.parametrize(
    "settings",
    [
        {"lora": LoraSettings(r=4, alpha=8), "max_grad_norm": 0.5, "weight_decay": 0.1},
        {"lora": LoraSettings(r=8, alpha=16), "max_grad_norm": None},
        {"weight_decay": 0.01},  # full weights: matrices decay, norms do not
    ],
    ids=["lora-clipped", "lora-unclipped", "full-weights"],
)
def test_both_forms_give_a_session_the_same_bits_over_steps_and_per_update_settings(
    llama_config, settings
) -> None:
    config = llama_config(learning_rate=0.01, **settings)
    multi, loop = TrainingSession(config), per_tensor(TrainingSession(config))
    updates = [{}, {"beta1": 0.5, "eps": 1e-6}, {"weight_decay": 0.3, "max_grad_norm": 0.1}, {}]
    for step, update in enumerate(updates):
        batch = tiny_text_examples(3, seed=step)
        for session in (multi, loop):
            session.forward_backward(batch)
        assert multi.optim_step(**update) == loop.optim_step(**update)
        assert multi.state_digest() == loop.state_digest()
    moments = [multi.optimizer.state_dict()["state"], loop.optimizer.state_dict()["state"]]
    assert moments[0].keys() == moments[1].keys()
    for index, state in moments[0].items():
        for name, value in state.items():
            assert torch.equal(value, moments[1][index][name]), (index, name)


def test_both_forms_agree_on_tensors_of_every_shape_and_gradients_of_every_scale() -> None:
    """Scalars to wide matrices, gradients from 1e-30 to 1e6 (and exact zeros), steps where
    the bias corrections still matter and where they no longer do."""
    shapes = [(), (1,), (7,), (8, 32), (32, 8), (4, 1000), (1000, 4), (257, 3)]

    def trained(foreach: bool) -> tuple[list[torch.Tensor], dict]:
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
        groups = [
            {"params": params[3:], "weight_decay": 0.05},
            {"params": params[:3], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=3e-3, foreach=foreach)
        for step in range(40):
            scale = 10.0 ** (step % 37 - 30) if step % 5 else 0.0
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator) * scale
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [param.detach() for param in params], optimizer.state_dict()["state"]

    (multi, multi_state), (loop, loop_state) = trained(True), trained(False)
    for a, b in zip(multi, loop, strict=True):
        assert torch.equal(a, b)
    for index, state in multi_state.items():
        for name, value in state.items():
            assert torch.equal(value, loop_state[index][name]), (index, name)
