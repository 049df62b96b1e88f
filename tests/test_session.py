"""TrainingSession operations: the math of a step, digests, RNG isolation, masking and refusals.

Equality is by state digest or exact tensor equality, never by tolerance: on CPU fp32 the engine
must produce the very bits a plain hand-written loop produces.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainwire.client import InputExample, LoraSettings, ManagedTrainingPlan, TrainingConfig
from trainwire.server import session as session_module
from trainwire.server.batching import IGNORE_INDEX
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound
from trainwire.server.optimization import learning_rate_at, parameter_groups
from trainwire.server.rng import RngState
from trainwire.server.session import TrainingSession
from trainwire.testing import SENTIMENT_LABELS, tiny_sentiment_examples, tiny_text_examples

TEXTS = tiny_text_examples(6)
PROMPT = "Question: what is 1 plus 2? Answer:"


# -- digests and RNG isolation ----------------------------------------------------------------


def test_state_digest_changes_after_every_state_changing_operation(
    llama_config, small_lora, tiny_llama, tmp_path
) -> None:
    session = TrainingSession(llama_config(lora=small_lora), max_steps=4)
    digests = [session.state_digest()]
    session.forward_backward(TEXTS[:3])
    digests.append(session.state_digest())
    session.forward_backward(TEXTS[3:])
    digests.append(session.state_digest())
    session.optim_step()
    digests.append(session.state_digest())
    session.forward_backward(TEXTS[:3])
    digests.append(session.state_digest())
    session.optim_step()
    digests.append(session.state_digest())
    session.load_weights(tiny_llama)  # the adapters keep their trained values, base unchanged
    assert session.state_digest() == digests[-1]
    assert len(set(digests)) == len(digests)

    # Operations that change no state leave the digest alone.
    session.forward(TEXTS)
    session.save_state(tmp_path / "checkpoint")
    session.export_weights(tmp_path / "export")
    assert session.state_digest() == digests[-1]


def test_digest_covers_the_session_rng(llama_config, small_lora) -> None:
    a = TrainingSession(llama_config(lora=small_lora))
    b = TrainingSession(llama_config(lora=small_lora))
    assert a.state_digest() == b.state_digest()
    b._guard.rng = RngState.seeded(123)
    b._guard.changed()
    assert a.state_digest() != b.state_digest()


def run_and_record(session: TrainingSession, operations: list) -> list[str]:
    digests = []
    for operation in operations:
        operation(session)
        digests.append(session.state_digest())
    return digests


OPERATIONS = [
    lambda s: s.forward_backward(TEXTS[:3]),
    lambda s: s.forward_backward(TEXTS[3:]),
    lambda s: s.optim_step(),
    lambda s: s.forward(TEXTS),
    lambda s: s.forward_backward(TEXTS[1:4]),
    lambda s: s.optim_step(),
]


def test_sessions_driven_identically_reach_equal_digests(llama_config, small_lora) -> None:
    config = llama_config(lora=small_lora)
    first = run_and_record(TrainingSession(config, max_steps=2), OPERATIONS)
    second = run_and_record(TrainingSession(config, max_steps=2), OPERATIONS)
    assert first == second
    assert len(set(first)) == len(first) - 1  # forward changes nothing


def test_interleaved_sessions_give_the_digests_each_gives_alone(llama_config, small_lora) -> None:
    config = llama_config(lora=small_lora)
    alone = run_and_record(TrainingSession(config, max_steps=2), OPERATIONS)
    other_config = llama_config(lora=small_lora, seed=7)
    other_alone = run_and_record(TrainingSession(other_config, max_steps=2), OPERATIONS)

    # A third party drawing from the global generators between operations changes nothing.
    torch.manual_seed(99)
    sessions = [TrainingSession(config, max_steps=2), TrainingSession(other_config, max_steps=2)]
    together: list[list[str]] = [[], []]
    for operation in OPERATIONS:
        for k, session in enumerate(sessions):
            torch.rand(3)
            global_state = torch.get_rng_state()
            operation(session)
            assert torch.equal(torch.get_rng_state(), global_state), "the global RNG moved"
            together[k].append(session.state_digest())
    assert together == [alone, other_alone]


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


# -- the math of a step -------------------------------------------------------------------------


def test_steps_equal_a_plain_hand_written_loop_with_partial_accumulation(
    llama_config, tiny_llama
) -> None:
    """Renormalize by the microbatches held, clip, AdamW with two groups: the same bits."""
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
        assert engine_loss == loss.item()
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
        assert (result.grad_norm, result.learning_rate) == (norm.item(), rate)

    engine = dict(session.model.named_parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(engine[name], parameter), name


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


# -- completion masking -------------------------------------------------------------------------


def test_completion_labels_mask_the_prompt_and_padding(llama_config) -> None:
    session = TrainingSession(llama_config())
    tokenizer = session.tokenizer
    examples = [InputExample(PROMPT, completion=" 3."), InputExample("Hi there.")]
    inputs = session.encoder.encode(examples).inputs

    prompt = tokenizer(PROMPT)["input_ids"]
    completion = tokenizer(" 3.", add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id]
    row = prompt + completion + eos
    assert inputs["input_ids"][0].tolist() == row
    assert inputs["labels"][0].tolist() == [IGNORE_INDEX] * len(prompt) + completion + eos
    plain = tokenizer("Hi there.")["input_ids"] + eos
    padding = len(row) - len(plain)
    assert inputs["labels"][1].tolist() == plain + [IGNORE_INDEX] * padding
    assert inputs["attention_mask"][1].tolist() == [1] * len(plain) + [0] * padding
    assert inputs["input_ids"][1].tolist()[len(plain) :] == [tokenizer.pad_token_id] * padding


def test_prompt_tokens_never_become_labels(llama_config) -> None:
    session = TrainingSession(llama_config())
    other_prompt = PROMPT.replace("1 plus 2", "3 plus 4")
    a = session.encoder.encode([InputExample(PROMPT, completion=" 3.")]).inputs
    b = session.encoder.encode([InputExample(other_prompt, completion=" 3.")]).inputs
    assert not torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["labels"], b["labels"])


def test_the_loss_counts_completion_tokens_only(llama_config) -> None:
    session = TrainingSession(llama_config())
    example = InputExample(PROMPT, completion=" 3.")
    inputs = session.encoder.encode([example]).inputs
    with torch.no_grad():
        logits = session.model(input_ids=inputs["input_ids"]).logits.float()[0, :-1]
    targets = inputs["input_ids"][0, 1:]
    completion = inputs["labels"][0, 1:] != IGNORE_INDEX
    assert completion.sum() == 3  # " 3." is two tokens, then the end of sequence
    cross_entropy = torch.nn.functional.cross_entropy
    completion_only = cross_entropy(logits[completion], targets[completion]).item()
    every_token = cross_entropy(logits, targets).item()

    loss = session.forward([example]).loss
    assert loss == completion_only
    assert loss != every_token
    assert session.forward([InputExample(PROMPT + " 3.")]).loss != loss


def test_truncation_cuts_long_examples_only_when_asked(llama_config) -> None:
    long_text = "The movie was good, and the food was great. " * 20
    refused = TrainingSession(llama_config(max_length=16))
    digest = refused.state_digest()
    batch = [InputExample("Hi."), InputExample(long_text)]
    with pytest.raises(InvalidArgument, match=r"example 1: \d+ tokens is over max_length 16"):
        refused.forward_backward(batch)
    with pytest.raises(InvalidArgument, match=r"example 1: \d+ tokens is over max_length 16"):
        refused.forward(batch)
    assert refused.state_digest() == digest

    truncating = TrainingSession(llama_config(max_length=16, truncation=True))
    batch = truncating.encoder.encode([InputExample(long_text)])
    assert batch.inputs["input_ids"].shape == (1, 16)
    truncating.forward_backward([InputExample(long_text)])
    with pytest.raises(InvalidArgument, match="leaves no completion token to learn"):
        truncating.forward_backward([InputExample(long_text, completion=" yes")])


# -- forward ------------------------------------------------------------------------------------


def test_forward_predicts_labels_and_changes_nothing(bert_classifier_config) -> None:
    session = TrainingSession(bert_classifier_config(), max_steps=1)
    examples = tiny_sentiment_examples(4)
    session.forward_backward(examples)
    digest = session.state_digest()
    result = session.forward(examples)
    assert session.state_digest() == digest
    assert len(result.predictions) == len(examples)
    for prediction in result.predictions:
        assert prediction.label in SENTIMENT_LABELS and len(prediction.scores) == 2
        top = max(range(2), key=prediction.scores.__getitem__)
        assert prediction.label == SENTIMENT_LABELS[top]
    assert session.forward(examples) == result


# -- refusals: nothing changes, nothing is allocated -----------------------------------------


@pytest.mark.parametrize(
    ("examples", "message"),
    [
        ([], "empty batch: send at least one example"),
        (
            [InputExample("Fine.", label="positive"), InputExample("Meh.", label="meh")],
            r"example 1: unknown label 'meh'; the config's labels are \['negative', 'positive'\]",
        ),
        ([InputExample("No label.")], r"example 0: missing label"),
        ([InputExample("")], "example 0: empty text"),
    ],
)
def test_bad_batches_are_refused_and_change_nothing(
    bert_classifier_config, examples, message
) -> None:
    session = TrainingSession(bert_classifier_config())
    session.forward_backward(tiny_sentiment_examples(3))
    digest = session.state_digest()
    for operation in (session.forward, session.forward_backward):
        with pytest.raises(InvalidArgument, match=message):
            operation(examples)
    assert session.state_digest() == digest


def test_optim_step_without_forward_backward_is_refused(llama_config) -> None:
    session = TrainingSession(llama_config(), max_steps=2)
    with pytest.raises(FailedPrecondition, match=r"no microbatch accumulated.*forward_backward"):
        session.optim_step()
    session.forward_backward(TEXTS[:3])
    session.optim_step()
    digest = session.state_digest()
    with pytest.raises(FailedPrecondition, match="no microbatch accumulated"):
        session.optim_step()
    assert session.state_digest() == digest


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


def test_fp16_and_worker_processes_are_refused_by_the_config(llama_config) -> None:
    with pytest.raises(ValueError, match="precision: fp16 is not supported"):
        llama_config(precision="fp16")
    with pytest.raises(ValueError, match="num_workers: must be 0"):
        llama_config(num_workers=2)


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if a session gets as far as loading its tokenizer or model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the session allocated before refusing")

    monkeypatch.setattr(session_module, "load_tokenizer", refuse)
    monkeypatch.setattr(session_module, "load_session_model", refuse)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_bf16_and_cuda_on_a_cpu_machine_are_refused_before_allocating(
    llama_config, no_model_loading
) -> None:
    with pytest.raises(ValueError, match=r"precision bf16 needs a CUDA device.*fp32"):
        TrainingSession(llama_config(precision="bf16"), device="cpu")
    with pytest.raises(ValueError, match="precision bf16 needs a CUDA device"):
        TrainingSession(llama_config(precision="bf16"))
    with pytest.raises(ValueError, match="CUDA is not available"):
        TrainingSession(llama_config(), device="cuda")


def test_bad_session_arguments_are_refused_before_allocating(
    llama_config, no_model_loading, monkeypatch
) -> None:
    with pytest.raises(ValueError, match="only cpu and cuda"):
        TrainingSession(llama_config(), device="meta")
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        TrainingSession(llama_config(), max_steps=0)
    with pytest.raises(ValueError, match="config must be a TrainingConfig"):
        TrainingSession(llama_config().to_dict())  # type: ignore[arg-type]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        TrainingSession(llama_config())
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="distributed process group"):
        TrainingSession(llama_config())


def test_model_paths_resolve_under_the_model_root(
    model_root, tiny_llama, tmp_path, no_model_loading
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    for name in ("../outside", str(outside)):
        config = TrainingConfig(model=name)
        with pytest.raises(InvalidArgument, match="resolves outside the model root"):
            TrainingSession(config, model_root=tmp_path / "root-that-holds-nothing")
    link_root = tmp_path / "root"
    link_root.mkdir()
    os.symlink(outside, link_root / "escape")
    with pytest.raises(InvalidArgument, match="'escape' resolves outside the model root"):
        TrainingSession(TrainingConfig(model="escape"), model_root=link_root)
    with pytest.raises(NotFound, match=r"no config\.json"):
        TrainingSession(TrainingConfig(model="missing"), model_root=model_root)


def test_a_model_named_relative_to_the_model_root_loads(model_root, tiny_llama) -> None:
    name = tiny_llama.relative_to(model_root).as_posix()
    session = TrainingSession(TrainingConfig(model=name, max_length=64), model_root=model_root)
    assert session.model_dir == Path(tiny_llama).resolve()
    assert session.forward(TEXTS[:2]).loss > 0


def test_sessions_on_two_threads_keep_their_own_bits(llama_config, small_lora) -> None:
    import threading

    def drive(session, steps=6):
        for i in range(steps):
            session.forward_backward(TEXTS[i % 4 : i % 4 + 3])
            session.optim_step()
        return session.state_digest()

    configs = [llama_config(lora=small_lora, seed=seed, max_length=64) for seed in (1, 2)]
    alone = [drive(TrainingSession(config, max_steps=6)) for config in configs]
    sessions = [TrainingSession(config, max_steps=6) for config in configs]
    digests: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: digests.update({i: drive(sessions[i])}))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [digests[0], digests[1]] == alone
