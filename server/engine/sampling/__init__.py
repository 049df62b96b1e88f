"""Sampling: the sampler and its checked parameters, the batched KV-cache decode, each step's
draw, stop strings, and which weights a sample reads (swapped in and back for one call)."""
