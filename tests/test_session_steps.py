"""TrainingSession steps: forward_backward, optim_step and the schedule equal a plain hand-written
loop (renormalized accumulation, clipping, AdamW groups), gradient checkpointing gives the same
bits, dropout runs only in training, a decaying schedule without max_steps holds its rate, and
optim_step is refused with nothing accumulated.

Equality is by state digest or exact tensor equality, except against the plain loop: its loss is
transformers' own, over the whole logits at once, and the engine's is the chunked one
(``chunked_logprobs``), another float summation of the same mean; that comparison states its
tolerance.
"""

from __future__ import annotations

import re

import pytest
import torch
from fresh_state import fresh_digest
from transformers import AutoModelForCausalLM

from trainwire.client import LoraSettings, ManagedTrainingPlan
from trainwire.server.engine.optimization import learning_rate_at, parameter_groups
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import FailedPrecondition
from trainwire.testing import tiny_sentiment_examples, tiny_text_examples

TEXTS = tiny_text_examples(6)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_forward_backward_trains_with_dropout_and_forward_evaluates_without(
    llama_config, dropout
) -> None:
    lora = LoraSettings(r=4, alpha=8, dropout=dropout)
    session = TrainingSession(llama_config(lora=lora), max_steps=2)
    session.forward_backward(TEXTS[:3])
    assert all(module.training for module in session.model.modules())
    session.optim_step()  # lora_B moves off zero, so dropout on the adapters shows in the loss
    evaluated = session.forward(TEXTS[3:]).loss
    assert not any(module.training for module in session.model.modules())
    trained = session.forward_backward(TEXTS[3:])
    assert (trained != evaluated) == (dropout > 0)
    assert session.forward(TEXTS[3:]).loss == evaluated


# The plain loop's loss is transformers' cross-entropy over the whole logits; the engine's sums
# the same terms in chunks and per row, so losses of magnitude ~6 differ by an ulp or two (seen:
# 1 ulp, 8e-8 relative), the gradient norm likewise. AdamW turns those last bits into weights
# apart by at most 4.5e-7 after the two updates here, while one update moves a weight by about
# the learning rate (1e-3): a wrong rate, group, clipping or renormalization is far past 1e-5.
LOSS_RTOL, NORM_RTOL, WEIGHT_ATOL = 1e-6, 1e-5, 1e-5


def test_steps_equal_a_plain_hand_written_loop_with_partial_accumulation(
    llama_config, tiny_llama
) -> None:
    """Renormalize by the microbatches held, clip, AdamW with two groups: the plain loop's
    results to float tolerance (the tolerances above say why not bit for bit)."""
    config = llama_config(gradient_accumulation_steps=3, shuffle=False, max_grad_norm=0.5)
    plan = ManagedTrainingPlan(tiny_text_examples(14), config)
    held_per_update = [3, 2]  # 5 microbatches: one full accumulation, then a partial one of 2
    assert plan.batch_count == 5 and plan.max_steps == len(held_per_update)
    session = TrainingSession(config, max_steps=plan.max_steps)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(
        parameter_groups(model, config.weight_decay),
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
    )
    held = 0
    for i in range(plan.batch_count):
        engine_loss = session.forward_backward(plan.batch(i))
        loss = model(**session.encoder.encode(plan.batch(i)).inputs).loss
        loss.backward()
        held += 1
        assert engine_loss == pytest.approx(loss.item(), rel=LOSS_RTOL, abs=0)
        if not plan.is_update(i):
            continue
        assert held == held_per_update.pop(0)
        for p in model.parameters():
            p.grad /= held
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), config.max_grad_norm)
        rate = learning_rate_at(session.step, config, plan.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = rate
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        held = 0
        result = session.optim_step()
        assert result.learning_rate == rate
        assert result.grad_norm == pytest.approx(norm.item(), rel=NORM_RTOL, abs=0)

    engine = dict(session.model.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(engine[name], parameter, rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_sum_microbatches_adds_the_gradients_instead_of_averaging_them(llama_config) -> None:
    """Tinker's semantics: twice the same microbatch is twice its gradient, (g + g), exactly."""
    config = llama_config(lora=LoraSettings(r=4, alpha=8), max_grad_norm=None)
    summed, averaged = (TrainingSession(config, max_steps=3) for _ in range(2))
    for session in (summed, averaged):
        session.forward_backward(TEXTS[:3])
        session.forward_backward(TEXTS[:3])
    total = summed.optim_step(sum_microbatches=True)
    mean = averaged.optim_step()
    assert total.grad_norm == 2 * mean.grad_norm
    assert summed.state_digest() != averaged.state_digest()


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8)], ids=["full", "lora"])
def test_pending_gradients_are_renormalized_by_the_microbatches_held(llama_config, lora) -> None:
    """Twice the same microbatch, then an update, equals that microbatch once: (g + g) / 2 = g."""
    config = llama_config(lora=lora, max_grad_norm=None)
    twice = TrainingSession(config, max_steps=3)
    twice.forward_backward(TEXTS[:3])
    once_grads = {name: g.clone() for name, g in twice.pending_gradients().items()}
    twice.forward_backward(TEXTS[:3])
    for name, grad in twice.pending_gradients().items():
        assert torch.equal(grad, once_grads[name] * 2), "pending gradients are a plain sum"
    twice_result = twice.optim_step()

    once = TrainingSession(config, max_steps=3)
    once.forward_backward(TEXTS[:3])
    once_result = once.optim_step()
    assert twice_result == once_result
    assert twice.state_digest() == once.state_digest()


