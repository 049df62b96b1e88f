"""Token logprobs and losses over chunks of positions (``chunked_logprobs``), text causal-lm
losses included: never a logits tensor for every token, the plain values to float tolerance, and
every exactness promise kept (run to run, across a resume, the sampler's logprobs the trainer's,
gradient checkpointing, two ranks)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import sharded_workers as workers
import torch
from fresh_state import fresh_digest
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainwire.client import InputExample, LoraSettings, TokenExample, TrainingConfig
from trainwire.server.engine.loss.batching import BatchEncoder
from trainwire.server.engine.loss.chunked_logprobs import (
    chunked_target_logprobs,
    positions_per_chunk,
)
from trainwire.server.engine.loss.loss_hook import causal_lm_loss
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import make_tiny_architecture, tiny_text_examples, tiny_token_examples

VOCAB = 500  # the tiny llama's
CHUNK = 3  # positions a chunk: every test sequence spans several chunks
CHUNK_BYTES = CHUNK * VOCAB * 4
# fp32 on the CPU: the chunked path multiplies the head over 3 rows at a time instead of every
# row at once (another blocking of the same sums) and reduces with logsumexp instead of
# log_softmax. Both round differently in the last bits; values of magnitude ~6 (log 500) differ
# by a few ulps (~1e-6), gradients by a few ulps of their size.
ATOL, RTOL = 1e-5, 1e-4
# LoRA with dropout, on the head too: the chunks' recomputation must draw the same masks.
HEAD_LORA = LoraSettings(r=4, alpha=8, dropout=0.1, target_modules=("q_proj", "lm_head"))
SETUPS = {"full": None, "lora": HEAD_LORA}


class LargestVocabularyRows(TorchDispatchMode):
    """The most positions any tensor ending in the vocabulary held, over every op run (the
    backward's too: on the CPU it runs on the calling thread, under this mode)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == self.vocab:
                self.rows = max(self.rows, tensor.numel() // self.vocab)
        return out


def long_example(length: int, seed: int = 0) -> TokenExample:
    rng = random.Random(seed)
    tokens = [rng.randrange(3, VOCAB) for _ in range(length + 1)]
    return TokenExample(
        tokens[:-1], tokens[1:], advantages=[0.5] * length, logprobs=[-6.0] * length
    )


@pytest.mark.parametrize("setup", list(SETUPS))
def test_no_step_holds_logits_for_every_token(llama_config, setup) -> None:
    """200 tokens: the plain path held 200 x 500 logits (and their gradients); the chunked one
    holds at most one chunk's rows at once, in the forward, the backward and the sampler."""
    config = llama_config(lora=SETUPS[setup], max_length=256)
    session = TrainingSession(config, device="cpu", logits_chunk_bytes=CHUNK_BYTES)
    example = long_example(200)
    for call in (
        lambda: session.forward_backward([example], loss_fn="ppo"),
        lambda: session.forward([example]),
        lambda: session.prompt_logprobs(list(example.tokens)),
    ):
        with LargestVocabularyRows(VOCAB) as seen:
            call()
        # The head's transposed weight (hidden x vocab) is the widest left.
        assert seen.rows <= max(CHUNK, session.model.config.hidden_size) < 100, seen.rows


LONG_TEXT = "The movie was good, and the food was great. " * 40  # about 480 tokens


@pytest.mark.parametrize("setup", list(SETUPS))
def test_no_text_step_holds_logits_for_every_token(llama_config, setup) -> None:
    """A causal-lm text of 256 tokens, whole and as prompt + completion: the model's own loss
    held 256 x 500 logits; the chunked one at most one chunk's rows, in the forward and the
    backward alike."""
    config = llama_config(lora=SETUPS[setup], max_length=256, truncation=True)
    session = TrainingSession(config, device="cpu", logits_chunk_bytes=CHUNK_BYTES)
    whole, completed = InputExample(LONG_TEXT), InputExample(LONG_TEXT[:200], completion=LONG_TEXT)
    for call in (
        lambda: session.forward_backward([whole]),
        lambda: session.forward_backward([completed, whole]),
        lambda: session.forward([whole]),
    ):
        with LargestVocabularyRows(VOCAB) as seen:
            call()
        assert seen.rows <= max(CHUNK, session.model.config.hidden_size) < 100, seen.rows
    assert session.last_token_count == 2 * 256


def test_the_chunk_size_comes_from_the_vocabulary_and_the_budget_alone() -> None:
    assert positions_per_chunk(151936, 32 * 2**20) == 55
    assert positions_per_chunk(VOCAB, CHUNK_BYTES) == CHUNK
    assert positions_per_chunk(10**9, 1) == 1


def plain_target_logprobs(model: torch.nn.Module, rows: list[TokenExample]) -> torch.Tensor:
    """The whole logits of each example alone, log_softmax, gathered: the unchunked values."""
    values = []
    for example in rows:
        logits = model(input_ids=torch.tensor([example.tokens])).logits[0].float()
        picked = torch.log_softmax(logits, -1)[range(len(example)), list(example.target_tokens)]
        values.append(picked)
    return torch.cat(values)


def chunked_of(
    model: torch.nn.Module, rows: list[TokenExample], budget_bytes: int = CHUNK_BYTES
) -> torch.Tensor:
    """``chunked_target_logprobs`` of ``rows``, right-padded into one batch."""
    width = max(len(e) for e in rows)
    ids, targets, mask = (torch.zeros(len(rows), width, dtype=torch.long) for _ in range(3))
    for row, example in enumerate(rows):
        ids[row, : len(example)] = torch.tensor(example.tokens)
        targets[row, : len(example)] = torch.tensor(example.target_tokens)
        mask[row, : len(example)] = 1
    lengths = [len(e) for e in rows]
    return chunked_target_logprobs(model, ids, mask, targets, lengths, budget_bytes=budget_bytes)


@pytest.mark.parametrize("arch", ["llama3", "gemma2", "gpt2"])
def test_chunked_logprobs_and_gradients_equal_the_whole_logits_to_float_tolerance(
    tmp_path: Path, arch: str
) -> None:
    """Gemma 2's soft cap set tight (0.5) so a chunk that skipped it would be far off."""
    model = AutoModelForCausalLM.from_pretrained(make_tiny_architecture(tmp_path, arch))
    if arch == "gemma2":
        model.config.final_logit_softcapping = 0.5
    vocab = model.get_output_embeddings().out_features
    rng = random.Random(1)
    rows = []
    for length in (11, 4, 8):
        tokens = [rng.randrange(vocab) for _ in range(length + 1)]
        rows.append(TokenExample(tokens[:-1], tokens[1:]))
    weights = torch.linspace(-1.0, 2.0, sum(len(e) for e in rows))
    gradients = []
    for compute in (plain_target_logprobs, chunked_of):
        model.zero_grad(set_to_none=True)
        logp = compute(model, rows)
        (weights * logp).sum().backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters()})
        gradients[-1]["logp"] = logp.detach()
    plain, chunked = gradients
    for name, value in plain.items():
        assert torch.allclose(chunked[name], value, rtol=RTOL, atol=ATOL), name


