"""Whether this device's linear layers give a row the same bits alone and stacked among others.

A shared pass (``run_together``) multiplies every session's rows by the base weights in one
matrix product, where alone each session's rows are a product of their own. The bits agree only
where the kernels compute a row the same way whatever else is in the product: measured true of
this build's CPU kernels from 12 rows up with 2 threads (from 4 with 1), false below (a product
of a few rows takes another path), and unknown elsewhere (another BLAS, a GPU, another dtype).
So the engine does not assume it: ``row_invariance`` probes the base's own linear shapes and
its output head once per device, dtype, thread count and shapes, forward and backward (the
input's gradient is the same kind of product), and says from how many rows up (``min_rows``)
and up to how many stacked rows (``max_rows``) it holds. Requests outside that run in turns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainwire.server.engine.loss.chunked_logprobs import positions_per_chunk

# Row counts (positions: a batch's rows times its padded width) probed as a block alone and
# stacked: every count up to 16, where the kernels' choice of path changes, then the sizes
# steps take.
BLOCK_ROWS = (*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# A probed block stands among this many blocks of its size (and a few rows more), first and
# last: the most runs one pass is meant to hold.
STACKED_BLOCKS = 8
EXTRA_ROWS = 5
# Distinct (in, out) shapes probed, the largest first: a model's linear layers have few.
MAX_SHAPES = 6


@dataclass(frozen=True)
class RowInvariance:
    """What the probe found on one device, dtype and set of linear shapes.

    ``min_rows`` is the smallest probed block from which every larger probed block gave the same
    bits alone and stacked (None: not even the largest did, so nothing runs together);
    ``max_rows`` the largest stacked product probed; ``head_rows`` the largest probed for the
    output head (what one chunk of its logits holds at the default budget, at most
    ``max_rows``): the head's stacks hold no more.
    """

    device: str
    dtype: torch.dtype
    min_rows: int | None
    max_rows: int
    head_rows: int

    def problem(self, blocks: Sequence[int]) -> str | None:
        """Why blocks of these row counts cannot share a product bit for bit, or None."""
        if self.min_rows is None:
            return (
                f"{self.device} ({self.dtype}) gives a linear layer's rows other bits stacked "
                "than alone"
            )
        small = [rows for rows in blocks if rows < self.min_rows]
        if small:
            return (
                f"a request of {small[0]} positions is under the {self.min_rows} from which "
                f"{self.device} ({self.dtype}) gives a row the same bits alone and stacked"
            )
        if sum(blocks) > self.max_rows:
            return (
                f"the pass would hold {sum(blocks)} positions, more than the {self.max_rows} "
                f"probed on {self.device} ({self.dtype})"
            )
        return None


# A linear layer as the probe multiplies by it: (in features, out features, has a bias).
LinearShape = tuple[int, int, bool]
_probed: dict[tuple[str, torch.dtype, int, tuple[LinearShape, ...]], RowInvariance] = {}
_probing = threading.Lock()


def row_invariance(model: torch.nn.Module) -> RowInvariance:
    """The probe's answer for ``model``'s base linear layers and output head on their device,
    dtype and torch's thread count, probed on the first call for those and remembered for the
    process."""
    weight = next(model.parameters())
    shapes = base_linear_shapes(model)
    head = _shape(model.get_output_embeddings())
    # The CPU kernels' paths depend on the threads they split a product over, too.
    key = (str(weight.device), weight.dtype, torch.get_num_threads(), (*shapes, head))
    with _probing:
        if key not in _probed:
            _probed[key] = probe(shapes, head, weight.device, weight.dtype)
        return _probed[key]


def base_linear_shapes(model: torch.nn.Module) -> tuple[LinearShape, ...]:
    """The distinct shapes of the model's base linear layers but its head, largest first: the
    products a shared pass stacks (with a bias, another kernel may run). LoRA's own layers run
    per session."""
    head = model.get_output_embeddings()
    skipped = {id(head), id(getattr(head, "base_layer", None))}
    shapes = {
        _shape(module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and id(module) not in skipped
        and ".lora_" not in name
    }
    return tuple(sorted(shapes, key=lambda shape: (-shape[0] * shape[1], shape)))[:MAX_SHAPES]


def _shape(module: torch.nn.Module) -> LinearShape:
    module = getattr(module, "base_layer", module)  # a LoRA layer's own linear
    return module.in_features, module.out_features, module.bias is not None


def probe(
    shapes: Sequence[LinearShape], head: LinearShape, device: torch.device, dtype: torch.dtype
) -> RowInvariance:
    """Multiply blocks alone and stacked, forward and backward, for every shape and block; the
    head's blocks up to the rows one chunk of its logits holds (its stacks never hold more)."""
    generator = torch.Generator().manual_seed(0)  # never the session's generators
    largest = STACKED_BLOCKS * BLOCK_ROWS[-1] + EXTRA_ROWS
    head_rows = min(positions_per_chunk(head[1]), largest)
    holds = {rows: True for rows in BLOCK_ROWS}
    for shape, limit in [*((shape, largest) for shape in shapes), (head, head_rows)]:
        in_features, out_features, has_bias = shape
        weight = _random((out_features, in_features), generator, device, dtype)
        bias = _random((1, out_features), generator, device, dtype)[0] if has_bias else None
        for rows in BLOCK_ROWS:
            total = min(STACKED_BLOCKS * rows + EXTRA_ROWS, limit)
            if total >= 2 * rows:
                holds[rows] &= _block_invariant(weight, bias, rows, total, generator)
    min_rows = None
    for rows in reversed(BLOCK_ROWS):
        if not holds[rows]:
            break
        min_rows = rows
    return RowInvariance(str(device), dtype, min_rows, largest, head_rows)


def _block_invariant(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: int,
    total: int,
    generator: torch.Generator,
) -> bool:
    """Whether a block of ``rows`` gives the same output, logsumexp of it (the head's) and
    input gradient alone as first and as last of a product of ``total`` rows."""
    out_features, in_features = weight.shape
    x = _random((total, in_features), generator, weight.device, weight.dtype)
    grad = _random((total, out_features), generator, weight.device, weight.dtype)
    stacked = _products(x, weight, bias, grad)
    for start in (0, total - rows):
        block = slice(start, start + rows)
        alone = _products(x[block], weight, bias, grad[block])
        if not all(torch.equal(a, b[block]) for a, b in zip(alone, stacked, strict=True)):
            return False
    return True


def _products(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A linear layer's output, the logsumexp of each of its rows in fp32 (as the head's
    logprobs take it) and, as its backward computes it, its input's gradient."""
    out = torch.nn.functional.linear(x, weight, bias)
    return out, torch.logsumexp(out.float(), dim=-1), grad.mm(weight)


def _random(
    shape: tuple[int, int], generator: torch.Generator, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
