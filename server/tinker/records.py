"""The request log's records, typed: what the Tinker front writes down so a restart loses nothing.

Each record is a frozen dataclass; ``to_json`` gives the one JSON object a line of the log holds
(its ``kind`` names the record type, and is written here only) and ``record_from_json`` reads it
back. The JSON form is the log's file format: it stays readable across versions.

- ``SessionRecord``: an SDK session the server created.
- ``SamplerRecord``: a sampling session, or (``named``) named sampler weights.
- ``UnnamedSnapshotsRecord``: which unnamed snapshot exports exist, oldest first.
- ``ResumeRecord``: where a compacted log resumes: the next seq_id and the journal position of
  the checkpoint it was compacted at.
- ``CallRecord``: an accepted training call, as its route takes it again.
- ``SampleRecord``: an accepted sample request.
- ``ResultRecord``: a result the journal does not hold (a forward, a sample, any failure), or,
  in a compacted log, one whose request's record is gone but which is still kept (see
  ``futures``'s retention): then with its payload's digest and when it was resolved and handed out.
- ``ForgottenRecord``: SDK sessions the front forgot (``model_slot``): a restart leaves out every
  record of theirs (``session_of_record``) until a compaction drops them.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass
from typing import Any

from trainwire.server.tinker.futures import Done, Failed, Outcome, Resolved
from trainwire.server.tinker.sdk_sessions import session_of

Body = dict[str, Any] | bytes  # a JSON request or result, or protobuf bytes


def encode_body(body: Body) -> dict[str, Any]:
    """A request or result body as JSON: objects as they are, bytes (protobuf) as base64."""
    if isinstance(body, bytes):
        return {"bytes": base64.b64encode(body).decode("ascii")}
    return {"json": body}


def decode_body(value: dict[str, Any]) -> Body:
    return base64.b64decode(value["bytes"]) if "bytes" in value else value["json"]


@dataclass(frozen=True)
class SessionRecord:
    session_id: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": "session", "session_id": self.session_id}


@dataclass(frozen=True)
class SamplerRecord:
    """A sampling session (or, ``named``, sampler weights saved under a tinker path)."""

    sampling_session_id: str
    base_model: str
    model_path: str | None
    export: str | None
    snapshot_seq: int
    named: bool = False
    export_run: str = ""  # the run that saved ``export``, when another than the model's

    def to_json(self) -> dict[str, Any]:
        fields = asdict(self)
        if not self.named:
            del fields["named"]
        if not self.export_run:
            del fields["export_run"]
        return {"kind": "sampler", **fields}


@dataclass(frozen=True)
class UnnamedSnapshotsRecord:
    exports: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "unnamed_snapshots", "exports": list(self.exports)}


@dataclass(frozen=True)
class ResumeRecord:
    next_seq: int
    position: int

    def to_json(self) -> dict[str, Any]:
        return {"kind": "resume", "next_seq": self.next_seq, "position": self.position}


@dataclass(frozen=True)
class CallRecord:
    """An accepted training call: ``route`` takes ``body`` (and ``encoding``) again."""

    route: str
    request_id: str
    seq: int
    body: Body
    encoding: str | None = None

    def to_json(self) -> dict[str, Any]:
        record = {"kind": "call", "route": self.route, "request_id": self.request_id}
        record.update(seq=self.seq, body=encode_body(self.body))
        if self.encoding is not None:
            record["encoding"] = self.encoding
        return record


@dataclass(frozen=True)
class SampleRecord:
    request_id: str
    body: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "sample", "request_id": self.request_id, "body": self.body}


@dataclass(frozen=True)
class ResultRecord:
    """A result; the optional fields (``Resolved``'s) are written only where they are known."""

    request_id: str
    outcome: Outcome
    digest: str | None = None
    resolved_at: float | None = None
    delivered_at: float | None = None

    @classmethod
    def of(cls, result: Resolved) -> ResultRecord:
        """A result kept past its request's record, with all it has to carry."""
        r = result
        return cls(r.request_id, r.outcome, r.digest, r.resolved_at, r.delivered_at)

    def resolved(self) -> Resolved:
        return Resolved(
            self.request_id, self.outcome, self.digest, self.resolved_at, self.delivered_at
        )

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"kind": "result", "request_id": self.request_id}
        if isinstance(self.outcome, Failed):
            record.update(self.outcome.body())
        else:
            record["body"] = encode_body(self.outcome.body)
        for name in RESULT_EXTRAS:
            if getattr(self, name) is not None:
                record[name] = getattr(self, name)
        return record


RESULT_EXTRAS = ("digest", "resolved_at", "delivered_at")


@dataclass(frozen=True)
class ForgottenRecord:
    session_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "forgotten", "session_ids": list(self.session_ids)}


Record = (
    SessionRecord
    | SamplerRecord
    | UnnamedSnapshotsRecord
    | ResumeRecord
    | CallRecord
    | SampleRecord
    | ResultRecord
    | ForgottenRecord
)


def session_of_record(record: Record) -> str | None:
    """The SDK session a record belongs to (None: the server's, as where to resume, or named
    sampler weights, which outlive the session that saved them)."""
    if isinstance(record, SessionRecord):
        return record.session_id
    if isinstance(record, SamplerRecord):
        return session_of(record.sampling_session_id) if not record.named else None
    if isinstance(record, CallRecord | SampleRecord | ResultRecord):
        return session_of(record.request_id)
    return None


def record_from_json(data: dict[str, Any]) -> Record:
    """One line of the log back as its record; ValueError for a kind this server never wrote."""
    kind = data.get("kind")
    if kind == "session":
        return SessionRecord(data["session_id"])
    if kind == "sampler":
        fields = {k: v for k, v in data.items() if k != "kind"}
        return SamplerRecord(**fields)
    if kind == "unnamed_snapshots":
        return UnnamedSnapshotsRecord(tuple(data["exports"]))
    if kind == "resume":
        return ResumeRecord(data["next_seq"], data["position"])
    if kind == "call":
        body, encoding = decode_body(data["body"]), data.get("encoding")
        return CallRecord(data["route"], data["request_id"], data["seq"], body, encoding)
    if kind == "sample":
        return SampleRecord(data["request_id"], data["body"])
    if kind == "forgotten":
        return ForgottenRecord(tuple(data["session_ids"]))
    if kind == "result":
        if "error" in data:
            outcome: Outcome = Failed(data["error"], data["category"])
        else:
            outcome = Done(decode_body(data["body"]))
        extras = {name: data.get(name) for name in RESULT_EXTRAS}
        return ResultRecord(data["request_id"], outcome, **extras)
    raise ValueError(f"a request-log record of unknown kind {kind!r}")
