"""The contract: what the client and the server both speak.

The types a request and its answer are made of (``config``: TrainingConfig, LoraSettings,
InputExample; ``tokens``: TokenExample and the loss names; ``outcomes``), how they travel over
gRPC (``codec``, and ``chunks`` for the export stream), and what both sides do with a plan the
same way: ``planning`` (the plan and its manifest), ``run`` (the one replay loop every runner
goes through, with its selection, history and results) and ``report`` (the files and words a
finished run leaves). ``files`` holds the atomic writes both sides rely on.

Both sides import the contract; the contract imports neither, nor torch, so a CPU-only control
plane can plan and drive a run. This package imports nothing itself: import the module you need.
"""
