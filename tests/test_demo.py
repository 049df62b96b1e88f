"""`trainwire demo`: the main job on its embedded default, end to end through a local server."""

from trainwire.demo import DemoSettings, run_demo, summary_shows_learning


def test_the_demo_runs_end_to_end_and_learns(tmp_path):
    result = run_demo(tmp_path, settings=DemoSettings.fast(), quiet=True)
    assert summary_shows_learning(tmp_path / "run")
    accuracies = [r["eval_accuracy"] for r in result.history if r["kind"] == "evaluation"]
    assert accuracies[0] <= 0.6 < 0.9 <= max(accuracies)
