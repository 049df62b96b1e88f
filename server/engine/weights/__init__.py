"""Weights in and out of a live model: loading a model, the sources ``load_weights`` takes, the
exports, the live layout of a native directory's tensors, and tensors in files."""
