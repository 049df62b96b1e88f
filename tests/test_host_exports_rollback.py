"""Exports belong to their journal entry: a restart that forgets an ExportWeights forgets its
files too, and replaying the forgotten operations writes the same export again."""

from __future__ import annotations

import pytest
from host_operations import BATCHES, op

from trainwire.client import outcomes
from trainwire.server.errors import NotFound


def test_an_export_of_a_forgotten_timeline_is_removed_and_replayed_identically(host, make_host):
    host.forward_backward(BATCHES[0], op("fb-1", 0))
    host.save_state("c", op("save", 1))
    host.forward_backward(BATCHES[1], op("fb-2", 2))
    exported = host.export_weights("e", op("export", 3))
    export_dir = exported.directory
    first_files = exported.files
    host.release()  # a crash: fb-2 and the export are after the checkpoint

    restarted = make_host()
    assert restarted.info().position == 2
    assert not export_dir.exists()
    with pytest.raises(NotFound):
        restarted.load_weights(outcomes.WeightsSource("export", "e"), op("load-e", 2))
    restarted.forward_backward(BATCHES[1], op("fb-2", 2))
    again = restarted.export_weights("e", op("export", 3))
    assert not again.replayed and again.files == first_files