def test_optim_step_reports_the_scheduled_rate_and_the_step(llama_config) -> None:
    config = llama_config(warmup_steps=2, lr_scheduler="linear")
    session = TrainingSession(config, max_steps=4)
    rates = []
    for expected_step in range(1, 5):
        session.forward_backward(TEXTS[:3])
        result = session.optim_step()
        assert result.step == expected_step == session.step
        assert result.grad_norm > 0
        rates.append(result.learning_rate)
    lr = config.learning_rate
    assert rates == [0.0, lr / 2, lr, lr / 2]


@pytest.mark.parametrize("task", ["causal-lm", "sequence-classification"])
def test_gradient_checkpointing_gives_every_adapter_a_gradient_and_the_same_bits(
    llama_config, bert_classifier_config, small_lora, task
) -> None:
    factory = llama_config if task == "causal-lm" else bert_classifier_config
    examples = TEXTS if task == "causal-lm" else tiny_sentiment_examples(6)
    runs = {}
    for checkpointing in (False, True):
        session = TrainingSession(
            factory(lora=small_lora, gradient_checkpointing=checkpointing), max_steps=2
        )
        # Hooks on a decoder layer stay outside its checkpoint; its attention is recomputed.
        attention = next(
            module
            for name, module in session.model.named_modules()
            if re.search(r"layers?\.0\.(attention|self_attn)$", name)
        )
        calls: list[int] = []
        attention.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        losses = [session.forward_backward(examples[:3])]
        session.optim_step()  # lora_B starts at zero, so lora_A's first gradient is zero
        losses.append(session.forward_backward(examples[3:]))
        zero = [
            name
            for name, p in session.model.named_parameters()
            if p.requires_grad and (p.grad is None or not p.grad.ne(0).any())
        ]
        assert zero == [], f"no gradient for {zero} (checkpointing={checkpointing})"
        assert len(calls) == (4 if checkpointing else 2), "checkpointing recomputes each layer"
        session.optim_step()
        runs[checkpointing] = (losses, session.state_digest())
    assert runs[True] == runs[False]


def test_optim_step_without_forward_backward_is_refused(llama_config) -> None:
    session = TrainingSession(llama_config(), max_steps=2)
    with pytest.raises(FailedPrecondition, match=r"no microbatch accumulated.*forward_backward"):
        session.optim_step()
    session.forward_backward(TEXTS[:3])
    session.optim_step()
    digest = fresh_digest(session)
    with pytest.raises(FailedPrecondition, match="no microbatch accumulated"):
        session.optim_step()
    assert fresh_digest(session) == digest


def test_a_decaying_schedule_without_max_steps_holds_the_rate_and_says_so(
    llama_config, caplog
) -> None:
    with caplog.at_level("WARNING"):
        session = TrainingSession(llama_config(lr_scheduler="cosine", learning_rate=1e-3))
    assert "no horizon to decay over" in caplog.text
    rates = []
    for _ in range(3):
        session.forward_backward(TEXTS[:3])
        rates.append(session.optim_step().learning_rate)
    assert rates == [1e-3, 1e-3, 1e-3]
