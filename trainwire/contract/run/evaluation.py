"""Evaluation metrics from per-batch forward results, computed the same way by every runner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainwire.contract.config import InputExample


def evaluation_batches(
    examples: Sequence[InputExample], batch_size: int
) -> list[list[InputExample]]:
    """Evaluation examples in dataset order, in batches of the training batch size."""
    return [list(examples[i : i + batch_size]) for i in range(0, len(examples), batch_size)]


@dataclass
class EvaluationTally:
    """Adds up forward results batch by batch: eval_loss is the example-weighted mean of the
    batch losses; eval_accuracy (classification) the share of correct predictions."""

    loss_sum: float = 0.0
    examples: int = 0
    correct: int = 0
    classified: int = 0

    def add(
        self,
        batch: Sequence[InputExample],
        loss: float,
        predicted_labels: Sequence[str] = (),
    ) -> None:
        self.loss_sum += loss * len(batch)
        self.examples += len(batch)
        if predicted_labels:
            self.classified += len(batch)
            self.correct += sum(
                example.label == label
                for example, label in zip(batch, predicted_labels, strict=True)
            )

    def metrics(self) -> dict[str, float]:
        out = {"eval_loss": self.loss_sum / self.examples}
        if self.classified:
            out["eval_accuracy"] = self.correct / self.classified
        return out
