"""Best selection and early stopping on constructed metric sequences."""

import pytest

from trainwire.client import InputExample
from trainwire.contract.run.evaluation import EvaluationTally, evaluation_batches
from trainwire.contract.run.selection import SelectionState


def observe_all(values, *, mode="min", patience=None):
    state = SelectionState(metric="eval_loss", mode=mode, patience=patience)
    flags = []
    for step, value in enumerate(values, start=1):
        flags.append(state.observe({"eval_loss": value}, step=step, epoch=step - 1))
        if state.stopped_early:
            break
    return state, flags


def test_the_earliest_best_wins_a_tie():
    state, flags = observe_all([0.5, 0.4, 0.4, 0.45])
    assert flags == [True, True, False, False]
    assert (state.best_value, state.best_step, state.best_epoch) == (0.4, 2, 1)


def test_a_later_best_replaces_the_earlier():
    state, _ = observe_all([0.9, 0.5, 0.7, 0.3])
    assert (state.best_value, state.best_step) == (0.3, 4)


def test_max_mode_prefers_higher_values():
    state, flags = observe_all([0.5, 0.75, 0.75, 0.7], mode="max")
    assert flags == [True, True, False, False]
    assert state.best_value == 0.75 and state.best_step == 2


@pytest.mark.parametrize(
    ("values", "patience", "stopped_after"),
    [
        ([0.5, 0.5, 0.5], 2, 3),  # ties are no gain: they count against patience
        ([0.5, 0.6, 0.4, 0.45, 0.41], 2, 5),  # a gain resets the counter
        ([0.5, 0.6], 1, 2),
        ([0.5, 0.4, 0.3], 1, None),  # always improving: never stops
    ],
)
def test_early_stopping_counts_evaluations_without_gain(values, patience, stopped_after):
    state, flags = observe_all(values, patience=patience)
    if stopped_after is None:
        assert not state.stopped_early and len(flags) == len(values)
    else:
        assert state.stopped_early and len(flags) == stopped_after


def test_selection_state_round_trips():
    state, _ = observe_all([0.5, 0.6], patience=3)
    assert SelectionState.from_dict(state.to_dict()) == state


def test_evaluation_tally_weights_batches_by_examples_and_counts_accuracy():
    examples = [InputExample(str(i), label="a" if i % 2 else "b") for i in range(5)]
    batches = evaluation_batches(examples, 2)
    assert [len(b) for b in batches] == [2, 2, 1]
    tally = EvaluationTally()
    tally.add(batches[0], 1.0, ["b", "a"])  # both right
    tally.add(batches[1], 2.0, ["a", "a"])  # one right
    tally.add(batches[2], 4.0, ["a"])  # wrong
    assert tally.metrics() == {"eval_loss": (2 * 1.0 + 2 * 2.0 + 4.0) / 5, "eval_accuracy": 3 / 5}
