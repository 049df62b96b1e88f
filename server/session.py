"""The training engine: one model, one optimizer, one schedule, driven one operation at a time.

Lifecycle: set up (load the model, wrap it in LoRA, build the optimizer) → operate (forward,
forward_backward, optim_step) → save / export → close. Every path that trains (in-process, gRPC,
controller, Lightning) drives this one class, so they all produce the same bits.

What it returns lives in ``session_results``, the per-batch loss in ``loss_hook`` and the checkpoint
format in ``session_checkpoint``; the results and ``LossHook`` import from here too.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from trainwire.client.config import InputExample, TrainingConfig
from trainwire.server import session_checkpoint as ckpt
from trainwire.server import weights
from trainwire.server.batching import BatchEncoder
from trainwire.server.device import refuse_unsupported_setups, resolve_device, resolve_dtype
from trainwire.server.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from trainwire.server.loss_hook import LossHook, LossHookFactory
from trainwire.server.model_loading import (
    apply_lora,
    enable_gradient_checkpointing,
    load_model,
    load_tokenizer,
    resolve_model_dir,
)
from trainwire.server.optimization import apply_update, build_optimizer, learning_rate_at
from trainwire.server.rng import RngState, preserved_global_rng
from trainwire.server.session_results import ForwardResult, Prediction, StepResult
from trainwire.server.tensor_files import copy_into

logger = logging.getLogger(__name__)

# The RNG generators are process-wide; sessions take turns with them (see _session_rng).
_GLOBAL_RNG_LOCK = threading.RLock()


class TrainingSession:
    """One Hugging Face model trained in full or through one LoRA adapter.

    Operations are serialized by a lock, and each installs the session's own RNG state around
    itself, so sessions in one process never change each other's bits.
    """

    def __init__(
        self,
        config: TrainingConfig,
        *,
        device: str | torch.device | None = None,
        max_steps: int | None = None,
        model_root: str | Path | None = None,
        loss_hook: LossHookFactory = LossHook,
    ) -> None:
        # Validate everything first: a refused session allocates nothing.
        if not isinstance(config, TrainingConfig):
            raise InvalidArgument(f"config must be a TrainingConfig, got {type(config).__name__}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise InvalidArgument(
                f"max_steps must be a positive integer or None, got {max_steps!r}"
            )
        refuse_unsupported_setups()
        self.config = config
        self.max_steps = max_steps
        if max_steps is None and config.lr_scheduler != "constant":
            logger.warning(
                "lr_scheduler %r without max_steps: no horizon to decay over, so the rate holds "
                "at learning_rate after warmup; pass max_steps (a plan's max_steps) to decay",
                config.lr_scheduler,
            )
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(config, self.device)
        self.model_root = None if model_root is None else Path(model_root)
        self.model_dir = resolve_model_dir(config, self.model_root)

        self._lock = threading.RLock()
        if self.device.type == "cuda":
            # Initialize CUDA before seeding, so the session's RNG snapshot holds the CUDA
            # generators too; lazily initialized, they would take whatever seed came last.
            torch.cuda.init()
        self._rng = RngState.seeded(config.seed, cuda=self.device.type == "cuda")
        with self._session_rng():
            self.tokenizer = load_tokenizer(self.model_dir)
            model = load_model(config, self.model_dir, self.dtype, self.tokenizer)
            if config.lora is not None:
                model = apply_lora(model, config)
            if config.gradient_checkpointing:
                enable_gradient_checkpointing(model)
            self.model = model.to(self.device)
        self.encoder = BatchEncoder(self.tokenizer, config, self.device)
        self.optimizer = build_optimizer(self.model, config)
        # Which parameters train never changes after set up; walking a LoRA model's modules
        # for them costs milliseconds a step.
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        self._training_mode: bool | None = None  # the mode this session last set; see below
        self.loss_hook = loss_hook(config)
        self.step = 0
        self.accumulated = 0  # microbatches whose gradients are pending
        self.last_token_count = 0  # tokens in the last forward_backward batch (throughput)
        self._version = 0  # state-changing operations applied; keys the digest cache
        self._broken: str | None = None
        self._digest_cache: tuple[int, str] | None = None
        self.base_fingerprint = weights.base_model_fingerprint(self.model, self.config)

    # -- helpers -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session_rng(self, *, keep: bool = True) -> Iterator[None]:
        """Run with the session's RNG installed; keep what it drew only if the block succeeds
        (and ``keep``). The generators are process-wide, so one lock serializes every session's
        use of them: sessions on two threads never draw from each other's state."""
        with _GLOBAL_RNG_LOCK, preserved_global_rng():
            self._rng.install()
            yield
            if keep:
                self._rng = RngState.capture(cuda=self.device.type == "cuda")

    @contextlib.contextmanager
    def _operation(self, *, changes_state: bool = True) -> Iterator[None]:
        with self._lock:
            if self._broken is not None:
                raise FailedPrecondition(
                    f"the session is unusable: {self._broken}. Restore it with load_state from "
                    "a checkpoint; it refuses other operations until then"
                )
            with self._session_rng(keep=changes_state):
                yield

    def _break(self, what: str, error: BaseException) -> None:
        self._broken = f"{what} failed midway ({type(error).__name__}: {error})"
        logger.error("session marked unusable: %s", self._broken)

    def _changed(self) -> None:
        self._version += 1

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
        return self._broken

    @property
    def is_fresh(self) -> bool:
        return self._version == 0

    # -- operations ----------------------------------------------------------------------------

    def forward(self, examples: Sequence[InputExample]) -> ForwardResult:
        """The batch loss (and predictions for classification); no gradients, no state change."""
        with self._operation(changes_state=False):
            batch = self.encoder.encode(examples)
            self._set_training(False)
            try:
                with torch.no_grad():
                    output = self.loss_hook.compute_loss(self.model, batch, training=False)
            except torch.OutOfMemoryError as error:
                raise ResourceExhausted(f"forward ran out of memory: {error}") from None
            predictions = []
            if self.config.task == "sequence-classification":
                scores = output.logits.float().cpu()
                for row in scores:
                    top = int(torch.argmax(row))
                    predictions.append(Prediction(self.config.labels[top], row.tolist()))
            return ForwardResult(float(output.loss.item()), predictions)

    def forward_backward(self, examples: Sequence[InputExample]) -> float:
        """Run one microbatch forward and backward; its gradients accumulate until optim_step.

        Returns the native scalar batch loss. The pending gradients are renormalized by the
        number of microbatches really accumulated when the update is applied.
        """
        with self._operation():
            batch = self.encoder.encode(examples)
            self._set_training(True)
            try:
                loss = self.loss_hook.compute_loss(self.model, batch, training=True).loss
            except torch.OutOfMemoryError as error:
                # Nothing was applied yet: the session's state (RNG included) is unchanged.
                raise ResourceExhausted(f"forward_backward ran out of memory: {error}") from None
            try:
                loss.backward()
            except BaseException as error:
                self._break("forward_backward", error)
                if isinstance(error, torch.OutOfMemoryError):
                    raise ResourceExhausted(
                        f"forward_backward ran out of memory: {error}"
                    ) from error
                raise
            self.accumulated += 1
            self.last_token_count = batch.token_count
            self._changed()
            return float(loss.item())

    def optim_step(self) -> StepResult:
        """Apply one update: renormalize, clip, step AdamW at the scheduled rate, zero grads."""
        with self._operation():
            if self.accumulated == 0:
                raise FailedPrecondition(
                    "optim_step: no microbatch accumulated since the last update; "
                    "run forward_backward first"
                )
            try:
                rate = learning_rate_at(self.step, self.config, self.max_steps)
            except ValueError as error:
                raise InvalidArgument(str(error)) from None
            try:
                grad_norm = apply_update(
                    self.optimizer,
                    self._trainable,
                    accumulated=self.accumulated,
                    max_grad_norm=self.config.max_grad_norm,
                    rate=rate,
                )
            except BaseException as error:
                self._break("optim_step", error)
                if isinstance(error, torch.OutOfMemoryError):
                    raise ResourceExhausted(f"optim_step ran out of memory: {error}") from error
                raise
            self.step += 1
            self.accumulated = 0
            self._changed()
            return StepResult(self.step, rate, grad_norm)

    # -- state -----------------------------------------------------------------------------

    def pending_gradients(self) -> dict[str, torch.Tensor]:
        return {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}

    @property
    def rng_state(self) -> RngState:
        """The session's own RNG snapshot (installed around each operation)."""
        return self._rng

    def state_digest(self) -> str:
        """sha256 over the whole continuation state: parameters, optimizer moments, schedule
        position, pending gradients, accumulation counter, RNG and loss-hook state.

        Equal digests mean equal continuations. Cached per state version.
        """
        with self._lock:
            return self._state_digest_held()

    def drop_digest_cache(self) -> None:
        """Forget the cached digest, as an operation does (benchmarks time its computation)."""
        with self._lock:
            self._digest_cache = None

    def _state_digest_held(self, contents: ckpt.CheckpointContents | None = None) -> str:
        """``state_digest`` for a caller that holds the lock, or a helper thread working for it
        (a checkpoint hashes its ``contents`` while it writes them)."""
        if self._digest_cache is not None and self._digest_cache[0] == self._version:
            return self._digest_cache[1]
        value = (contents or self._contents()).state_digest()
        self._digest_cache = (self._version, value)
        return value

    def checkpoint_contents(self) -> ckpt.CheckpointContents:
        """Everything ``save_state`` writes, as live tensors (call it between operations)."""
        with self._lock:
            return self._contents()

    def _contents(self) -> ckpt.CheckpointContents:
        return ckpt.CheckpointContents(
            config=self.config,
            device_type=self.device.type,
            step=self.step,
            accumulated=self.accumulated,
            max_steps=self.max_steps,
            base_model_fingerprint=self.base_fingerprint,
            loss_hook=type(self.loss_hook).__name__,
            rng=self._rng,
            parameters=dict(self.model.named_parameters()),
            optimizer=ckpt.optimizer_state_tensors(self.optimizer),
            gradients=self.pending_gradients(),
            loss_hook_state=self.loss_hook.session_state_dict(),
        )

    def save_state(self, path: str | Path, *, extra: dict[str, Any] | None = None) -> None:
        """Write the complete continuation state to a checkpoint directory, atomically.

        ``extra`` (JSON) rides along; managed runs keep their cursor and history there.
        """
        with self._lock:
            if self._broken is not None:
                raise FailedPrecondition(f"cannot save an unusable session: {self._broken}")
            contents = self._contents()
            digest = functools.partial(self._state_digest_held, contents)
            ckpt.write_checkpoint(Path(path), contents, digest, extra or {})

    def load_state(self, path: str | Path) -> dict[str, Any]:
        """Restore everything from a checkpoint into this fresh session; returns its ``extra``."""
        with self._lock:
            if not self.is_fresh and self._broken is None:
                raise FailedPrecondition(
                    f"load_state needs a fresh session; this one has applied {self._version} "
                    f"operation(s) (step {self.step}). Open a new session to restore"
                )
            live = dict(self.model.named_parameters())
            restored = ckpt.read_checkpoint(
                Path(path),
                config=self.config,
                device_type=self.device.type,
                max_steps=self.max_steps,
                live=live,
                optimizer=self.optimizer,
            )
            self._apply_restored(restored, live)
            self._broken = None
            self._changed()
            return restored.extra

    def _apply_restored(self, restored: ckpt.RestoredState, live: dict[str, Any]) -> None:
        # Everything is read and checked; now apply it (the hook first: it may still refuse).
        self.loss_hook.load_session_state_dict(restored.loss_hook_state)
        try:
            restored.apply_tensors(live, self.optimizer)
        except BaseException as error:
            # Half restored: refuse everything until a load_state succeeds (a retry still works).
            self._break("load_state", error)
            raise
        for name, parameter in live.items():
            parameter.grad = restored.gradients.get(name)
        self.step = restored.step
        self.accumulated = restored.accumulated
        self.base_fingerprint = restored.base_model_fingerprint
        self._rng = restored.rng

    def load_weights(self, path: str | Path) -> None:
        """Copy weights only, from a session checkpoint, a native model or a PEFT adapter.

        The optimizer, schedule and RNG stay this run's. A full model seeds a LoRA session's base
        weights (the adapters stay fresh).
        """
        with self._operation():
            # Read and check everything first; then apply, and a failure midway (out of memory,
            # say) marks the session unusable rather than leaving half the weights copied.
            load = weights.plan_weights_load(
                self.model, Path(path), self.config, self.base_fingerprint
            )
            try:
                load.apply(self.model)
            except BaseException as error:
                self._break("load_weights", error)
                raise
            self.base_fingerprint = weights.base_model_fingerprint(self.model, self.config)
            self._changed()

    def export_weights(self, path: str | Path) -> None:
        """Write a directory ``transformers`` (full) or ``peft`` (adapter) loads, atomically."""
        with self._lock:
            if self._broken is not None:
                raise FailedPrecondition(f"cannot export an unusable session: {self._broken}")
            self._export_model(self.model, Path(path))

    def _export_model(self, model: torch.nn.Module, path: Path) -> None:
        provenance = {
            "base_model_fingerprint": self.base_fingerprint,
            "step": self.step,
            "state_digest": self.state_digest(),
        }
        weights.write_export(path, model, self.tokenizer, self.config, provenance)

    def export_checkpoint_weights(self, checkpoint: str | Path, path: str | Path) -> None:
        """Export the weights of a checkpoint from a detached CPU copy; live state untouched."""
        with self._lock:
            # The checkpoint's own provenance: a load_weights since may have changed the live base.
            provenance = ckpt.read_provenance(Path(checkpoint))
            detached = copy.deepcopy(self.model).to("cpu")
            pairs = weights.plan_checkpoint_load(detached, Path(checkpoint))
            copy_into(pairs)
            # The name, not the path: the same weights give the same export files anywhere.
            provenance["checkpoint"] = Path(checkpoint).name
            weights.write_export(Path(path), detached, self.tokenizer, self.config, provenance)