@pytest.mark.parametrize("arch", ["llama3", "gemma2"])
def test_the_chunked_text_loss_and_gradients_equal_transformers_to_float_tolerance(
    tmp_path: Path, arch: str
) -> None:
    """A padded batch of whole texts and prompt + completion rows, in chunks of 3 positions:
    transformers' ``ForCausalLMLoss`` (the shift, ``-100`` ignored, the mean over the counted
    labels) to the tolerance above, loss and every gradient. Gemma 2's soft cap set tight."""
    directory = make_tiny_architecture(tmp_path, arch)
    model = AutoModelForCausalLM.from_pretrained(directory)
    if arch == "gemma2":
        model.config.final_logit_softcapping = 0.5
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = TrainingConfig(model=str(directory), task="causal-lm", max_length=64)
    encoder = BatchEncoder(tokenizer, config, torch.device("cpu"))
    encoder.logits_chunk_bytes = CHUNK * model.get_output_embeddings().out_features * 4
    batch = encoder.encode(tiny_text_examples(6, seed=3))
    labels = batch.inputs["labels"]
    assert (labels == -100).any(dim=1).all(), "every row has padding or a prompt to ignore"
    results = []
    for compute in (lambda: model(**batch.inputs).loss, lambda: causal_lm_loss(model, batch)):
        model.zero_grad(set_to_none=True)
        loss = compute()
        loss.backward()
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
        results[-1]["loss"] = loss.detach()
    plain, chunked = results
    for name, value in plain.items():
        assert torch.allclose(chunked[name], value, rtol=RTOL, atol=ATOL), name


