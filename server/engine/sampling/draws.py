"""Each step's draw of a sample's next token: greedy, or temperature, top-k, top-p, then a draw.

Its own module so that the batched decode (``batch_decode``) and the sampler share it; a
request's settings are ``params``'. Every operation is per row, and the draw's noise is laid out per
row (``torch.multinomial`` of one sample divides by exponential noise drawn for the whole
[rows, vocab] tensor and takes each row's argmax): a row's token depends only on its own logits
and its place in its request's rows, never on another row's values.
"""

from __future__ import annotations

import math

import torch

from trainwire.server.engine.sampling.params import SamplingParams

STOP, LENGTH = "stop", "length"  # Sample.stop_reason


def next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else temperature → top-k → top-p → draw."""
    if params.temperature == 0:
        return torch.argmax(logits, dim=-1)
    logits = _tempered(logits, float(params.temperature))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        ordered_probabilities = torch.softmax(ordered, dim=-1)
        # Drop a token once the ones before it already reach top_p; the first always stays.
        drop = (ordered_probabilities.cumsum(dim=-1) - ordered_probabilities) >= params.top_p
        # Stated, not left to the comparison: a top_p that float32 rounds to 0 (5e-324, say)
        # would drop every token, and a draw from nothing is NaN.
        drop[:, 0] = False
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, -math.inf))
    probabilities = torch.softmax(logits, dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``, computed stably where that overflows.

    A temperature near 0 (1e-300, or any that float32 rounds to 0) sends logits / temperature
    to inf, and a softmax of inf is NaN: the draw would crash on a caller's finite value. There,
    and only there, the same distribution comes from each row shifted by its largest logit
    first, in float64: the largest stay 0 and the rest fall to very negative values or -inf, so
    the draw takes the (tied) most likely tokens, the limit the caller asked for. Any
    temperature whose quotient is finite takes the plain division, so its samples keep every bit.
    """
    scaled = logits / temperature
    if temperature >= 1 or bool(torch.isfinite(scaled.amax(dim=-1)).all()):
        return scaled
    wide = logits.double()
    return (wide - wide.amax(dim=-1, keepdim=True)) / temperature
