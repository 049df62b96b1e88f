"""The wire contract: the generated code matches protos/, and the .proto is documented."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

REPO_ROOT = Path(__file__).resolve().parents[1]
SESSION_PROTO = REPO_ROOT / "protos" / "trainwire" / "v1" / "session.proto"


def _load_generate_protos():
    spec = importlib.util.spec_from_file_location(
        "generate_protos", REPO_ROOT / "tools" / "generate_protos.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate_protos = _load_generate_protos()


@pytest.fixture(scope="module")
def fresh_session_file() -> descriptor_pb2.FileDescriptorProto:
    """session.proto compiled now, so the comparison holds whichever grpcio-tools made the code."""
    descriptor_set = descriptor_pb2.FileDescriptorSet.FromString(
        generate_protos.compile_descriptor_set()
    )
    (file,) = [f for f in descriptor_set.file if f.name == "trainwire/v1/session.proto"]
    return file


def test_export_weights_streams_and_every_other_call_is_unary(fresh_session_file):
    (service,) = fresh_session_file.service
    kinds = {method.name: generate_protos.method_kind(method) for method in service.method}

    assert kinds.pop("ExportWeights") == "unary_stream"
    assert set(kinds.values()) == {"unary_unary"}


def test_the_generated_code_is_fresh():
    """The one freshness check, the same that ``generate_protos.py --check`` runs: messages,
    stubs and servicer methods against protos/ compiled now (whichever grpcio-tools made them)."""
    assert generate_protos.stale_reasons() == [], generate_protos.REGENERATE_HINT


def test_the_freshness_check_notices_a_changed_proto(tmp_path):
    protos = tmp_path / "protos"
    shutil.copytree(SESSION_PROTO.parents[2], protos)
    changed = protos / SESSION_PROTO.relative_to(SESSION_PROTO.parents[2])
    text = changed.read_text("utf-8")
    service = "service TrainingSessionService {\n"
    assert service in text
    changed.write_text(
        text.replace(service, service + "  rpc Ping(InfoRequest) returns (InfoResponse);\n")
    )

    reasons = generate_protos.stale_reasons(protos)

    assert any("session_pb2 does not match" in reason for reason in reasons), reasons
    assert any("stubs do not match" in reason for reason in reasons), reasons
    assert any("Servicer does not match" in reason for reason in reasons), reasons


# A declaration the comment check covers: message, enum, service, rpc, oneof, or a field or enum
# value (`[optional|repeated] [Type] name = N [options];`).
_DECLARATION = re.compile(
    r"^\s*(?:(?:message|enum|service|rpc|oneof)\s+\w+"
    r"|(?:(?:optional|repeated)\s+)?(?:map<[\w.]+,\s*[\w.]+>\s+|[\w.]+\s+)?\w+\s*=\s*\d+"
    r"\s*(?:\[[^\]]*\])?\s*;)"
)
_FIELD_OR_VALUE = re.compile(r"=\s*\d+\s*(?:\[[^\]]*\])?\s*;")


def _undocumented_declarations(text: str) -> tuple[list[str], int]:
    """(declarations whose previous non-blank line is not a `//` comment, count of fields)."""
    undocumented, field_count, previous = [], 0, ""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        if _DECLARATION.match(line) and not stripped.startswith("//"):
            if _FIELD_OR_VALUE.search(stripped):
                field_count += 1
            if not previous.startswith("//"):
                undocumented.append(f"line {number}: {stripped}")
        previous = stripped
    return undocumented, field_count


def test_every_message_rpc_and_field_is_documented(fresh_session_file):
    undocumented, field_count = _undocumented_declarations(SESSION_PROTO.read_text("utf-8"))

    assert undocumented == [], "add a // comment above:\n" + "\n".join(undocumented)
    # The rough parser must have seen every field and enum value protoc saw.
    messages = list(fresh_session_file.message_type)
    enums = list(fresh_session_file.enum_type)
    fields = 0
    while messages:
        message = messages.pop()
        if message.options.map_entry:
            continue  # a map field's generated key/value entry, declared as the map field
        messages += message.nested_type
        enums += message.enum_type
        fields += len(message.field)
    assert field_count == fields + sum(len(enum.value) for enum in enums)