def head_calls_and_bits(
    model: torch.nn.Module, rows: list[TokenExample], budget_bytes: int
) -> tuple[int, dict[str, torch.Tensor]]:
    """How many times the head ran in one forward and backward of ``rows`` (a call with no
    positions included: the model's own), and the logprobs and every gradient it gave."""
    calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    model.zero_grad(set_to_none=True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same dropout masks for every budget
            logp = chunked_of(model, rows, budget_bytes)
            (torch.linspace(-1.0, 2.0, len(logp)) * logp).sum().backward()
    finally:
        hook.remove()
    bits = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    bits["logp"] = logp.detach()
    return len(calls), bits


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_request_that_fits_one_chunk_is_not_recomputed_and_gives_the_chunked_bits(
    llama_config, setup
) -> None:
    """Rows of 11, 4 and 8 positions: with a budget of 11 positions each row is one chunk,
    recomputed in the backward; with a budget of 23 the whole request is one chunk, kept. The
    head runs on the same rows either way, so every logprob and gradient is the same bits (LoRA
    on the head with dropout: the same masks too)."""
    session = TrainingSession(llama_config(lora=SETUPS[setup]), device="cpu")
    model = session.model
    model.train()
    rows = [long_example(length, seed=length) for length in (11, 4, 8)]
    chunked_calls, chunked = head_calls_and_bits(model, rows, 11 * VOCAB * 4)
    one_chunk_calls, one_chunk = head_calls_and_bits(model, rows, 23 * VOCAB * 4)
    assert chunked_calls == 1 + 2 * len(rows)  # the model's own call, each row, each again
    assert one_chunk_calls == 1 + len(rows)
    assert chunked.keys() == one_chunk.keys()
    assert all(torch.equal(one_chunk[name], value) for name, value in chunked.items())


@pytest.fixture(params=list(SETUPS))
def chunked_session(request, llama_config):
    def make(**overrides: Any) -> TrainingSession:
        config = llama_config(lora=SETUPS[request.param], lr_scheduler="constant", **overrides)
        return TrainingSession(config, device="cpu", max_steps=4, logits_chunk_bytes=CHUNK_BYTES)

    return make


def test_a_sample_reports_the_trainers_chunked_logprobs_bit_for_bit(chunked_session) -> None:
    session = chunked_session()
    prompt = session.tokenize(["the movie was"])[0]
    for sample in session.sample(prompt, max_tokens=9, num_samples=2, seed=5, temperature=1.2):
        full = [*prompt, *sample.tokens]
        alone = session.forward([TokenExample(full[:-1], full[1:])]).logprobs[0]
        assert tuple(alone[len(prompt) - 1 :]) == sample.logprobs
        scored = session.prompt_logprobs(full)
        assert scored[1:] == alone


def steps(session: TrainingSession) -> list[Any]:
    """Token microbatches under two losses and text ones, accumulation and two updates: what
    each gave."""
    return [call(session) for call in steps_as_calls()]


def test_chunked_training_repeats_bit_for_bit_and_with_gradient_checkpointing(
    chunked_session,
) -> None:
    first, second = chunked_session(), chunked_session()
    checkpointed = chunked_session(gradient_checkpointing=True)
    seen = steps(first)
    assert steps(second) == seen
    assert steps(checkpointed) == seen
    assert fresh_digest(first) == fresh_digest(second) == fresh_digest(checkpointed)


def test_a_chunked_run_resumes_from_every_cut_to_the_uninterrupted_bits(
    chunked_session, tmp_path: Path
) -> None:
    uninterrupted = chunked_session()
    expected = steps(uninterrupted)
    for cut in range(1, len(expected)):
        session = chunked_session()
        operations = steps_as_calls()
        for call in operations[:cut]:
            call(session)
        session.save_state(tmp_path / f"cut{cut}")
        resumed = chunked_session()
        resumed.load_state(tmp_path / f"cut{cut}")
        assert [call(resumed) for call in operations[cut:]] == expected[cut:], cut
        assert fresh_digest(resumed) == fresh_digest(uninterrupted), cut


def steps_as_calls() -> list[Any]:
    return [
        lambda s: s.forward_backward(tiny_token_examples(3, seed=1), loss_fn="ppo"),
        lambda s: s.forward_backward(tiny_text_examples(3, seed=1)),
        lambda s: s.optim_step(),
        lambda s: s.forward_backward(tiny_token_examples(3, seed=3), loss_fn="cispo"),
        lambda s: s.forward_backward(tiny_text_examples(3, seed=2)),
        lambda s: s.optim_step(),
    ]


# -- two ranks ---------------------------------------------------------------------------------


def two_ranks_chunked(spec: dict[str, Any], group: Any) -> dict[str, Any]:
    """On each rank: the token and text operations on a chunked session, plain and with gradient
    checkpointing, and a sample with its logprobs and the forward of it."""
    report = {}
    for name, checkpointing in (("plain", False), ("checkpointed", True)):
        session = sharded_chunked_session(spec, checkpointing, group)
        report[name] = {
            "seen": workers_operations(session),
            "digest": session.state_digest(),
        }
    session = sharded_chunked_session(spec, False, group)
    sample = session.sample([5, 9, 14], max_tokens=6, seed=2)[0]
    full = [5, 9, 14, *sample.tokens]
    report["sample"] = list(sample.logprobs)
    report["forward"] = session.forward([TokenExample(full[:-1], full[1:])]).logprobs[0][2:]
    return report


def sharded_chunked_session(spec: dict[str, Any], checkpointing: bool, group: Any):
    config = dataclasses.replace(
        workers.make_config(spec["model"], spec["lora"]), gradient_checkpointing=checkpointing
    )
    return TrainingSession(
        config, max_steps=workers.MAX_STEPS, process_group=group, logits_chunk_bytes=CHUNK_BYTES
    )


def workers_operations(session: TrainingSession) -> list[Any]:
    seen = []
    for loss_fn in ("cross_entropy", "ppo", "gspo"):
        out = session.forward_backward(workers.token_examples(), loss_fn=loss_fn)
        seen.append([out.loss, out.logprobs])
    seen.append(session.forward_backward(workers.TEXTS[:3]))
    seen.append(session.optim_step().grad_norm)
    seen.append(session.forward(workers.TEXTS[3:]).loss)
    seen.append(session.forward(workers.token_examples()).logprobs)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_two_ranks_chunk_like_one_process(tmp_path: Path, tiny_llama: Path, lora: bool) -> None:
    """The sharded session runs the same chunked path: its results are one process's to the
    sharded tests' tolerance (the same sums added across ranks), gradient checkpointing gives
    its bits, and its samples report its own forward's logprobs bit for bit."""
    from test_sharded_session import _close

    model = tiny_llama
    spec = {"model": str(model), "lora": lora, "out": str(tmp_path)}
    reports = workers.launch(2, "test_chunked_logprobs:two_ranks_chunked", spec)
    report = reports[0]
    assert reports[1] == report
    assert report["checkpointed"] == report["plain"]
    assert report["sample"] == report["forward"]
    config = workers.make_config(str(model), lora)
    one = TrainingSession(
        config, max_steps=workers.MAX_STEPS, device="cpu", logits_chunk_bytes=CHUNK_BYTES
    )
    _close(workers_operations(one), report["plain"]["seen"])
