"""``trainwire demo --server`` runs again as written: each demo is a run of its own on that
server (a closed run id stays closed), and ``--run-id`` names it."""

from __future__ import annotations

import pytest
from service_fixtures import running_server

from trainwire.cli import main


@pytest.mark.slow
def test_the_demo_against_a_server_runs_twice_and_takes_a_run_id(tmp_path, capsys):
    root = tmp_path / "root"
    root.mkdir()
    with running_server(tmp_path / "state", root) as handle:
        demo = ["demo", "--fast", "--quiet", "--server", handle.target]
        assert main([*demo, "--work-dir", str(root / "first")]) == 0
        assert main([*demo, "--work-dir", str(root / "second")]) == 0
        assert capsys.readouterr().out.count("final state digest") == 2
    state = sorted(p.name for p in (tmp_path / "state" / "runs").iterdir())
    assert state == ["demo-first", "demo-second"]


def test_demo_passes_its_run_id_and_derives_one_per_work_dir_for_a_server(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr("trainwire.demo.run_demo", lambda *a, **kw: calls.append(kw["run_id"]))
    assert main(["demo", "--quiet", "--work-dir", str(tmp_path / "a")]) == 0
    assert main(["demo", "--quiet", "--work-dir", str(tmp_path / "b"), "--run-id", "mine"]) == 0
    server = ["--server", "127.0.0.1:1"]
    assert main(["demo", "--quiet", *server, "--work-dir", str(tmp_path / "c d")]) == 0
    assert calls == ["demo", "mine", "demo-c-d"]
