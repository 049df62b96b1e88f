"""The training engine: ``TrainingSession`` and everything it uses (model loading, batches, losses,
optimizer and schedule, sampling, weights, checkpoints), plus ``ManagedTraining``, the in-process
driver of a plan.

Plain Python and torch: nothing here imports grpc, protobuf or the service, so the engine can be
driven, tested and benchmarked on its own.
"""
