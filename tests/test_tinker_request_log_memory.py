"""The request log keeps heavy bodies in its file, not in memory: a run that sends many large
forward_backward calls between two checkpoints holds their ids, not their bodies. Compaction copies
a heavy record's line as written, and a restart reads the bodies back whole."""

from __future__ import annotations

from pathlib import Path

from trainwire.server.service.request_log import HEAVY_LINE_BYTES, LOG_FILE, OnDisk, RequestLog
from trainwire.server.service.request_records import CallRecord, ResultRecord, SessionRecord
from trainwire.server.service.results import Done

BODY = bytes(range(256)) * (HEAVY_LINE_BYTES // 64)  # a protobuf body past the line bound


def heavy_call(seq: int) -> CallRecord:
    return CallRecord("forward_backward", f"m/{seq}", seq, BODY + bytes([seq]), "zstd")


def test_heavy_bodies_stay_in_the_file_and_compaction_copies_them_whole(tmp_path: Path) -> None:
    log = RequestLog(tmp_path)
    small = CallRecord("optim_step", "m/3", 3, {"seq_id": 3})
    for record in (SessionRecord("s"), heavy_call(1), heavy_call(2), small):
        log.write(record)
    log.write(ResultRecord("m/2", Done(BODY)))
    calls = {r.request_id: r for r in log.records if isinstance(r, CallRecord)}
    assert isinstance(calls["m/1"].body, OnDisk) and isinstance(calls["m/2"].body, OnDisk)
    assert calls["m/3"].body == {"seq_id": 3}
    result = next(r for r in log.records if isinstance(r, ResultRecord))
    assert isinstance(result.outcome, Done) and isinstance(result.outcome.body, OnDisk)

    before = (tmp_path / LOG_FILE).read_bytes().splitlines()
    assert log.compact(
        lambda records: [r for r in records if getattr(r, "request_id", "") != "m/1"]
    )
    after = (tmp_path / LOG_FILE).read_bytes().splitlines()
    assert after == [line for line in before if b'"m/1"' not in line]  # copied as written
    assert all(not isinstance(getattr(r, "body", None), bytes) for r in log.records)
    log.close()

    reopened = RequestLog(tmp_path)  # a restart reads every body back whole
    calls = [r for r in reopened.records if isinstance(r, CallRecord)]
    assert [(c.request_id, c.body) for c in calls] == [("m/2", BODY + b"\x02"), ("m/3", small.body)]
    assert calls[0].encoding == "zstd"
    reopened.leave_bodies_on_disk()  # taken back: left in the file again
    assert isinstance(next(r for r in reopened.records if isinstance(r, CallRecord)).body, OnDisk)
    assert reopened.compact(list)  # and compacts from there, still whole
    reopened.close()
    again = RequestLog(tmp_path)
    assert next(r.body for r in again.records if isinstance(r, CallRecord)) == BODY + b"\x02"
    again.close()
