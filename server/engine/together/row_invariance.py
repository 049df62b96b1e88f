"""Whether this device's linear layers give a row the same bits alone and stacked among others.

A shared pass (``run_together``) multiplies every session's rows by the base weights in one
matrix product, where alone each session's rows are a product of their own. The bits agree only
where the kernels compute a row the same way whatever else is in the product: true of this
build's CPU kernels from a dozen rows up, false below that (a product of a few rows takes
another path), and unknown elsewhere (another BLAS, a GPU, another dtype). So the engine does
not assume it: ``row_invariance`` probes the base's own linear shapes once per device, dtype
and shapes, forward and backward (the input's gradient is the same kind of product), and says
from how many rows up (``min_rows``) and up to how many stacked rows (``max_rows``) it holds.
Requests outside that run in turns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
    ``max_rows`` the largest stacked product probed.
    """

    device: str
    dtype: torch.dtype
    min_rows: int | None
    max_rows: int

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
_probed: dict[tuple[str, torch.dtype, tuple[LinearShape, ...]], RowInvariance] = {}
_probing = threading.Lock()


def row_invariance(model: torch.nn.Module) -> RowInvariance:
    """The probe's answer for ``model``'s base linear layers on their device and dtype, probed
    on the first call for those and remembered for the process."""
    weight = next(model.parameters())
    shapes = base_linear_shapes(model)
    key = (str(weight.device), weight.dtype, shapes)
    with _probing:
        if key not in _probed:
            _probed[key] = probe(shapes, weight.device, weight.dtype)
        return _probed[key]


def base_linear_shapes(model: torch.nn.Module) -> tuple[LinearShape, ...]:
    """The distinct shapes of the model's base linear layers, largest first: the products a
    shared pass stacks (with a bias, another kernel may run). LoRA's own layers and the output
    head run per session."""
    head = model.get_output_embeddings()
    skipped = {id(head), id(getattr(head, "base_layer", None))}
    shapes = {
        (module.in_features, module.out_features, module.bias is not None)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and id(module) not in skipped
        and ".lora_" not in name
    }
    return tuple(sorted(shapes, key=lambda shape: (-shape[0] * shape[1], shape)))[:MAX_SHAPES]


def probe(shapes: Sequence[LinearShape], device: torch.device, dtype: torch.dtype) -> RowInvariance:
    """Multiply blocks alone and stacked, forward and backward, for every shape and block."""
    generator = torch.Generator().manual_seed(0)  # never the session's generators
    holds = {rows: True for rows in BLOCK_ROWS}
    for in_features, out_features, has_bias in shapes:
        weight = _random((out_features, in_features), generator, device, dtype)
        bias = _random((1, out_features), generator, device, dtype)[0] if has_bias else None
        for rows in BLOCK_ROWS:
            holds[rows] &= _block_invariant(weight, bias, rows, generator)
    min_rows = None
    for rows in reversed(BLOCK_ROWS):
        if not holds[rows]:
            break
        min_rows = rows
    largest = BLOCK_ROWS[-1]
    return RowInvariance(str(device), dtype, min_rows, STACKED_BLOCKS * largest + EXTRA_ROWS)


def _block_invariant(
    weight: torch.Tensor, bias: torch.Tensor | None, rows: int, generator: torch.Generator
) -> bool:
    """Whether a block of ``rows`` gives the same output and input gradient alone as first
    and as last of a stacked product."""
    out_features, in_features = weight.shape
    total = STACKED_BLOCKS * rows + EXTRA_ROWS
    x = _random((total, in_features), generator, weight.device, weight.dtype)
    grad = _random((total, out_features), generator, weight.device, weight.dtype)
    stacked, stacked_grad = _linear_and_input_gradient(x, weight, bias, grad)
    for start in (0, total - rows):
        block = slice(start, start + rows)
        alone, alone_grad = _linear_and_input_gradient(x[block], weight, bias, grad[block])
        if not (
            torch.equal(alone, stacked[block]) and torch.equal(alone_grad, stacked_grad[block])
        ):
            return False
    return True


def _linear_and_input_gradient(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's output and, as its backward computes it, its input's gradient."""
    return torch.nn.functional.linear(x, weight, bias), grad.mm(weight)


def _random(
    shape: tuple[int, int], generator: torch.Generator, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
