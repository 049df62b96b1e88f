"""The training engine: one model, one optimizer, one schedule, driven one operation at a time.

Lifecycle: set up (load the model, wrap it in LoRA, build the optimizer) → operate (forward,
forward_backward, optim_step, sample) → save / export → close. Every path that trains
(in-process, gRPC, controller, Lightning) drives this one class, so they all produce the same
bits.

The class holds the session's state and every method that reads or changes it: its operations,
sampling (from the live weights or from weights swapped in for one call), its digest, and its
state and weights in and out. The work that needs no session lives by job beside it: what it
checks before it allocates (``setup``), what it returns (``results``), the checkpoint format
(``checkpoint``, read back by ``restore``), the per-batch loss (``loss.loss_hook``), the sampler
(``sampling.sampler``) and swapping weights in for a read (``sampling.weight_swap``), the weights
sources and exports (``weights.transfer``). A sharded session (one with a process group) keeps
its state in ``sharded.checkpoint``'s format and its weights go in and out through
``sharded.weights``.

Every operation runs inside the session's ``OperationGuard`` (``operation_guard``): its lock, its
own RNG installed around the operation, and its health (a failure midway marks it broken until a
``load_state``). That is why every change of the model's weights, even one undone within the same
call (sampling an old export), happens in the engine under that guard, never in the service or a
front that drives it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainwire.contract.config import InputExample, TrainingConfig, is_int
from trainwire.contract.outcomes import PromptLogprobs, Sample
from trainwire.contract.tokens import TokenExample
from trainwire.server.engine.device import resolve_device, resolve_dtype
from trainwire.server.engine.loss.batching import BatchEncoder, check_max_length
from trainwire.server.engine.loss.chunked_logprobs import LOGITS_CHUNK_BYTES
from trainwire.server.engine.loss.loss_hook import LossHook, LossHookFactory
from trainwire.server.engine.loss.microbatches import DEFAULT_LOSS, Microbatch
from trainwire.server.engine.optimization import (
    UpdateSettings,
    apply_update,
    build_optimizer,
    learning_rate_at,
)
from trainwire.server.engine.sampling.params import PromptScoring, SamplingParams
from trainwire.server.engine.sampling.sample_weights import SampleWeights
from trainwire.server.engine.sampling.sampler import BatchedSample
from trainwire.server.engine.sampling.weight_swap import weights_for_reading
from trainwire.server.engine.session.checkpoint import (
    CheckpointContents,
    optimizer_state_tensors,
    write_checkpoint,
)
from trainwire.server.engine.session.digest import StateDigests
from trainwire.server.engine.session.operation_guard import refuse_out_of_memory
from trainwire.server.engine.session.restore import read_checkpoint
from trainwire.server.engine.session.results import ForwardResult, StepResult, TokenOutput
from trainwire.server.engine.session.rng import RngState, preserved_global_rng
from trainwire.server.engine.session.setup import (
    check_session_arguments,
    check_shared_base,
    seeded_guard,
    shard_for_group,
)
from trainwire.server.engine.sharded import checkpoint as sharded_checkpoint
from trainwire.server.engine.sharded import weights as sharded_weights
from trainwire.server.engine.sharded.lockstep import Announcer, collective
from trainwire.server.engine.sharded.sharding import (
    ShardedMicrobatch,
    ShardGroup,
    encode_for_group,
    reshard,
    resharded_after,
    total_norm,
)
from trainwire.server.engine.weights import transfer as weights
from trainwire.server.engine.weights.model_loading import (
    load_session_model,
    load_tokenizer,
    model_positions,
    resolve_model_dir,
)
from trainwire.server.engine.weights.shared_base import SharedBase
from trainwire.server.errors import FailedPrecondition, InvalidArgument


class TrainingSession:
    """One Hugging Face model trained in full or through one LoRA adapter.

    Operations are serialized by a lock, and each installs the session's own RNG state around
    itself, so sessions in one process never change each other's bits.

    With ``process_group``, every rank of the group builds this session and calls each operation
    with the same arguments: the model is sharded with FSDP2 and each rank trains on its slice
    of every batch (``sharded.sharding``). None is the single-process session.

    ``logits_chunk_bytes`` bounds what one chunk of logits takes when token logprobs or a
    causal-lm text loss are computed (``chunked_logprobs``): training and sampling chunk alike,
    so samples report the trainer's logprobs. It decides the chunks, and so the bits: a run
    keeps one value (a resume under another continues to float tolerance, not bit for bit).

    With ``base``, a LoRA session trains its own adapter on the base model's weights that
    ``base`` holds in memory once for every session on it (``weights.shared_base``), and gives
    the same bits as alone: losses, samples, digest (which hashes the base too), checkpoints,
    exports. Nothing it does writes the shared weights: a load or restore that would put other
    base weights in is refused (FailedPrecondition), and one that carries the base's own bits
    loads only the session's tensors. Dropping the session frees its adapter and optimizer,
    never the base.
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
        base: SharedBase | None = None,
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
        check_shared_base(base, config, self.model_dir, self.device, self.shards)
        check_max_length(config, model_positions(self.model_dir))  # before any weights load

        self.shared_base = base
        self._guard = seeded_guard(config.seed, self.device)
        with self._guard.session_rng():  # LoRA initialization draws from it
            self.tokenizer = load_tokenizer(self.model_dir)
            self.model = load_session_model(
                config,
                self.model_dir,
                self.dtype,
                self.tokenizer,
                self.device,
                loaded=None if base is None else base.instance(),
            )
        self.base_fingerprint = self._hash_base()  # unsharded
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
        # How many times the live weights changed in this process (an update, a load): weights
        # saved at one version are the live ones while it holds, so a sample of them reads the
        # live ones instead of swapping the saved ones in.
        self.weights_version = 0
        self._digests = StateDigests(self._guard)
        self.announcer: Announcer | None = None  # rank 0 of a served group (``lockstep``)

    # -- helpers -------------------------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.Tensor]:
        return list(self._trainable)

    def _hash_base(self) -> str | None:
        """The base model's fingerprint; on a shared base, which no session changes, hashed
        once for every session on it with these LoRA settings."""
        compute = functools.partial(weights.base_model_fingerprint, self.model, self.config)
        if self.shared_base is None:
            return compute()
        return self.shared_base.base_fingerprint(self.config, compute)

    def _own_load(self, load: weights.WeightsLoad, what: str) -> weights.WeightsLoad:
        """``load`` less what would write the shared base (refused unless it is the base's own
        bits); the whole load for a session on a base of its own."""
        if self.shared_base is None:
            return load
        return dataclasses.replace(load, pairs=self.shared_base.own_part(load.pairs, what))

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
            microbatch = self.encode(examples, loss_fn, loss_fn_config)
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
            microbatch = self.encode(examples, loss_fn, loss_fn_config)
            self._set_training(True)
            # Out of memory here, nothing was applied yet: the state (RNG included) is unchanged.
            with refuse_out_of_memory("forward_backward"):
                loss = microbatch.loss(self.model, self.loss_hook, training=True)
            with self._guard.breaks_on_failure("forward_backward"):
                loss.backward()
            self._accumulate(microbatch)
            return microbatch.backward_result(loss)

    def _accumulate(self, microbatch: Microbatch | ShardedMicrobatch) -> None:
        """Count a microbatch whose gradients a backward just added to the pending ones."""
        self.accumulated += 1
        self.last_token_count = microbatch.token_count
        self._guard.changed()

    @contextlib.contextmanager
    def shared_pass(self, microbatch: Microbatch, *, training: bool) -> Iterator[Microbatch]:
        """This session's part of one pass over its base that it shares with other sessions on
        it (``engine.together``): held under its lock, refused while broken, and the model in
        the mode ``forward_backward`` (``training``) or ``forward`` sets. ``microbatch`` is
        what ``encode`` gave for the request (the pass encodes each request once: grouping
        reads its width, the pass its tensors).

        The pass itself runs the model and the backward. When it ends without an error, the
        session ends as the same operation alone ends: its RNG advanced as an operation that
        drew nothing advances it (a shared pass draws nothing: ``together.compatible`` refuses
        dropout), and after a backward the microbatch counted as pending.
        """
        guard = self._guard
        with guard.lock:
            guard.refuse_if_broken("the session is unusable")
            self._set_training(training)
            yield microbatch
            if training:
                guard.drew_nothing()
                self._accumulate(microbatch)

    def breaks_on_failure(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A block whose failure leaves this session's tensors half changed (a shared
        backward): the session refuses operations until a ``load_state``."""
        return self._guard.breaks_on_failure(what)

    def encode(
        self, examples: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None
    ) -> Microbatch | ShardedMicrobatch:
        """The batch as this session trains on it (this rank's slice in a sharded group):
        InvalidArgument for a request it refuses, before anything changes. Reads only the
        session's encoder, so it may run outside the session's lock."""
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
            self.weights_version += 1
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
        topk_sample_logprobs: int = 0,
        weights: SampleWeights | str | os.PathLike[str] | None = None,
    ) -> list[Sample]:
        """Continuations of ``prompt_tokens`` from the live weights (LoRA included), or from the
        weights ``weights`` selects (``SampleWeights``): a path is an export of this run, say a
        snapshot the trainer has moved past, and ``BASE_MODEL`` the model before any training.

        ``temperature=0`` is greedy. A sample ends after a stop token or EOS (kept, ``"stop"``),
        once its decoded text contains one of ``stop_strings`` (its tokens up to and including
        the one completing it, ``"stop"``), or after ``max_tokens`` (``"length"``). Its logprobs
        are the model's own at temperature 1, bit for bit what ``forward`` gives for prompt plus
        sample as one TokenExample (under those weights); with ``topk_sample_logprobs`` k, each
        sampled position also reports its k most likely ids with their logprobs
        (``Sample.topk_logprobs``), each the value ``forward`` gives for that id as the target
        there. Nothing changes: the digest and the training RNG are untouched, and other weights
        are checked before any live tensor changes and put back bit for bit afterwards; the same
        weights and arguments give the same samples. A missing export is
        ``FailedPrecondition``.
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
            topk_sample_logprobs=topk_sample_logprobs,
        )
        selected = SampleWeights.of(weights)
        prompt = list(prompt_tokens)
        sampler = self.sampler
        # Checked before any weights are read (the sampler checks it again: a cheap repeat).
        check = functools.partial(params.check, prompt, sampler.vocab_size, sampler.limits)
        with self._reading(selected, check):
            if self.shards is None:
                return sampler.sample(self.model, prompt, params)
            # The tiles' shape decides the forwards: rank 0's mode (the host sets it there only).
            sampler.batches, sampler.tile_rows = self.shards.broadcast(
                (sampler.batches, sampler.tile_rows)
            )
            return self.shards.broadcast(sampler.sample(self.model, prompt, params))

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
        prompt = list(prompt_tokens)
        with self._reading(selected, lambda: self.sampler.check_prompt(prompt)):
            scored = self.sampler.prompt_logprobs(self.model, prompt)
            return scored if self.shards is None else self.shards.broadcast(scored)

    @collective
    def prompt_scores(
        self,
        prompt_tokens: Sequence[int],
        scoring: PromptScoring,
        *,
        weights: SampleWeights | str | os.PathLike[str] | None = None,
    ) -> PromptLogprobs:
        """What ``scoring`` asks about the prompt (its tokens' logprobs, the top k of each
        position, the logprobs of ids it names), under the weights ``weights`` selects: each
        value bit for bit what ``forward`` gives for that id as the target at that position of
        ``TokenExample(prompt[:-1], prompt[1:])``. Changes nothing, as ``sample``."""
        selected = SampleWeights.of(weights)
        prompt = list(prompt_tokens)
        sampler = self.sampler
        check = functools.partial(scoring.check, prompt, sampler.vocab_size, sampler.limits)
        with self._reading(selected, check):
            scored = sampler.prompt_scores(self.model, prompt, scoring)
            return scored if self.shards is None else self.shards.broadcast(scored)

    def sample_many(
        self,
        selected: SampleWeights,
        requests: Sequence[BatchedSample],
        join: Callable[[], list[BatchedSample]] = list,
    ) -> None:
        """``requests`` (and those ``join`` hands over between decode steps), all under
        ``selected``'s weights, decoded as one batch: each gets what ``sample`` gives it alone.

        Each request is checked on its own first, and refused on its own; a failure of the batch
        itself (its weights' source missing, out of memory) reaches every request not yet
        answered. A sharded session refuses: what joins a batch is rank 0's timing alone, which
        the other ranks cannot follow; it samples through ``sample`` (announced to every rank),
        one request at a time (``service.sample_batching``).
        """
        if self.shards is not None:
            raise FailedPrecondition(
                "sample_many: a sharded session samples one request at a time through "
                "TrainingSession.sample and prompt_logprobs, which every rank calls"
            )
        if self.config.task != "causal-lm":
            error = InvalidArgument(f"sampling needs a causal-lm session, not {self.config.task}")
            for request in requests:
                request.on_error(error)
            return
        sampler, model = self.sampler, self.model
        calls = sampler.calls(model, requests)
        if not calls:
            return
        with self.reading(selected):
            sampler.sample_many(model, calls, lambda: sampler.calls(model, join()))

    def reading(self, selected: SampleWeights) -> contextlib.AbstractContextManager[None]:
        """Held for a decode of ``selected``'s weights by the caller (``sample_many``'s, or one
        over several sessions: ``together.sampling``): the session's lock, eval mode, no
        gradients, the weights swapped in and the live bits back after (``_reading``)."""
        return self._reading(selected, lambda: None)

    @contextlib.contextmanager
    def _reading(self, selected: SampleWeights, check: Callable[[], None]) -> Iterator[None]:
        """A read-only operation with ``selected``'s weights in the model, in the order that
        makes a swap safe (``sampling.weight_swap``): the request checked, the source checked,
        the swap, the live bits back.

        A sharded session samples the same way on every rank, each rank calling with the same
        arguments (``lockstep`` announces the call): the decode runs on the FSDP model, each
        forward gathering the weights, with rank 0's draws (``batch_decode``) and rank 0's
        decoding mode, so every rank runs the same forwards. Every FSDP module is resharded
        before the swap and after the decode, so what is swapped, put back, stepped and hashed
        are the shards. The state version does not move: the bits afterwards are the bits
        before, so the cached state digest stays true.
        """
        with self._guard.operation(changes_state=False):
            if self.config.task != "causal-lm":
                raise InvalidArgument(f"sampling needs a causal-lm session, not {self.config.task}")
            check()
            if self.shards is not None:
                reshard(self.model)  # what a swap plans against and writes: the shards
            swap = weights_for_reading(
                self.model,
                selected,
                config=self.config,
                base_fingerprint=self.base_fingerprint,
                base_model_dir=self.model_dir,
                guard=self._guard,
                shards=self.shards,
                narrow=functools.partial(self._own_load, what=_sampled_weights(selected)),
            )
            self._set_training(False)
            resharded = resharded_after(self.model, self.shards)
            # Innermost, so an out-of-memory error is reported only after the live bits are
            # back; resharded inside the swap, so the live bits go back into the shards.
            with swap, resharded, torch.no_grad(), refuse_out_of_memory("sample"):
                yield

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

    def checkpoint_contents(self) -> CheckpointContents | sharded_checkpoint.ShardedContents:
        """Everything ``save_state`` writes, as live tensors (call it between operations)."""
        with self._guard.lock:
            return self._contents()

    def _contents(self) -> CheckpointContents | sharded_checkpoint.ShardedContents:
        """The live tensors, not copied: the caller holds the lock, so nothing changes them
        while they are read. A sharded session's are this rank's shards."""
        if self.shards is not None:
            return self._sharded_contents(self.shards)
        return self._state(optimizer_state_tensors(self.optimizer))

    def _sharded_contents(self, shards: ShardGroup) -> sharded_checkpoint.ShardedContents:
        # The optimizer's tensors first: reading them reshards the model, so the parameters
        # read after them are the shards.
        optimizer = sharded_checkpoint.optimizer_tensors(self.model, self.optimizer)
        return sharded_checkpoint.ShardedContents(shards, self._state(optimizer))

    def _state(self, optimizer: dict[str, torch.Tensor]) -> CheckpointContents:
        return CheckpointContents(
            config=self.config,
            device_type=self.device.type,
            step=self.step,
            accumulated=self.accumulated,
            max_steps=self.max_steps,
            base_model_fingerprint=self.base_fingerprint,
            loss_hook=type(self.loss_hook).__name__,
            rng=self.rng_state,
            parameters=dict(self.model.named_parameters()),
            optimizer=optimizer,
            gradients=self.pending_gradients(),
            loss_hook_state=self.loss_hook.session_state_dict(),
        )

    @collective
    def save_state(self, path: str | Path, *, extra: dict[str, Any] | None = None) -> None:
        """Write the complete continuation state to a checkpoint directory, atomically.

        ``extra`` (JSON) rides along; managed runs keep their cursor and history there. A broken
        session refuses: its tensors may be half changed.
        """
        path, extra = Path(path), extra or {}
        guard = self._guard
        with guard.lock:
            # A broken session's tensors may be half changed: a checkpoint of them would restore
            # a state no run ever had.
            guard.refuse_if_broken("cannot save an unusable session")
            if self.shards is not None:
                sharded = self._sharded_contents(self.shards)
                state_digest = self._digests.held(lambda: sharded)
                sharded_checkpoint.write_checkpoint(path, sharded, state_digest, extra)
                return
            contents = self._contents()
            # The digest is hashed from these very tensors on a helper thread while the files
            # are written; the lock, held until both are done, keeps them still meanwhile.
            write_checkpoint(path, contents, lambda: self._digests.held(lambda: contents), extra)

    @collective
    def load_state(self, path: str | Path) -> dict[str, Any]:
        """Restore everything into this fresh (or just restored) session; returns ``extra``.

        A broken session may be restored too (that is the way back). The checkpoint is read and
        checked completely first, so a refused one changes nothing.
        """
        path = Path(path)
        guard = self._guard
        with guard.lock:
            # A broken session may always be restored: that is how it becomes usable again.
            if not guard.fresh and guard.broken is None:
                raise FailedPrecondition(
                    f"load_state needs a fresh session; this one has applied {guard.version} "
                    f"operation(s) (step {self.step}). Open a new session to restore"
                )
            live = dict(self.model.named_parameters())
            if self.shards is None:
                extra = self._load_checkpoint(path, live)
            else:
                extra = self._load_sharded_checkpoint(path, live, self.shards)
            guard.restored()
            return extra

    def _load_checkpoint(self, path: Path, live: dict[str, torch.Tensor]) -> dict[str, Any]:
        restored = read_checkpoint(
            path,
            config=self.config,
            device_type=self.device.type,
            max_steps=self.max_steps,
            live=live,
            optimizer=self.optimizer,
        )
        applied = live
        if self.shared_base is not None:  # the shared weights stay; other base bits refused
            what = f"load_state: checkpoint {path.name}"
            pairs = [(live[name], restored.parameters[name]) for name in live]
            own = {id(tensor) for tensor, _ in self.shared_base.own_part(pairs, what)}
            applied = {name: tensor for name, tensor in live.items() if id(tensor) in own}
        # Everything is read and checked; now apply it (the hook first: it may still refuse,
        # and nothing has changed yet when it does).
        self.loss_hook.load_session_state_dict(restored.loss_hook_state)
        # Half restored: refuse everything until a load_state succeeds (a retry still works).
        with self._guard.breaks_on_failure("load_state"):
            restored.apply_tensors(applied, self.optimizer)
        for name, parameter in live.items():
            parameter.grad = restored.gradients.get(name)
        self._continue_from(
            restored.step, restored.accumulated, restored.base_model_fingerprint, restored.rng
        )
        return restored.extra

    def _load_sharded_checkpoint(
        self, path: Path, live: dict[str, torch.Tensor], shards: ShardGroup
    ) -> dict[str, Any]:
        restore = sharded_checkpoint.read_checkpoint(
            path,
            shards,
            config=self.config,
            device_type=self.device.type,
            max_steps=self.max_steps,
            live=live,
        )
        self.loss_hook.load_session_state_dict(restore.loss_hook_state())  # may refuse
        # dcp.load reads into the live parameters themselves: from here a failure, or files
        # that do not hash to what was written, leave the session broken until a load_state.
        with self._guard.breaks_on_failure("load_state"):
            restore.load_into(live, self.optimizer, self.loss_hook)
            self._continue_from(
                restore.step, restore.accumulated, restore.base_model_fingerprint, restore.rng
            )
            restore.check(self._sharded_contents(shards).tensors_digest())
        return restore.extra

    def _continue_from(
        self, step: int, accumulated: int, base_fingerprint: str | None, rng: RngState
    ) -> None:
        """A restored checkpoint's counters, base model and RNG, after its tensors are in."""
        self.step = step
        self.accumulated = accumulated
        self.base_fingerprint = base_fingerprint
        self._guard.rng = rng
        self.weights_version += 1

    @collective
    def load_weights(self, path: str | Path) -> None:
        """Copy weights only, from a session checkpoint, a native model or a PEFT adapter.

        The optimizer, schedule and RNG stay this run's. A full model seeds a LoRA session's base
        weights (the adapters stay fresh). The source is checked completely before any live
        tensor changes; a failure midway marks the session broken.
        """
        path = Path(path)
        guard = self._guard
        with guard.operation():
            if self.shards is None:
                # Read and check everything first; then apply, and a failure midway (out of
                # memory, say) marks the session unusable rather than leaving half the weights
                # copied.
                load = weights.plan_weights_load(
                    self.model, path, self.config, self.base_fingerprint
                )
                load = self._own_load(load, f"load_weights: {path.name}")
                with guard.breaks_on_failure("load_weights"):
                    load.apply(self.model)
                # A full model may have seeded a LoRA session's base: adapters and exports from
                # now on belong to these base weights.
                fingerprint = self._hash_base()
            else:
                fingerprint = self._load_sharded_weights(path, self.shards)
            self.base_fingerprint = fingerprint
            self.weights_version += 1
            guard.changed()

    def _load_sharded_weights(self, path: Path, shards: ShardGroup) -> str | None:
        """Every rank reads and checks the whole source; once all agree, each copies its
        shards. Returns the base model's fingerprint after the load."""
        reshard(self.model)  # the registered parameters, copied into, are the shards
        load, staged = sharded_weights.agreed_load(
            shards,
            self.model,
            lambda: sharded_weights.plan_load(self.model, path, self.config, self.base_fingerprint),
        )
        # Hashed from the whole source tensors before anything changes: a collective only for
        # the parameters the source leaves as they are, which every rank gathers alike.
        fingerprint = sharded_weights.base_fingerprint_after(
            self.model, load, self.config, self.base_fingerprint
        )
        with self._guard.breaks_on_failure("load_weights"):
            staged.apply(self.model)
        return fingerprint

    @collective
    def export_weights(self, path: str | Path) -> None:
        """Write a directory ``transformers`` (full) or ``peft`` (adapter) loads, atomically."""
        path = Path(path)
        guard = self._guard
        with guard.lock:
            guard.refuse_if_broken("cannot export an unusable session")
            # Where the weights come from, in the export's record: the state digest names the
            # exact state they were exported from (a checkpoint of it records the same digest).
            provenance = {
                "base_model_fingerprint": self.base_fingerprint,
                "step": self.step,
                "state_digest": self.state_digest(),
            }
            if self.shards is None:
                weights.write_export(path, self.model, self.tokenizer, self.config, provenance)
                return
            writer = sharded_weights.ExportWriter(self._cpu_copy, self.tokenizer, self.config)
            sharded_weights.export_weights(self.shards, self.model, path, provenance, writer)

    @collective
    def export_checkpoint_weights(self, checkpoint: str | Path, path: str | Path) -> None:
        """Export the weights of a checkpoint from a detached CPU copy; live state untouched."""
        checkpoint, path = Path(checkpoint), Path(path)
        with self._guard.lock:  # no operation changes the model while it is copied
            if self.shards is None:
                # The checkpoint's weights go into a detached copy, never into the live model:
                # the live state stays untouched even if the export fails midway. On a shared
                # base the copy keeps the shared weights (a second base might not fit), and only
                # its own tensors are copied in.
                base = self.shared_base
                if base is None:
                    detached = copy.deepcopy(self.model).to("cpu")
                    narrow = None
                else:
                    detached = base.copy_sharing(self.model)
                    narrow = functools.partial(
                        base.own_part, what=f"export: checkpoint {checkpoint.name}"
                    )
                weights.export_checkpoint(
                    checkpoint, path, detached, self.tokenizer, self.config, narrow
                )
                return
            writer = sharded_weights.ExportWriter(self._cpu_copy, self.tokenizer, self.config)
            sharded_weights.export_checkpoint_weights(self.shards, checkpoint, path, writer)

    def _cpu_copy(self) -> torch.nn.Module:
        """A fresh unsharded copy of the model on the CPU, for a sharded session's rank 0 to
        write exports from (the live one is sharded and may be on a GPU). A LoRA copy draws
        initial adapters from the global RNG; they are overwritten and the RNG put back, so
        nothing of the run's changes."""
        with preserved_global_rng():
            return load_session_model(
                self.config, self.model_dir, self.dtype, self.tokenizer, torch.device("cpu")
            )


def _sampled_weights(selected: SampleWeights) -> str:
    """What a sample reads, for a message: an export by its name, never the server's path."""
    if selected.export is None:
        return "sample: the base model"
    return f"sample: weights {selected.export.name!r}"
