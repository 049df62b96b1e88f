"""The wire contract: the generated code matches protos/, and the .proto is documented."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

REPO_ROOT = Path(__file__).resolve().parents[1]
SESSION_PROTO = REPO_ROOT / "protos" / "trainwire" / "v1" / "session.proto"
REGENERATE = "run: python tools/generate_protos.py"


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


def test_generated_messages_match_the_proto(fresh_session_file):
    from trainwire.v1 import session_pb2

    generated = descriptor_pb2.FileDescriptorProto.FromString(session_pb2.DESCRIPTOR.serialized_pb)

    assert generate_protos.comparable(generated) == generate_protos.comparable(
        fresh_session_file
    ), f"trainwire/v1/session_pb2.py is stale; {REGENERATE}"


def test_generated_stub_methods_match_the_proto_services(fresh_session_file):
    from trainwire.v1 import session_pb2_grpc

    expected = {
        f"/{fresh_session_file.package}.{service.name}/{method.name}": (
            generate_protos.method_kind(method)
        )
        for service in fresh_session_file.service
        for method in service.method
    }

    assert generate_protos.stub_methods(session_pb2_grpc) == expected, (
        f"trainwire/v1/session_pb2_grpc.py is stale; {REGENERATE}"
    )
    servicer_methods = {
        name
        for name in vars(session_pb2_grpc.TrainingSessionServiceServicer)
        if not name.startswith("_")
    }
    assert servicer_methods == {path.rsplit("/", 1)[1] for path in expected}, REGENERATE


def test_export_weights_streams_and_every_other_call_is_unary(fresh_session_file):
    (service,) = fresh_session_file.service
    kinds = {method.name: generate_protos.method_kind(method) for method in service.method}

    assert kinds.pop("ExportWeights") == "unary_stream"
    assert set(kinds.values()) == {"unary_unary"}


def test_check_reports_fresh_code():
    assert generate_protos.stale_reasons() == [], REGENERATE


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


def test_wire_modules_import_without_torch():
    probe = (
        "import sys\n"
        "import trainwire.v1.session_pb2, trainwire.v1.session_pb2_grpc\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)

    assert done.returncode == 0, done.stderr
