"""The request store's records, typed: what the intake writes down so a restart loses nothing.

Each record is a frozen dataclass; ``to_json`` gives the one JSON object a row of the store holds
(its ``kind`` names the record type, and is written here only) and ``record_from_json`` reads it
back.

- ``SessionRecord``: a client session the server created (a Tinker SDK session); the requests
  made under it are its own (``Intake.owner_of``).
- ``NoteRecord``: a transport's own state, kept in the store so a restart has it before the
  requests that use it (the Tinker front's sampling sessions): its kind and fields are the
  transport's, and its ``owner`` the client session it goes with (None: the server's).
- ``ResumeRecord``: where a compacted stream resumes: its next seq and the journal position of
  the checkpoint it was compacted at.
- ``CallRecord``: an accepted ordered request, typed (its operation and request), as a restart
  queues it again.
- ``SampleRecord``: an accepted unordered request (a sample).
- ``ResultRecord``: a result the journal does not hold (a forward, a sample, any failure), or,
  in a compacted store, one whose request's record is gone but which is still kept (see
  ``results``'s retention): then with its payload's digest and when it was resolved and handed out.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainwire.server.service.results import Done, Failed, Outcome, Resolved

Body = dict[str, Any] | bytes  # a JSON request or result, or encoded bytes (protobuf)


def digest(value: Any) -> str:
    """What a request's number is bound to: a re-send must carry the same payload."""
    return payload(value)[0]


def payload(value: Any) -> tuple[str, int]:
    """A request body's digest and its size in bytes (JSON as it is hashed)."""
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest(), len(data)


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
class NoteRecord:
    """A transport's own state: ``kind`` (never one of this module's), ``fields`` (JSON), and
    the client session it goes with."""

    kind: str
    fields: dict[str, Any]
    owner: str | None = None

    def to_json(self) -> dict[str, Any]:
        owner = {} if self.owner is None else {"owner": self.owner}
        return {**self.fields, **owner, "kind": self.kind}


@dataclass(frozen=True)
class ResumeRecord:
    next_seq: int
    position: int
    stream: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "resume",
            "next_seq": self.next_seq,
            "position": self.position,
            "stream": self.stream,
        }


@dataclass(frozen=True)
class CallRecord:
    """An accepted ordered call, typed: what a restart queues again with no transport's help.

    ``operation`` (a kind of the host's operation table) on ``body`` (its request, as
    ``request_bodies`` stores it) for run ``run_id``; ``digest`` is what a re-send must match
    and ``size`` the bytes it holds while it waits. ``answer`` names the transport's encoder of
    its response and ``note`` (JSON) is what the transport records once it applied (both the
    transport's, handed back as they are). A call refused when it was accepted still holds its
    number: ``refused`` is why (then it has no operation), answered again after a restart."""

    request_id: str
    seq: int
    operation: str
    body: Body
    digest: str
    size: int
    run_id: str = ""
    answer: str = ""
    note: dict[str, Any] | None = None
    refused: str | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"kind": "call", "request_id": self.request_id, "seq": self.seq}
        record.update(operation=self.operation, body=encode_body(self.body))
        record.update(digest=self.digest, size=self.size, run_id=self.run_id, answer=self.answer)
        if self.note is not None:
            record["note"] = self.note
        if self.refused is not None:
            record["refused"] = self.refused
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


Record = SessionRecord | NoteRecord | ResumeRecord | CallRecord | SampleRecord | ResultRecord


def owner_of_record(record: Record, owner_of: Callable[[str], str]) -> str | None:
    """The client session a record belongs to (None: the server's, as where to resume, or a note
    that outlives the session that made it); ``owner_of`` reads it from a request id."""
    if isinstance(record, SessionRecord):
        return record.session_id
    if isinstance(record, NoteRecord):
        return record.owner
    if isinstance(record, CallRecord | SampleRecord | ResultRecord):
        return owner_of(record.request_id)
    return None


def record_from_json(data: dict[str, Any]) -> Record:
    """A stored record's JSON back as its record (a kind not of this module is a transport's
    note); ValueError for JSON that is not a record."""
    kind = data.get("kind")
    if kind == "session":
        return SessionRecord(data["session_id"])
    if kind == "resume":
        return ResumeRecord(data["next_seq"], data["position"], data["stream"])
    if kind == "call":
        return CallRecord(
            data["request_id"],
            data["seq"],
            data["operation"],
            decode_body(data["body"]),
            data["digest"],
            data["size"],
            data["run_id"],
            data["answer"],
            data.get("note"),
            data.get("refused"),
        )
    if kind == "sample":
        return SampleRecord(data["request_id"], data["body"])
    if kind == "result":
        if "error" in data:
            outcome: Outcome = Failed(data["error"], data["category"])
        else:
            outcome = Done(decode_body(data["body"]))
        extras = {name: data.get(name) for name in RESULT_EXTRAS}
        return ResultRecord(data["request_id"], outcome, **extras)
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"a request-store record without a kind: {data!r}")
    fields = {k: v for k, v in data.items() if k not in ("kind", "owner")}
    return NoteRecord(kind, fields, data.get("owner"))
