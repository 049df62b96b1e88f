"""The plan's promises, as properties over random sizes and settings."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainwire.client import InputExample, ManagedTrainingPlan, TrainingConfig


def make_examples(count):
    # Lengths vary so that length grouping has something to sort.
    return [InputExample("word " * (1 + (i * 7) % 13) + str(i)) for i in range(count)]


plan_settings = st.fixed_dictionaries(
    {
        "count": st.integers(1, 60),
        "batch_size": st.integers(1, 9),
        "gradient_accumulation_steps": st.integers(1, 5),
        "num_epochs": st.integers(1, 3),
        "shuffle": st.booleans(),
        "group_by_length": st.booleans(),
        "seed": st.integers(0, 2**31),
    }
)


@settings(max_examples=150, deadline=None)
@given(plan_settings)
def test_plan_properties_hold_for_random_settings(s):
    count = s.pop("count")
    config = TrainingConfig(model="m", **s)
    examples = make_examples(count)
    plan = ManagedTrainingPlan(examples, config)

    rows_by_epoch = {}
    updates = 0
    since_update = 0
    for i in range(plan.batch_count):
        rows = plan.rows(i)
        assert plan.batch(i) == [examples[r] for r in rows]
        assert 1 <= len(rows) <= config.batch_size
        rows_by_epoch.setdefault(plan.epoch(i), []).extend(rows)
        since_update += 1
        if plan.is_epoch_end(i):
            assert plan.is_update(i), "an epoch end always closes the accumulation"
        if plan.is_update(i):
            updates += 1
            assert since_update == config.gradient_accumulation_steps or plan.is_epoch_end(i)
            since_update = 0
        else:
            assert since_update < config.gradient_accumulation_steps
    assert since_update == 0
    assert updates == plan.max_steps
    assert sorted(rows_by_epoch) == list(range(config.num_epochs))
    for rows in rows_by_epoch.values():
        assert sorted(rows) == list(range(count)), "each epoch visits each row exactly once"
    full_batches, remainder = divmod(count, config.batch_size)
    assert plan.batch_count == config.num_epochs * (full_batches + (remainder > 0))
    # Only the last batch of an epoch may be partial: nothing is dropped, nothing padded.
    for i in range(plan.batch_count):
        if not plan.is_epoch_end(i):
            assert len(plan.rows(i)) == config.batch_size


def test_shuffling_differs_between_epochs_and_is_seeded():
    config = TrainingConfig(model="m", batch_size=4, num_epochs=2)
    examples = make_examples(40)
    plan = ManagedTrainingPlan(examples, config)
    first = [r for i in range(10) for r in plan.rows(i)]
    second = [r for i in range(10, 20) for r in plan.rows(i)]
    assert first != second
    assert ManagedTrainingPlan(examples, config).fingerprint == plan.fingerprint
    assert ManagedTrainingPlan(examples, config.replace(seed=1)).fingerprint != plan.fingerprint


def test_no_shuffle_keeps_the_dataset_order():
    plan = ManagedTrainingPlan(
        make_examples(10), TrainingConfig(model="m", batch_size=4, shuffle=False)
    )
    assert [plan.rows(i) for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_length_grouping_puts_similar_lengths_together():
    examples = [InputExample("x" * (1 + (i * 37) % 100)) for i in range(400)]
    config = TrainingConfig(model="m", batch_size=8, group_by_length=True)
    plan = ManagedTrainingPlan(examples, config)

    def spread(rows):
        lengths = [len(examples[r].text) for r in rows]
        return max(lengths) - min(lengths)

    grouped = sum(spread(plan.rows(i)) for i in range(plan.batch_count))
    shuffled_plan = ManagedTrainingPlan(examples, config.replace(group_by_length=False))
    shuffled = sum(spread(shuffled_plan.rows(i)) for i in range(shuffled_plan.batch_count))
    assert grouped * 4 < shuffled


def test_partial_accumulation_closes_at_the_epoch_end():
    config = TrainingConfig(model="m", batch_size=2, gradient_accumulation_steps=4, num_epochs=2)
    plan = ManagedTrainingPlan(make_examples(11), config)  # 6 microbatches an epoch
    updates = [i for i in range(plan.batch_count) if plan.is_update(i)]
    assert updates == [3, 5, 9, 11]
    assert plan.max_steps == 4
    assert [plan.steps_after(i) for i in updates] == [1, 2, 3, 4]


def test_evaluation_boundaries_by_epoch_and_by_steps():
    evals = [InputExample("held out")]
    by_epoch = TrainingConfig(model="m", batch_size=2, num_epochs=3, eval_strategy="epoch")
    plan = ManagedTrainingPlan(make_examples(5), by_epoch, eval_examples=evals)
    assert [i for i in range(plan.batch_count) if plan.evaluates_after(i)] == [2, 5, 8]
    by_steps = by_epoch.replace(eval_strategy="steps", eval_steps=2, gradient_accumulation_steps=1)
    plan = ManagedTrainingPlan(make_examples(5), by_steps, eval_examples=evals)
    assert [i for i in range(plan.batch_count) if plan.evaluates_after(i)] == [1, 3, 5, 7]


def test_evaluation_without_eval_examples_is_refused():
    config = TrainingConfig(model="m", eval_strategy="epoch")
    with pytest.raises(ValueError, match="eval examples"):
        ManagedTrainingPlan(make_examples(3), config)


def test_an_empty_dataset_and_unknown_labels_are_refused():
    config = TrainingConfig(model="m", task="sequence-classification", labels=("a", "b"))
    with pytest.raises(ValueError, match="empty"):
        ManagedTrainingPlan([], config)
    with pytest.raises(ValueError, match=r"example 1: unknown label 'c'"):
        ManagedTrainingPlan([InputExample("x", label="a"), InputExample("y", label="c")], config)


def test_manifest_round_trips_and_keeps_its_fingerprint():
    config = TrainingConfig(model="m", batch_size=3, num_epochs=2, eval_strategy="epoch",
                            early_stopping=True, early_stopping_patience=2)  # fmt: skip
    plan = ManagedTrainingPlan(make_examples(10), config, eval_examples=[InputExample("e")])
    manifest = plan.to_manifest()
    again = ManagedTrainingPlan.from_manifest(manifest)
    assert again.fingerprint == plan.fingerprint == manifest["fingerprint"]
    assert [again.rows(i) for i in range(again.batch_count)] == [
        plan.rows(i) for i in range(plan.batch_count)
    ]
    assert manifest["selection"] == {"metric": "eval_loss", "mode": "min", "patience": 2}


@pytest.mark.parametrize(
    "tamper",
    [
        lambda m: m["examples"][0].update(text="changed"),
        lambda m: m["config"].update(learning_rate=1.0),
        lambda m: m["microbatches"][0].update(update=not m["microbatches"][0]["update"]),
        lambda m: m["eval_examples"].append({"text": "extra"}),
    ],
)
def test_a_tampered_manifest_is_refused(tamper):
    config = TrainingConfig(model="m", batch_size=3)
    manifest = ManagedTrainingPlan(make_examples(7), config).to_manifest()
    tamper(manifest)
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        ManagedTrainingPlan.from_manifest(manifest)


def test_eval_examples_given_to_to_manifest_replace_the_constructors():
    config = TrainingConfig(model="m", eval_strategy="epoch")
    plan = ManagedTrainingPlan(make_examples(4), config, eval_examples=[InputExample("a")])
    manifest = plan.to_manifest(eval_examples=[InputExample("b")])
    assert manifest["eval_examples"] == [{"text": "b"}]
    assert manifest["fingerprint"] != plan.fingerprint
    assert ManagedTrainingPlan.from_manifest(manifest).fingerprint == manifest["fingerprint"]


def refingerprint(manifest):
    from trainwire.contract.config import canonical_json, sha256_fingerprint

    body = {key: value for key, value in manifest.items() if key != "fingerprint"}
    return {**body, "fingerprint": sha256_fingerprint(canonical_json(body))}


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda m: m.update(extra=1), "not in canonical form"),
        (lambda m: m["config"].pop("seed"), "not in canonical form"),
        (lambda m: m["microbatches"][0].update(evaluate=True), "evaluation point"),
        (lambda m: m["microbatches"].reverse(), "epochs must run"),
        (lambda m: m["microbatches"][0].update(update=True), "updates must close"),
        (
            lambda m: m["microbatches"][0]["rows"].append(m["microbatches"][1]["rows"].pop()),
            "partial",
        ),
    ],
)
def test_a_refingerprinted_manifest_must_still_keep_the_plans_promises(tamper, message):
    config = TrainingConfig(model="m", batch_size=3, gradient_accumulation_steps=2, num_epochs=2)
    manifest = ManagedTrainingPlan(make_examples(9), config).to_manifest()
    tamper(manifest)
    with pytest.raises(ValueError, match=message):
        ManagedTrainingPlan.from_manifest(refingerprint(manifest))
