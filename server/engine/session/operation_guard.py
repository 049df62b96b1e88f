"""What every session operation runs inside: the session's lock, its own RNG and its health.

The torch, NumPy and Python generators are process-wide, so a session keeps its own snapshot
and installs it around each operation; one process-wide lock makes sessions on two threads take
turns with the generators, so interleaving two sessions changes neither's bits. An operation
that fails midway (after it began to change tensors) marks the session broken: it refuses
everything until a ``load_state`` restores it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

from trainwire.server.engine.session.rng import RngState, preserved_global_rng
from trainwire.server.errors import FailedPrecondition, ResourceExhausted, is_out_of_memory

logger = logging.getLogger(__name__)


class OperationGuard:
    """One session's lock, RNG snapshot, broken flag and state version."""

    def __init__(self, rng: RngState, *, cuda: bool) -> None:
        self.lock = threading.RLock()
        self.rng = rng
        self.cuda = cuda
        self.broken: str | None = None
        self.version = 0  # state-changing operations applied; keys the digest cache
        self.fresh_at = 0  # the version right after the last restore (0: as built)

    @contextlib.contextmanager
    def session_rng(self, *, keep: bool = True) -> Iterator[None]:
        """Run with the session's RNG installed; keep what it drew only if the block succeeds
        (and ``keep``). The generators are process-wide, so one lock serializes every session's
        use of them: sessions on two threads never draw from each other's state."""
        with preserved_global_rng():  # holds the process-wide generators' lock
            self.rng.install()
            yield
            if keep:
                self.rng = self.rng.advanced(cuda=self.cuda)

    def drew_nothing(self) -> None:
        """The RNG as a state-changing operation that drew nothing leaves it (a shared pass,
        which checks it drew nothing): on a CPU session the same state, with nothing to install
        or read back (that costs a tenth of a millisecond a run, every pass); on a CUDA session
        read back as ``session_rng`` does, since CUDA's generators join the state once CUDA is
        up."""
        if self.cuda:
            with self.session_rng():
                pass

    @contextlib.contextmanager
    def operation(self, *, changes_state: bool = True) -> Iterator[None]:
        """Hold the lock with the session's RNG installed; refuse while the session is broken.

        ``changes_state=False`` (forward, sample) puts the RNG back as it was afterwards.
        """
        with self.lock:
            self.refuse_if_broken("the session is unusable")
            with self.session_rng(keep=changes_state):
                yield

    def refuse_if_broken(self, what: str) -> None:
        if self.broken is not None:
            raise FailedPrecondition(
                f"{what}: {self.broken}. Restore it with load_state from a checkpoint; it "
                "refuses other operations until then"
            )

    @contextlib.contextmanager
    def breaks_on_failure(self, what: str) -> Iterator[None]:
        """A failure inside leaves tensors half changed: mark the session broken and re-raise
        (an out-of-memory error as ``ResourceExhausted``)."""
        try:
            yield
        except BaseException as error:
            self.broken = f"{what} failed midway ({type(error).__name__}: {error})"
            logger.error("session marked unusable: %s", self.broken)
            if _out_of_memory(error):
                raise ResourceExhausted(
                    f"{what} ran out of memory midway ({_first_line(error)}); the session is "
                    "unusable until it is restored from a checkpoint: restart the server (it "
                    "restores the latest) and send smaller microbatches"
                ) from error
            raise

    def changed(self) -> None:
        self.version += 1

    @property
    def fresh(self) -> bool:
        """Nothing applied since the session was built or last restored from a checkpoint, so
        its whole state is one a load_state may replace (a restarted server's replayed
        LoadState meets a session that recovery just restored)."""
        return self.version == self.fresh_at

    def restored(self) -> None:
        """A load_state replaced the whole state: usable again, and fresh."""
        self.broken = None
        self.changed()
        self.fresh_at = self.version


@contextlib.contextmanager
def refuse_out_of_memory(what: str) -> Iterator[None]:
    """Out of memory before anything changed: ``ResourceExhausted``, the session intact.

    On the CPU torch raises a plain RuntimeError (``DefaultCPUAllocator: ...``), on CUDA
    ``torch.OutOfMemoryError``; both are the caller's to act on, so both say what to do.
    """
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
        if not _out_of_memory(error):
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the failed attempt cached is no use to the next
        raise ResourceExhausted(
            f"{what} ran out of memory ({_first_line(error)}); nothing changed. Send smaller "
            "microbatches (fewer or shorter examples), or run the server with more memory"
        ) from None


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or is_out_of_memory(error)


def _first_line(error: BaseException) -> str:
    """An allocator's message without the C++ stack some builds append."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
