"""The training engine: one model, one optimizer, one schedule, driven one operation at a time.

Lifecycle: set up (load the model, wrap it in LoRA, build the optimizer) → operate (forward,
forward_backward, optim_step) → save / export → close. Every path that trains (in-process, gRPC,
controller, Lightning) drives this one class, so they all produce the same bits.

The class holds the session's state and runs its operations; the work lives by job beside it:
what it returns in ``session_results``, the per-batch loss in ``loss_hook``, the sampler in
``sampling`` and sampling the weights a caller selects (other weights swapped in for one call) in
``session_sampling``; its digest, checkpoints and weights in and out in ``session_persistence``,
the checkpoint format in ``session_checkpoint`` and ``session_restore``. The results and
``LossHook`` import from here too.

Every operation runs inside the session's ``OperationGuard`` (``operation_guard``): its lock, its
own RNG installed around the operation, and its health (a failure midway marks it broken until a
``load_state``). That is why every change of the model's weights, even one undone within the same
call (sampling an old export), happens in the engine under that guard, never in the service or a
front that drives it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainwire.client.config import InputExample, TrainingConfig, is_int
from trainwire.client.outcomes import Sample
from trainwire.client.tokens import TokenExample
from trainwire.server.engine import session_persistence as persistence
from trainwire.server.engine import session_sampling
from trainwire.server.engine.batching import BatchEncoder, check_max_length
from trainwire.server.engine.chunked_logprobs import LOGITS_CHUNK_BYTES
from trainwire.server.engine.device import resolve_device, resolve_dtype
from trainwire.server.engine.lockstep import Announcer, collective
from trainwire.server.engine.loss_hook import LossHook, LossHookFactory
from trainwire.server.engine.microbatches import DEFAULT_LOSS, Microbatch
from trainwire.server.engine.model_loading import (
    load_session_model,
    load_tokenizer,
    model_positions,
    resolve_model_dir,
)
from trainwire.server.engine.operation_guard import refuse_out_of_memory
from trainwire.server.engine.optimization import (
    UpdateSettings,
    apply_update,
    build_optimizer,
    learning_rate_at,
)
from trainwire.server.engine.rng import RngState
from trainwire.server.engine.sample_weights import SampleWeights
from trainwire.server.engine.sampling import SamplingParams
from trainwire.server.engine.session_checkpoint import CheckpointContents
from trainwire.server.engine.session_results import ForwardResult, StepResult, TokenOutput
from trainwire.server.engine.session_setup import (
    check_session_arguments,
    seeded_guard,
    shard_for_group,
)
from trainwire.server.engine.sharding import ShardedMicrobatch, encode_for_group, total_norm
from trainwire.server.engine.weights import base_model_fingerprint
from trainwire.server.errors import FailedPrecondition, InvalidArgument


class TrainingSession:
    """One Hugging Face model trained in full or through one LoRA adapter.

    Operations are serialized by a lock, and each installs the session's own RNG state around
    itself, so sessions in one process never change each other's bits.

    With ``process_group``, every rank of the group builds this session and calls each operation
    with the same arguments: the model is sharded with FSDP2 and each rank trains on its slice
    of every batch (``sharding``). None is the single-process session, unchanged.

    ``logits_chunk_bytes`` bounds what one chunk of logits takes when token logprobs or a
    causal-lm text loss are computed (``chunked_logprobs``): training and sampling chunk alike,
    so samples report the trainer's logprobs. It decides the chunks, and so the bits: a run
    keeps one value (a resume under another continues to float tolerance, not bit for bit).
    """

    def __init__(
        self,
        config: TrainingConfig,
        *,
        device: str | torch.device | None = None,
        max_steps: int | None = None,
        model_root: str | Path | None = None,
        loss_hook: LossHookFactory = LossHook,
        process_group: dist.ProcessGroup | None = None,
        logits_chunk_bytes: int = LOGITS_CHUNK_BYTES,
    ) -> None:
        # Validate everything first: a refused session allocates nothing.
        self.shards = check_session_arguments(config, max_steps, process_group)
        if not is_int(logits_chunk_bytes) or logits_chunk_bytes < 1:
            raise InvalidArgument(
                f"logits_chunk_bytes must be a positive int, got {logits_chunk_bytes!r}"
            )
        self.config = config
        self.max_steps = max_steps
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(config, self.device)
        self.model_root = None if model_root is None else Path(model_root)
        self.model_dir = resolve_model_dir(config, self.model_root)
        check_max_length(config, model_positions(self.model_dir))  # before any weights load

        self._guard = seeded_guard(config.seed, self.device)
        with self._guard.session_rng():  # LoRA initialization draws from it
            self.tokenizer = load_tokenizer(self.model_dir)
            self.model = load_session_model(
                config, self.model_dir, self.dtype, self.tokenizer, self.device
            )
        self.base_fingerprint = base_model_fingerprint(self.model, self.config)  # unsharded
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.encoder = BatchEncoder(self.tokenizer, config, self.device, model_positions=positions)
        # Sharded before the optimizer is built: it steps the shards.
        self.sampler = shard_for_group(self.model, self.tokenizer, self.shards, self.device)
        self.encoder.logits_chunk_bytes = self.sampler.logits_chunk_bytes = logits_chunk_bytes
        self.optimizer = build_optimizer(self.model, config)
        # Which parameters train never changes after set up; walking a LoRA model's modules
        # for them costs milliseconds a step.
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        self._training_mode: bool | None = None  # the mode this session last set; see below
        self.loss_hook = loss_hook(config)
        self.step = 0
        self.accumulated = 0  # microbatches whose gradients are pending
        self.last_token_count = 0  # tokens in the last forward_backward batch (throughput)
        self._digests = persistence.StateDigests(self._guard)
        self.announcer: Announcer | None = None  # rank 0 of a served group (``lockstep``)

    # -- helpers -------------------------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.Tensor]:
        return list(self._trainable)

    def _set_training(self, training: bool) -> None:
        # Module.train() walks every module (milliseconds a step for a LoRA model), so only on a
        # change. The top module's flag alone is no witness: PEFT's wrapper starts in training
        # mode around a base model in eval mode. So the session remembers what it set.
        if self._training_mode != training or self.model.training != training:
            self.model.train(training)
            self._training_mode = training

    @property
    def broken(self) -> str | None:
        """Why the session refuses operations (a failure midway), or None when it is usable."""
        return self._guard.broken

    @property
    def is_fresh(self) -> bool:
        """Nothing applied since it was built or last restored (load_state may replace it)."""
        return self._guard.fresh

    # -- operations ----------------------------------------------------------------------------

    @collective
    def forward(
        self,
        examples: Sequence[InputExample | TokenExample],
        *,
        loss_fn: str = DEFAULT_LOSS,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> ForwardResult | TokenOutput:
        """The batch's loss without gradients and without any state change.

        Text examples give a ``ForwardResult`` (predictions for classification); token examples
        give a ``TokenOutput`` with every target's logprob under ``loss_fn``.
        """
        with self._guard.operation(changes_state=False):
            microbatch = self._encode(examples, loss_fn, loss_fn_config)
            self._set_training(False)
            with torch.no_grad(), refuse_out_of_memory("forward"):
                loss = microbatch.loss(self.model, self.loss_hook, training=False)
            return microbatch.forward_result(loss)

    @collective
    def forward_backward(
        self,
        examples: Sequence[InputExample | TokenExample],
        *,
        loss_fn: str = DEFAULT_LOSS,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> float | TokenOutput:
        """Run one microbatch forward and backward; its gradients accumulate until optim_step.

        Text examples return the native scalar batch loss; token examples a ``TokenOutput``
        (the loss summed over every token, the logprobs before the update, the metrics). The
        pending gradients are renormalized by the number of microbatches really accumulated
        when the update is applied, whichever kinds they were.
        """
        with self._guard.operation():
            microbatch = self._encode(examples, loss_fn, loss_fn_config)
            self._set_training(True)
            # Out of memory here, nothing was applied yet: the state (RNG included) is unchanged.
            with refuse_out_of_memory("forward_backward"):
                loss = microbatch.loss(self.model, self.loss_hook, training=True)
            with self._guard.breaks_on_failure("forward_backward"):
                loss.backward()
            self.accumulated += 1
            self.last_token_count = microbatch.token_count
            self._guard.changed()
            return microbatch.backward_result(loss)

    def _encode(
        self, examples: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None
    ) -> Microbatch | ShardedMicrobatch:
        vocab_size = self.sampler.vocab_size
        return encode_for_group(
            examples, loss_fn, loss_fn_config, self.encoder, vocab_size, self.shards
        )

    @collective
    def optim_step(
        self,
        *,
        learning_rate: float | None = None,
        beta1: float | None = None,
        beta2: float | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        max_grad_norm: float | None = None,
        sum_microbatches: bool = False,
    ) -> StepResult:
        """Apply one update: renormalize, clip, step AdamW, zero grads.

        The rate is the schedule's, or ``learning_rate`` for this update when given (online
        loops pick their own); the schedule's position advances either way. Each other value
        given replaces the run's for this update only (``UpdateSettings``: ``max_grad_norm=0``
        is no clipping), so a loop that tunes Adam per step trains as it asked, and an update
        with none given is bit for bit the run's own. The microbatches' gradients are averaged,
        or added with ``sum_microbatches`` (Tinker's semantics).
        """
        settings = UpdateSettings(learning_rate, beta1, beta2, eps, weight_decay, max_grad_norm)
        settings.check()  # before the guard: a refused update changes nothing
        with self._guard.operation():
            if self.accumulated == 0:
                raise FailedPrecondition(
                    "optim_step: no microbatch accumulated since the last update; "
                    "run forward_backward first"
                )
            try:
                rate = learning_rate_at(self.step, self.config, self.max_steps)
            except ValueError as error:
                raise InvalidArgument(str(error)) from None
            rate = rate if learning_rate is None else float(learning_rate)
            with self._guard.breaks_on_failure("optim_step"):
                grad_norm = apply_update(
                    self.optimizer,
                    self._trainable,
                    accumulated=1 if sum_microbatches else self.accumulated,
                    max_grad_norm=self.config.max_grad_norm,
                    rate=rate,
                    settings=settings,
                    total_norm=None if self.shards is None else total_norm,
                )
            self.step += 1
            self.accumulated = 0
            self._guard.changed()
            return StepResult(self.step, rate, grad_norm)

    @collective
    def sample(
        self,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: int,
        num_samples: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_tokens: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        seed: int = 0,
        weights: SampleWeights | str | os.PathLike[str] | None = None,
    ) -> list[Sample]:
        """Continuations of ``prompt_tokens`` from the live weights (LoRA included), or from the
        weights ``weights`` selects (``SampleWeights``): a path is an export of this run, say a
        snapshot the trainer has moved past, and ``BASE_MODEL`` the model before any training.

        ``temperature=0`` is greedy. A sample ends after a stop token or EOS (kept, ``"stop"``),
        once its decoded text contains one of ``stop_strings`` (its tokens up to and including
        the one completing it, ``"stop"``), or after ``max_tokens`` (``"length"``). Its logprobs
        are the model's own at temperature 1, bit for bit what ``forward`` gives for prompt plus
        sample as one TokenExample (under those weights). Nothing changes: the digest and the
        training RNG are untouched, and other weights are checked before any live tensor changes
        and put back bit for bit afterwards; the same weights and arguments give the same
        samples. A missing export is ``FailedPrecondition``.
        """
        if isinstance(stop_strings, str):  # tuple() would split it into characters
            raise InvalidArgument("sample: stop_strings is a list of strings; wrap the one given")
        params = SamplingParams(
            max_tokens,
            num_samples,
            temperature,
            top_p,
            top_k,
            tuple(stop_tokens),
            seed,
            stop_strings=tuple(stop_strings),
        )
        selected = SampleWeights.of(weights)
        return session_sampling.sample(self, list(prompt_tokens), params, selected)

    @collective
    def prompt_logprobs(
        self,
        prompt_tokens: Sequence[int],
        *,
        weights: SampleWeights | str | os.PathLike[str] | None = None,
    ) -> list[float]:
        """Each prompt token's logprob given the tokens before it, under the weights ``weights``
        selects (as ``sample``'s): NaN for the first token (nothing precedes it), then bit for
        bit what ``forward`` gives for ``TokenExample(prompt[:-1], prompt[1:])`` under those
        weights. Changes nothing, as ``sample``."""
        selected = SampleWeights.of(weights)
        return session_sampling.prompt_logprobs(self, list(prompt_tokens), selected)

    def tokenize(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, with this session's tokenizer."""
        return self.encoder.token_ids(list(texts), special=add_special_tokens) if texts else []

    def detokenize(self, token_lists: Sequence[Sequence[int]]) -> list[str]:
        """Each id list back into text; ids outside the vocabulary are INVALID_ARGUMENT."""
        vocab = self.sampler.vocab_size
        for index, ids in enumerate(token_lists):
            if any(not is_int(i) or not 0 <= i < vocab for i in ids):
                raise InvalidArgument(f"token list {index} holds ids outside [0, {vocab})")
        return self.tokenizer.batch_decode([list(ids) for ids in token_lists])

    # -- state -----------------------------------------------------------------------------

    def pending_gradients(self) -> dict[str, torch.Tensor]:
        return {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}

    @property
    def rng_state(self) -> RngState:
        """The session's own RNG snapshot (installed around each operation)."""
        return self._guard.rng

    @collective
    def state_digest(self) -> str:
        """sha256 over the whole continuation state: parameters, optimizer moments, schedule
        position, pending gradients, accumulation counter, RNG and loss-hook state.

        Equal digests mean equal continuations. Cached per state version: hashing reads every
        tensor, and ``Info`` reports it after every operation.
        """
        with self._guard.lock:
            return self._digests.held(self._contents)

    def known_state_digest(self) -> str:
        """The digest if it is cached for the current state, else "" (no lock, no hashing)."""
        return self._digests.known()

    @collective
    def drop_digest_cache(self) -> None:
        """Forget the cached digest, as an operation does (benchmarks time its computation)."""
        with self._guard.lock:
            self._digests.drop()

    def checkpoint_contents(self) -> CheckpointContents:
        """Everything ``save_state`` writes, as live tensors (call it between operations)."""
        with self._guard.lock:
            return self._contents()

    def _contents(self) -> CheckpointContents:
        return persistence.checkpoint_contents(self)

    @collective
    def save_state(self, path: str | Path, *, extra: dict[str, Any] | None = None) -> None:
        """Write the complete continuation state to a checkpoint directory, atomically.

        ``extra`` (JSON) rides along; managed runs keep their cursor and history there. A broken
        session refuses: its tensors may be half changed.
        """
        persistence.save_state(self, Path(path), extra or {})

    @collective
    def load_state(self, path: str | Path) -> dict[str, Any]:
        """Restore everything into this fresh (or just restored) session; returns ``extra``.

        A broken session may be restored too (that is the way back). The checkpoint is read and
        checked completely first, so a refused one changes nothing.
        """
        return persistence.load_state(self, Path(path))

    @collective
    def load_weights(self, path: str | Path) -> None:
        """Copy weights only, from a session checkpoint, a native model or a PEFT adapter.

        The optimizer, schedule and RNG stay this run's. A full model seeds a LoRA session's base
        weights (the adapters stay fresh). The source is checked completely before any live
        tensor changes; a failure midway marks the session broken.
        """
        persistence.load_weights(self, Path(path))

    @collective
    def export_weights(self, path: str | Path) -> None:
        """Write a directory ``transformers`` (full) or ``peft`` (adapter) loads, atomically."""
        persistence.export_weights(self, Path(path))

    @collective
    def export_checkpoint_weights(self, checkpoint: str | Path, path: str | Path) -> None:
        """Export the weights of a checkpoint from a detached CPU copy; live state untouched."""
        persistence.export_checkpoint_weights(self, Path(checkpoint), Path(path))
