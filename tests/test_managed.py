"""ManagedTraining: the in-process replay equals the plan driven op by op, and resumes exactly."""

import pytest
from fresh_state import fresh_digest
from plans import drive_plan, sentiment_plan

from trainwire.client import LoraSettings, ManagedTrainingPlan
from trainwire.server.engine.managed import ManagedTraining
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import tiny_text_examples


@pytest.fixture
def plans(bert_classifier_config, llama_config):
    """``plans[task](**changes)``: a small plan of each task."""
    return {
        "classification": lambda **changes: sentiment_plan(
            bert_classifier_config, **{"learning_rate": 3e-3, **changes}
        ),
        "causal-lm": lambda **changes: ManagedTrainingPlan(
            tiny_text_examples(10), llama_config(batch_size=4, num_epochs=2, **changes)
        ),
    }


def op_by_op_digest(plan):
    session = TrainingSession(plan.config, max_steps=plan.max_steps)
    drive_plan(session, plan)
    return fresh_digest(session)


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, dropout=0.1)])
@pytest.mark.parametrize("task", ["classification", "causal-lm"])
def test_managed_run_equals_the_plan_driven_op_by_op(plans, task, lora, tmp_path):
    plan = plans[task](lora=lora)
    session = TrainingSession(plan.config, max_steps=plan.max_steps)
    training = ManagedTraining(session, plan, checkpoint_dir=tmp_path)
    result = training.run()
    assert result.state_digest == fresh_digest(session) == op_by_op_digest(plan)
    assert result.stopped_step == plan.max_steps
    assert [r["step"] for r in result.history if r["kind"] == "update"] == list(
        range(1, plan.max_steps + 1)
    )


def test_resume_from_a_managed_checkpoint_mid_accumulation_equals_the_uninterrupted_run(
    plans, tmp_path
):
    plan = plans["classification"]()
    uninterrupted = ManagedTraining(
        TrainingSession(plan.config, max_steps=plan.max_steps), plan, checkpoint_dir=tmp_path / "a"
    ).run()

    first = ManagedTraining(
        TrainingSession(plan.config, max_steps=plan.max_steps), plan, checkpoint_dir=tmp_path / "b"
    )
    stop_at = 2  # microbatch 2 opens an accumulation that microbatch 3 closes
    assert not plan.is_update(stop_at)

    # Interrupt the first run right after microbatch 2, then checkpoint it there.
    class Stop(Exception):
        pass

    def stop(progress):
        if progress.microbatch == stop_at:
            raise Stop

    with pytest.raises(Stop):
        first.run(on_step=stop)
    first.save_state(tmp_path / "resume")

    resumed = ManagedTraining(
        TrainingSession(plan.config, max_steps=plan.max_steps), plan, checkpoint_dir=tmp_path / "c"
    )
    resumed.load_state(tmp_path / "resume")
    assert resumed.state.next_microbatch == stop_at + 1
    result = resumed.run()
    assert result.state_digest == uninterrupted.state_digest
    assert result.history == uninterrupted.history
    assert (result.best_step, result.best_score) == (
        uninterrupted.best_step,
        uninterrupted.best_score,
    )


def test_a_checkpoint_of_another_plan_is_refused(plans, tmp_path):
    plan = plans["classification"]()
    training = ManagedTraining(TrainingSession(plan.config, max_steps=plan.max_steps), plan)
    training.save_state(tmp_path / "ckpt")
    other = plans["classification"](seed=1)
    fresh = ManagedTraining(TrainingSession(other.config, max_steps=other.max_steps), other)
    with pytest.raises(RuntimeError, match="belongs to plan"):
        fresh.load_state(tmp_path / "ckpt")


def test_a_session_built_for_another_plan_is_refused(plans):
    plan = plans["classification"]()
    with pytest.raises(ValueError, match="max_steps"):
        ManagedTraining(TrainingSession(plan.config, max_steps=plan.max_steps + 1), plan)
    other = plans["classification"](learning_rate=1e-2)
    with pytest.raises(ValueError, match="config"):
        ManagedTraining(TrainingSession(other.config, max_steps=plan.max_steps), plan)


def test_early_stopping_ends_the_run_and_best_export_leaves_the_live_state_alone(plans, tmp_path):
    # A learning rate of zero never improves: the first evaluation is the best, and a tie is no
    # gain, so patience 1 stops after the second evaluation.
    plan = plans["classification"](
        learning_rate=0.0, early_stopping=True, early_stopping_patience=1
    )
    session = TrainingSession(plan.config, max_steps=plan.max_steps)
    training = ManagedTraining(session, plan, checkpoint_dir=tmp_path)
    result = training.run()
    evaluations = [r for r in result.history if r["kind"] == "evaluation"]
    assert len(evaluations) == 2 and result.early_stopped
    assert result.best_epoch == 0 and result.stopped_epoch == 1
    assert result.stopped_step == plan.steps_after(evaluations[-1]["microbatch"])
    before = fresh_digest(session)
    training.export_weights(tmp_path / "export")
    assert fresh_digest(session) == before
    assert (tmp_path / "export" / "config.json").is_file()
