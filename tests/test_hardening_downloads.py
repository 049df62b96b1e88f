"""Issue 15, item 11: a malicious or broken server cannot make the client write without bound,
and a download never wipes a directory the caller did not say to replace.

The streams here are hand-made, as a hostile server would send them; ``receive_export`` is what
``SessionClient.export_weights(download_to=...)`` runs on the stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from trainwire.client.session.downloads import DownloadError, receive_export
from trainwire.contract import chunks
from trainwire.v1 import session_pb2 as pb

CONTENT = b"ten bytes!"


def _result(size: int = len(CONTENT), sha256: str | None = None) -> pb.ExportWeightsResponse:
    digest = sha256 or hashlib.sha256(CONTENT).hexdigest()
    return pb.ExportWeightsResponse(
        result=pb.ExportResult(
            result=pb.OperationResult(operation_key="export", position=1),
            name="final",
            format=pb.EXPORT_FORMAT_FULL,
            files=[pb.ExportedFile(path="model.bin", size_bytes=size, sha256=digest)],
        )
    )


def _honest() -> Iterator[object]:
    yield _result()
    yield chunks.RawChunk("model.bin", 0, memoryview(CONTENT))
    yield pb.ExportWeightsResponse(
        file_end=pb.FileEnd(
            path="model.bin", size_bytes=len(CONTENT), sha256=hashlib.sha256(CONTENT).hexdigest()
        )
    )


class Endless:
    """A stream announcing a 10-byte file, then sending 1 MiB chunks of it without end."""

    def __init__(self) -> None:
        self.chunks_sent = 0

    def __iter__(self) -> Iterator[object]:
        yield _result()
        block = memoryview(b"x" * (1 << 20))
        while self.chunks_sent < 64:  # a bound for the test, not for the client
            yield chunks.RawChunk("model.bin", self.chunks_sent * len(block), block)
            self.chunks_sent += 1


def test_a_file_longer_than_announced_is_refused_at_once(tmp_path):
    stream = Endless()
    with pytest.raises(DownloadError, match="more than the 10 bytes"):
        receive_export(iter(stream), tmp_path / "download")
    assert stream.chunks_sent <= 1, "the client kept receiving past the announced size"
    assert list(tmp_path.iterdir()) == [], "nothing is kept"


def test_a_file_sent_twice_is_refused(tmp_path):
    def twice() -> Iterator[object]:
        items = list(_honest())
        yield from items
        yield from items[1:]

    with pytest.raises(DownloadError, match=r"sent model\.bin twice"):
        receive_export(twice(), tmp_path / "download")
    assert list(tmp_path.iterdir()) == []


def test_a_download_refuses_a_non_empty_directory_unless_told_to_replace_it(tmp_path):
    target = tmp_path / "download"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    stream = _honest()

    with pytest.raises(FileExistsError, match="replace=True"):
        receive_export(stream, target)
    assert (target / "notes.txt").read_text() == "mine"

    outcome = receive_export(_honest(), target, replace=True)
    assert outcome.directory == target
    assert sorted(p.name for p in target.iterdir()) == ["model.bin"]
    assert (target / "model.bin").read_bytes() == CONTENT


def test_a_download_into_an_empty_or_missing_directory_needs_no_permission(tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "missing"):
        receive_export(_honest(), target)
        assert (target / "model.bin").read_bytes() == CONTENT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "missing"]
